"""EAGLE-2 dynamic tree expansion and rerank: the one implementation every drafting backend runs.

A backend supplies two functions over R rows: `children`, the top-k drafts after drafter outputs, and `run`, one
drafter forward over a frontier. `expand_tree` does the rest (SafeAILab/EAGLE `eagle/model/cnets.py`
`topK_genrate`). For depth D, branching k and a budget of N nodes:

    step 1       top-k of each row's last drafter output -> k nodes at depth 1 (score = draft log-probability)
    step d ≤ D   run the k frontier nodes (all at the same position); each proposes its top-k children with
                 cumulative score; all k² are recorded, the best k become the frontier
    rerank       keep the N best recorded nodes in record order; a child never scores above its parent, so ties
                 going to the lower record index keep every parent ahead of its children

Fixed shapes and no host reads, so the fast backends capture it in CUDA graphs and compile it with inductor;
`ranked` picks the comparison-based top-k and rerank that inductor fuses (`eagle3.fast.drafter.ranked_top_k`).
A chain is the tree of top-k 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eagle3.config import DraftShape
from eagle3.decoding.sampling import SamplingRows, coupled_draft_scores

# children(out [R, T, H], step) -> (draft log-probabilities [R, T, k], draft ids [R, T, k]) for the token `step`
# places after each row's first drafted one; under a `Constrain`, children(out, step, allowed) with what it
# returned: the tokens each output may propose
Children = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# constrain(step, frontier [R, T] record indices (None: the roots, T = 1), tokens [R, records] target ids, parents
# [R, records] record indices (-1: the root)) -> allowed bool [R, T, V] in target ids, or None: what may follow
# each frontier node at expansion step `step` (a grammar, `eagle3.decoding.grammar`); it may read the host
Constrain = Callable[[int, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], torch.Tensor | None]
# run(step, hidden [R, k, H], tokens [R, k], ancestry bool [R, k, step·k]) -> drafter outputs [R, k, H]: the
# frontier's forward at depth `step`; ancestry says which of the expansion's earlier rows (k per step, in step
# order) each frontier node descends from, itself included
Run = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Two-stage top-k above this width: torch.topk over a few long rows runs one thread block per row; top-k within
# chunks first spreads the work over many blocks.
TOPK_CHUNK = 256
# `ranked` top-k: candidates come from the k chunks of this width with the largest maxima.
RANK_CHUNK = 64


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Each element's place [..., R] in a stable descending sort of x [..., R] (equal values: the lower index
    first), counted from R x R comparisons instead of sorted."""
    ar = torch.arange(x.shape[-1], device=x.device)
    a, b = x[..., :, None], x[..., None, :]  # element i, element j
    return ((b > a) | ((b == a) & (ar[None, :] < ar[:, None]))).sum(dim=-1)  # j sorts before i, counted


def _place(slot: torch.Tensor, n: int) -> torch.Tensor:
    """Indices [..., n]: out[..., slot[i]] = i for every slot[i] < n (each slot below n taken once; 0 where none).

    By comparisons ([..., n, R], summed) rather than a scatter: inductor leaves an int64 or bool scatter on CUDA
    to a separate aten kernel (tens of them per tree cycle), while comparisons and sums fuse with the ranking
    around them."""
    ar_r = torch.arange(slot.shape[-1], device=slot.device)
    ar_n = torch.arange(n, device=slot.device)
    return ((slot[..., None, :] == ar_n[:, None]) * ar_r).sum(dim=-1)  # [..., n]


