"""Training-time test (TTT): the unrolled EAGLE-3 drafter forward, its attention masks, loss and accuracy.

The drafter is trained on the situation it meets when drafting: step 0 reads target features, steps 1..K-1
read its own previous (pre-norm) output, and every step is scored against the target's distribution.
Follows SafeAILab/EAGLE `eagle/traineagle3/cnets.py` (`Model.forward`, `dataprepare`) and reference §B.3-B.4.

Alignment (row t of a document x_0 .. x_{n-1}; g_t = target aux features at t; z_j = target logits at j,
the target's distribution over x_{j+1}):

    step k   hidden                token      RoPE position   target     weight (loss_mask convention)
    0        fc(g_t)               x_{t+1}    t               z_{t+1}    loss_mask[t+2]
    k >= 1   feedback(out^{k-1}_t) x_{t+1+k}  t + k           z_{t+1+k}  loss_mask[t+2+k]

Tokens are teacher forced (ground truth, pitfall 9). Worked example, n = 6, row t = 1:

    step 0: g_1 + x_2 at position 1 -> z_2 (predicts x_3), weight loss_mask[3]; keys K0[0], K0[1]
    step 1: out^0_1 + x_3 at position 2 -> z_3 (predicts x_4), weight loss_mask[4]; keys K0[0], K0[1], K1[1]
    step 2: out^1_1 + x_4 at position 3 -> z_4 (predicts x_5), weight loss_mask[5]; keys K0[0..1], K1[1], K2[1]
    step 3: would need x_6 -> row 1 is out of the document at step 3 and carries no weight.

Attention at step k (pitfall 10): a query row t sees the step-0 keys of rows s <= t of its own document
(non-padding) plus the keys that row t itself produced at steps 1..k: exactly a draft-tree node at depth k
seeing the accepted prefix and its own k ancestors. `DrafterKV` appends one block of T keys per step, so
step k runs against [K0 | K1 | ... | Kk] with the mask `step_mask` describes; the drafter receives it in the
structured form `ttt_mask` builds (`eagle3.drafter.ttt_attention`), which costs one step-0 attention per step. A plain causal mask over the
concatenated blocks would let row t see other rows' later-step keys, which inference never provides.

Loss-mask convention. `loss_mask[i] = 1` marks token x_i as one the target wrote (an assistant token). A
prediction of x_{j+1} from z_j is weighted by `loss_mask[j+1]`, i.e. the drafter is trained exactly on
the tokens it will be asked to draft. EAGLE/SpecForge weight it by `loss_mask[j-1]` and speculators by
`loss_mask[j]` (reference §B.3 "Mask alignment subtlety"); the conventions differ only at the one or two
tokens at each span boundary. Supervised positions whose target argmax lies outside the draft vocabulary
add no loss (official; speculators keeps them), but still count as misses in the accuracy, since such a
token can never be drafted.

Reduction: loss_k = (sum of soft cross-entropies over supervised, in-vocabulary positions) / N_k, where
N_k is the number of supervised positions (`step_supervision`); total = sum_k decay^k * loss_k. EAGLE and
SpecForge divide by all B x T positions instead, masked ones included, so their loss value and gradient
shrink with padding and with the share of prompt tokens (AdamW's step barely notices a constant scale, but
gradient clipping and loss-based comparisons do); ours is a per-token mean over the tokens that matter
(pitfall 12). N_k depends only on the data, so a trainer can compute it for the
*global* batch before any forward pass and pass it as `denominators`: data-parallel ranks and
gradient-accumulation micro-batches then add up exactly to one big batch.

Reachable steps only (`align_top_k` = K > 0). At inference, row t's step k drafts only if every earlier step of
that row put the next token among the candidates the drafting keeps: the top-1 for a chain, the top-K of each
node for a tree (EAGLE-2 branches by the top_k of each expanded node). With K > 0, a scored row of step k adds
loss only if the data token each of its earlier steps was teacher-forced with (x_{t+2+j}, j < k) was among that
step's K highest draft logits; other rows still count in N_k and in the accuracies, so a step's loss weight
shrinks with the share of its rows that inference can reach, and training spends the drafter's one layer on the
states it will meet. Rows whose earlier labels are not supervised (prompt tokens) stay reachable. K = 0 (the
default) scores every row, as EAGLE-3 does.

Label temperature (`label_temperature` = tau). The soft labels are softmax(z / tau) over the draft vocabulary:
tau = 1 (the default) is EAGLE-3's distillation to the target's distribution; tau < 1 sharpens it towards the
target's greedy choice, which is all that greedy verification accepts; tau = 0 is the hard limit, a one-hot label
on the target's argmax within the draft vocabulary (plain cross-entropy). The rows scored and the accuracies do
not change with tau, only what a scored row is pulled towards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from eagle3.drafter import DrafterKV, Eagle3Drafter, TTTMask

DEFAULT_TTT_STEPS = 7
DEFAULT_STEP_DECAY = 0.8
# Accuracy is also reported over the first EARLY_TOKENS tokens of each answer: a small target's long answers grow
# repetitive towards their end, so the whole-answer accuracy overstates the acceptance on a benchmark's first few
# hundred tokens (docs/training.md, "Where the drafter misses").
EARLY_TOKENS = 128


def shift_left(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, n:] padded with `fill` at the end to the same length (dim 1 is time)."""
    if n == 0:
        return x
    t = x.shape[1]
    if n >= t:
        return torch.full_like(x, fill)
    pad = torch.full((x.shape[0], n, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


def base_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Step-0 mask bool [B, T, T]: causal, same document, key not padding; the diagonal always (no empty rows).

    doc_ids: [B, T] int, one id per packed document, -1 on padding.
    """
    t = doc_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()  # [T, T]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, T(query), T(key)]
    keep = same & causal & (doc_ids[:, None, :] >= 0)
    return keep | torch.eye(t, dtype=torch.bool, device=doc_ids.device)


def step_mask(doc_ids: torch.Tensor, k: int, base: torch.Tensor | None = None) -> torch.Tensor:
    """Mask for TTT step k over keys [K0 | K1 | ... | Kk]: bool [B, 1, T, (k+1)·T] (True = attend).

    Block 0 is `base_mask`; block j >= 1 is the identity (row t sees only its own step-j key).
    """
    m0 = base_mask(doc_ids) if base is None else base  # [B, T, T]
    if k == 0:
        return m0[:, None]
    b, t = doc_ids.shape
    eye = torch.eye(t, dtype=torch.bool, device=doc_ids.device).expand(b, t, t)
    return torch.cat([m0, *([eye] * k)], dim=-1)[:, None]  # [B, 1, T, (k+1)T]


def step_supervision(
    loss_mask: torch.Tensor,  # [B, T] 0/1: token i was written by the target
    doc_ids: torch.Tensor,  # [B, T], -1 on padding
    k: int,
) -> torch.Tensor:
    """1.0 where row t is supervised at step k: the label x_{t+2+k} lies in row t's document and was written
    by the target (loss_mask[t+2+k] = 1), else 0.0.  [B, T]"""
    same_doc = (shift_left(doc_ids, 2 + k, -1) == doc_ids) & (doc_ids >= 0)
    return (same_doc & shift_left(loss_mask, 2 + k, 0).bool()).float()


def answer_positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Index of each supervised token within its run of supervised tokens of one document (0 = an answer's first
    token), -1 on unsupervised ones. [B, T] long. `doc_ids` [B, T] (packed rows): a run restarts at a document
    boundary."""
    sup = loss_mask.bool()
    idx = torch.arange(sup.shape[1], device=sup.device).expand_as(sup)  # [B, T]
    prev = torch.cat([torch.zeros_like(sup[:, :1]), sup[:, :-1]], dim=1)  # [B, T] previous token supervised
    if doc_ids is not None:
        prev = prev & torch.cat([torch.zeros_like(sup[:, :1]), doc_ids[:, 1:] == doc_ids[:, :-1]], dim=1)
    start = sup & ~prev  # first token of each run
    last_start = torch.where(start, idx, torch.full_like(idx, -1)).cummax(dim=1).values  # [B, T]
    return torch.where(sup, idx - last_start, torch.full_like(idx, -1))


def step_denominators(loss_mask: torch.Tensor, doc_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """N_k, the number of supervised positions per step, float [K]. For one document with loss mask m,
    N_k = sum(m[2 + k:]), so a trainer can count it straight from the data."""
    return torch.stack([step_supervision(loss_mask, doc_ids, k).sum() for k in range(steps)])


def one_document_rows(doc_ids: torch.Tensor) -> bool:
    """True where every row of doc_ids [B, T] is one document from position 0, right-padded (-1 after it)."""
    return bool((doc_ids[:, 0] == 0).all() & (doc_ids <= 0).all() & (doc_ids[:, 1:] <= doc_ids[:, :-1]).all())


def ttt_mask(doc_ids: torch.Tensor, one_doc: bool | None = None) -> TTTMask:
    """The TTT attention pattern of a batch (doc_ids [B, T], -1 on padding). Where every row is one document
    from position 0, right-padded, plain causal attention gives each document row exactly the step-0 keys of
    `base_mask` (padding comes after it), so the mask is left implicit and SDPA may use a causal flash kernel;
    padding rows then see other keys, but they carry no loss. Packed rows get the block-diagonal `base_mask`.
    `one_doc`: `one_document_rows(doc_ids)` where the caller knows it already (a trainer computes it on the host
    copy of the batch, so a device batch costs no wait)."""
    if one_doc is None:
        one_doc = one_document_rows(doc_ids)
    return TTTMask(None if one_doc else base_mask(doc_ids)[:, None])


@dataclass
class ScoredRows:
    """The rows TTT scores at each step: index [M, 3] long (step k, batch row b, position t) of every supervised
    row (`step_supervision`), steps in order and rows row-major within a step; per_step [K] their counts (host
    ints); one_doc as `one_document_rows`. It depends only on the loss mask and document ids, so a trainer builds
    it from the host copy of a batch and the step never waits for the device to learn its shapes."""

    index: torch.Tensor
    per_step: list[int]
    one_doc: bool

    @staticmethod
    def of(loss_mask: torch.Tensor, doc_ids: torch.Tensor, steps: int) -> ScoredRows:
        sel = torch.stack([step_supervision(loss_mask, doc_ids, k) > 0 for k in range(steps)])  # [K, B, T]
        per_step = sel.sum(dim=(1, 2)).tolist()
        return ScoredRows(sel.nonzero(), per_step, one_document_rows(doc_ids))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ScoredRows:
        return ScoredRows(self.index.to(device, non_blocking=non_blocking), self.per_step, self.one_doc)

    def pin_memory(self) -> ScoredRows:
        return ScoredRows(self.index.pin_memory(), self.per_step, self.one_doc)


def unroll(
    drafter: Eagle3Drafter,
    hidden: torch.Tensor,  # [B, T, H] = drafter.combine(aux)
    input_ids: torch.Tensor,  # [B, T] x_0 .. x_{T-1}
    position_ids: torch.Tensor,  # [B, T] position of row t inside its document
    doc_ids: torch.Tensor,  # [B, T], -1 on padding
    steps: int,
    one_doc: bool | None = None,  # see ttt_mask
) -> Iterator[torch.Tensor]:
    """Yield the pre-norm drafter output of each TTT step k = 0..steps-1, [B, T, H] (see module docstring)."""
    cache = DrafterKV()
    mask = ttt_mask(doc_ids, one_doc)  # the structured form of step_mask(doc_ids, k) for every k
    for k in range(steps):
        ids_k = shift_left(input_ids, 1 + k, 0)  # [B, T] x_{t+1+k}, teacher forced
        out = drafter(hidden, ids_k, position_ids + k, mask=mask, cache=cache)  # [B, T, H]
        yield out
        hidden = drafter.feedback(out)


@dataclass
class TTTOutput:
    """`loss` carries the graph; the rest are detached per-step sums for logging (reduce across ranks first)."""

    loss: torch.Tensor  # scalar, sum_k decay^k * loss_k
    step_loss_sum: torch.Tensor  # [K] sum of weighted soft cross-entropies
    step_correct: torch.Tensor  # [K] supervised positions where the drafter's argmax equals the target's
    step_count: torch.Tensor  # [K] supervised positions (N_k of this batch)
    step_kept: torch.Tensor  # [K] supervised positions that add loss: target argmax in the draft vocabulary (and,
    # with align_top_k, reachable)
    step_early_correct: torch.Tensor  # [K] as step_correct, for labels among their answer's first EARLY_TOKENS
    step_early_count: torch.Tensor  # [K] supervised positions whose label is among the first EARLY_TOKENS


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """-sum_v softmax(target / temperature)_v * log_softmax(logits)_v in fp32, [...] (both inputs [..., Vd]);
    temperature 0: the cross-entropy to the target's argmax (one-hot labels)."""
    logq = torch.log_softmax(logits.float(), dim=-1)  # [..., Vd]
    if temperature == 0:
        return -logq.gather(-1, target_logits.argmax(-1, keepdim=True)).squeeze(-1)
    z = target_logits.float()
    p = torch.softmax(z if temperature == 1 else z / temperature, dim=-1)  # [..., Vd], over the draft vocab
    return -(p * logq).sum(-1)


def ttt_loss(
    drafter: Eagle3Drafter,
    aux: torch.Tensor,  # [B, T, 3Ht] target features
    input_ids: torch.Tensor,  # [B, T]
    position_ids: torch.Tensor,  # [B, T]
    doc_ids: torch.Tensor,  # [B, T], -1 on padding
    loss_mask: torch.Tensor,  # [B, T]
    target_logits: torch.Tensor,  # [B, T, Vd] target logits restricted to the draft vocabulary (t2d)
    target_argmax: torch.Tensor,  # [B, T] argmax of the full-vocabulary target logits (target ids)
    steps: int = DEFAULT_TTT_STEPS,
    step_decay: float = DEFAULT_STEP_DECAY,
    denominators: torch.Tensor | None = None,  # [K] global N_k; None = this batch's own
    denominator_scale: float = 1.0,  # world size under DDP (its gradient average divides by it)
    scored: ScoredRows | None = None,  # ScoredRows.of(loss_mask, doc_ids, steps) on this device; None = build it
    align_top_k: int = 0,  # > 0: score only rows inference can reach (module docstring, "Reachable steps only")
    label_temperature: float = 1.0,  # soft labels softmax(z / tau); 0: one-hot (module docstring, "Label temperature")
) -> TTTOutput:
    """The TTT objective: soft cross-entropy to the renormalised draft-vocab target, per step, summed with
    weights decay^k (see the module docstring for alignment and reduction)."""
    if align_top_k < 0:
        raise ValueError(f"align_top_k={align_top_k} must be >= 0 (0 scores every row)")
    if label_temperature < 0:
        raise ValueError(f"label_temperature={label_temperature} must be >= 0 (1: the target's distribution)")
    in_vocab = drafter.t2d[target_argmax]  # [B, T] bool
    if denominators is None:
        denominators = step_denominators(loss_mask, doc_ids, steps)
    denominators = denominators.to(aux.device, torch.float32).clamp_min(1.0)
    if scored is None:
        scored = ScoredRows.of(loss_mask, doc_ids, steps)  # on a GPU this reads counts, indices and layout back
    if len(scored.per_step) != steps:
        raise ValueError(f"scored rows are planned for {len(scored.per_step)} TTT steps, not {steps}")
    hidden = drafter.combine(aux)  # [B, T, H]
    answer_pos = answer_positions(loss_mask, doc_ids)  # [B, T]
    total = aux.new_zeros((), dtype=torch.float32)
    loss_sums, correct, counts, kept, early_correct, early_counts = [], [], [], [], [], []
    # Score only the supervised rows: gathering them before the head skips the lm_head and every [*, Vd] op on
    # padding, prompts and other documents (which may hold anything, NaN included) instead of computing and
    # zeroing them. A row whose target argmax lies outside the draft vocabulary adds no loss (weight 0 on a
    # finite cross-entropy: its target logits are those of a real position) and counts as a miss. Which rows
    # are scored depends only on the data, so `scored` can come from the host and nothing here waits for the
    # device.
    rows = scored.index.split(scored.per_step)  # per step [M_k, 3]: (step, b, t)
    # with align_top_k: whether each row's earlier steps all kept their next data token among their top K
    reachable = torch.ones(input_ids.shape, dtype=torch.bool, device=aux.device) if align_top_k else None  # [B, T]
    for k, (out, idx) in enumerate(zip(unroll(drafter, hidden, input_ids, position_ids, doc_ids, steps,
                                              scored.one_doc), rows, strict=True)):
        b, i = idx[:, 1], idx[:, 2]  # [M] batch row and position of each scored row
        logits = drafter.logits(out[b, i])  # [M, Vd]
        keep = in_vocab[b, i + 1 + k]  # [M] bool: the target's choice can be drafted
        if reachable is not None:
            keep = keep & reachable[b, i]
        ce = soft_cross_entropy(logits, target_logits[b, i + 1 + k], label_temperature)  # [M]
        step_sum = torch.where(keep, ce, 0.0).sum()
        total = total + (step_decay**k) * step_sum * denominator_scale / denominators[k]
        with torch.no_grad():
            sup = step_supervision(loss_mask, doc_ids, k)  # [B, T]
            pred = drafter.draft_ids_to_target(logits.argmax(-1))  # [M] target ids
            # supervised rows outside the draft vocabulary are misses: the drafter cannot emit their token
            hit = pred == target_argmax[b, i + 1 + k]  # [M]
            label_pos = shift_left(answer_pos, 2 + k, -1)  # [B, T] answer position of row t's label x_{t+2+k}
            early = (sup > 0) & (label_pos >= 0) & (label_pos < EARLY_TOKENS)  # [B, T]
            loss_sums.append(step_sum.detach())
            correct.append(hit.sum().to(torch.float32))
            counts.append(sup.sum())
            kept.append(keep.sum().to(torch.float32))
            early_correct.append((hit & early[b, i]).sum().to(torch.float32))
            early_counts.append(early.sum().to(torch.float32))
            if reachable is not None and k + 1 < steps:
                nxt = input_ids[b, i + 2 + k]  # [M] the token the next step is fed
                if align_top_k == 1:
                    proposed = pred == nxt  # [M]
                else:
                    top = logits.topk(min(align_top_k, logits.shape[-1]), dim=-1).indices  # [M, K] draft ids
                    proposed = (drafter.draft_ids_to_target(top) == nxt[:, None]).any(dim=-1)  # [M]
                reachable[b, i] = reachable[b, i] & proposed
    return TTTOutput(total, torch.stack(loss_sums), torch.stack(correct), torch.stack(counts), torch.stack(kept),
                     torch.stack(early_correct), torch.stack(early_counts))