def _ranked(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of x [..., R] in descending order and their indices, by `_ranks`."""
    idx = _place(_ranks(x), k)  # [..., k]
    return x.gather(-1, idx), idx


def top_k_last(x: torch.Tensor, k: int, ranked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1)` (values descending, their indices) over [..., V]; among exactly equal values the order
    may differ from torch.topk's.

    k = 1 is a max. Otherwise, when V is a multiple of the chunk width and wider than it, in two stages: the best
    k of each chunk, then the best k of those (torch.topk), or with `ranked` (`ranked_top_k`) in three: the k
    chunks of `RANK_CHUNK` with the largest maxima, which hold the k largest values; the best k within each of
    them; the best k of those k·k, all by `_ranked`. Ranking each chosen chunk on its own takes k·C² comparisons
    where ranking their k·C values together took (k·C)² (for a 6,10,60 tree's [10, 12,288] log-probabilities:
    0.5 M instead of 4.1 M per draft step).
    """
    v = x.shape[-1]
    if k == 1:
        vals, idx = x.max(dim=-1, keepdim=True)
        return vals, idx
    if ranked:
        c = RANK_CHUNK
        if v <= c or v % c or k > v // c or k > c:
            return _ranked(x, k)
        chunks = x.unflatten(-1, (v // c, c))  # [..., n, C]
        _, ci = _ranked(chunks.amax(dim=-1), k)  # [..., k] the chunks holding the k largest values
        cand = chunks.gather(-2, ci[..., None].expand(*ci.shape, c))  # [..., k, C]
        cv, cj = _ranked(cand, k)  # [..., k, k] each chosen chunk's best k, their places in it
        vals, at = _ranked(cv.flatten(-2), k)  # [..., k] the best of those, at = chunk rank · k + place
        return vals, ci.gather(-1, at // k) * c + cj.flatten(-2).gather(-1, at)
    if v <= TOPK_CHUNK or v % TOPK_CHUNK or k > TOPK_CHUNK:
        return x.topk(k, dim=-1)
    n = v // TOPK_CHUNK
    vals, idx = x.unflatten(-1, (n, TOPK_CHUNK)).topk(k, dim=-1, sorted=False)  # [..., n, k] (stage 2 orders)
    idx = idx + torch.arange(0, v, TOPK_CHUNK, device=x.device)[:, None]  # chunk offsets
    best, at = vals.flatten(-2).topk(k, dim=-1)  # [..., k]
    return best, idx.flatten(-2).gather(-1, at)


def top_n_in_order(scores: torch.Tensor, n: int, ranked: bool = False) -> torch.Tensor:
    """Indices [..., n] of the n best of `scores` [..., R] in increasing index order: the EAGLE-2 rerank,
    `sort(sort(-scores, stable=True).indices[..., :n]).values` (ties go to the lower index).

    With `ranked` (`ranked_top_k`) without sorting: the kept are those ranked below n (`_ranks`: R x R
    comparisons, 260k for a 6,10,60 tree's 510 records), each placed by the running count of kept ones before it.
    Identical keeps (tests/test_fast.py); compiled, it costs the same time as sorting.
    """
    if not ranked:
        order = torch.sort(-scores, dim=-1, stable=True).indices[..., :n]  # best first; parents before children
        return torch.sort(order, dim=-1).values
    kept = _ranks(scores) < n  # [..., R]
    return _place(torch.where(kept, kept.cumsum(dim=-1) - 1, n), n)


def force_single(lp: torch.Tensor, ids: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Children log-probabilities and target ids [R, T, k] where `allowed` [R, T, V] leaves a node one token: that
    token as its first child, certain (log-probability 0), and no other child (-inf). A grammar's forced token is
    then drafted whether or not the draft vocabulary has it, and the drafter drafts on past it."""
    one = (allowed.sum(dim=-1) == 1)[..., None]  # [R, T, 1]
    token = allowed.float().argmax(dim=-1, keepdim=True)  # [R, T, 1] the allowed token where one
    first = torch.arange(ids.shape[-1], device=ids.device) == 0  # [k]
    ids = torch.where(one & first, token, ids)
    lp = torch.where(one, torch.where(first, 0.0, float("-inf")), lp)
    return lp, ids


def coupled_top_k(logits: torch.Tensor, positions: torch.Tensor, rows: SamplingRows, mode: int,
                  draft_h: torch.Tensor, k: int, ranked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled request's top k drafts after logits [R, T, Vd], coupled to its own draws at positions [R]
    (`coupled_draft_scores`): their draft log-probabilities [R, T, k] and ids [R, T, k]."""
    perturbed, lq = coupled_draft_scores(logits, positions, rows, mode, draft_h)
    ids = top_k_last(perturbed, k, ranked)[1]
    return lq.gather(-1, ids), ids


def expand_tree(
    last: torch.Tensor,  # [R, H] drafter output of each row's newest committed row
    shape: DraftShape,
    children: Children,
    run: Run,
    feedback: Callable[[torch.Tensor], torch.Tensor],  # drafter output -> the hidden state of the next step
    to_target: Callable[[torch.Tensor], torch.Tensor],  # draft-vocabulary ids -> target ids
    ranked: bool = False,
    until: Callable[[torch.Tensor], bool] | None = None,
    constrain: Constrain | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-2 tree of every row: target token ids [R, N] and parents [R, N] (node index, -1: the root), with
    N = min(shape.total, recorded nodes); parents precede their children. `until(frontier scores [R, k])`, read
    on the host before each further step, ends the expansion early when it returns True (a chain that stops
    where the drafter is unsure: cycles that run eagerly); `constrain` restricts each node's children, and where
    it allows one token, that token is the node's child (`force_single`)."""
    r, k, dev = last.shape[0], shape.top_k, last.device
    rec_tokens: list[torch.Tensor] = []  # per step: target ids [R, k or k²]
    rec_parents: list[torch.Tensor] = []  # per step: record indices [R, k or k²] (-1: the root)

    def propose(out: torch.Tensor, step: int, frontier: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Children of the frontier's outputs: log-probabilities and target ids [R, T, k]."""
        allowed = None
        if constrain is not None:
            tokens = torch.cat(rec_tokens, dim=1) if rec_tokens else None
            allowed = constrain(step, frontier, tokens, torch.cat(rec_parents, dim=1) if rec_tokens else None)
        if allowed is None:
            lp, ids = children(out, step)
            return lp, to_target(ids)
        lp, ids = children(out, step, allowed)
        return force_single(lp, to_target(ids), allowed)

    scores, ids = (t[:, 0] for t in propose(last[:, None], 0, None))  # [R, k]
    rec_scores = [scores]
    rec_tokens.append(ids)
    rec_parents.append(torch.full((r, k), -1, dtype=torch.long, device=dev))
    rows = torch.arange(r, device=dev)[:, None]  # [R, 1]
    ar_k = torch.arange(k, device=dev)
    eye = (ar_k[:, None] == ar_k[None, :]).expand(r, k, k)  # [R, k, k]
    frontier = ar_k.expand(r, k)  # [R, k] record indices of the frontier nodes
    f_hidden = feedback(last)[:, None].expand(r, k, -1)  # [R, k, H]
    f_scores = scores
    anc = eye  # [R, k, expansion rows so far]
    all_tokens = rec_tokens[0]  # [R, records]
    n_rec = k
    for step in range(1, shape.depth):
        if until is not None and until(f_scores):
            break
        out = run(step, f_hidden, all_tokens.gather(1, frontier), anc)  # [R, k, H]
        top_lp, top_ids = propose(out, step, frontier)  # [R, k, k]
        cum = (f_scores[:, :, None] + top_lp).reshape(r, k * k)  # [R, k²]
        rec_scores.append(cum)
        rec_tokens.append(top_ids.reshape(r, k * k))
        rec_parents.append(frontier[:, :, None].expand(r, k, k).reshape(r, k * k))
        all_tokens = torch.cat(rec_tokens, dim=1)
        best = top_k_last(cum, k, ranked)[1]  # [R, k] among this step's k²
        parent_row = best // k  # [R, k] the frontier row each new frontier node extends
        frontier = n_rec + best
        n_rec += k * k
        f_scores = cum.gather(1, best)
        f_hidden = feedback(out)[rows, parent_row]  # [R, k, H]
        anc = torch.cat([anc[rows, parent_row], eye], dim=2)  # [R, k, (step+1)·k]
    all_scores = torch.cat(rec_scores, dim=1)  # [R, records]
    all_parents = torch.cat(rec_parents, dim=1)
    n = min(shape.total, all_scores.shape[1])
    keep = top_n_in_order(all_scores, n, ranked)  # [R, N] the best N in record order
    parents = all_parents.gather(1, keep)  # [R, N] record indices (-1: root)
    hit = keep[:, None, :] == parents[:, :, None]  # [R, N, N]: node j is node i's parent (no scatter: `_place`)
    parents = torch.where(hit.any(dim=-1), (hit * torch.arange(n, device=dev)).sum(dim=-1), -1)
    return all_tokens.gather(1, keep), parents
