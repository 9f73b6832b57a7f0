"""EAGLE-2 tree expansion (`eagle3.decoding.expand.expand_tree`) against a plain-Python walk of the same rule, on a
synthetic drafter whose children depend on the whole path to a node."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import DraftShape
from eagle3.decoding.expand import expand_tree

VOCAB = 40
MOD = 1_000_003.0


def code_of(parent: float, token: int) -> float:
    """A node's drafter state: a number that names the path to it (exact in float64)."""
    return (parent * 31.0 + token + 1.0) % MOD


def log_probs(code: float) -> torch.Tensor:
    """The synthetic drafter's distribution [VOCAB] after a node, a function of its path alone."""
    g = torch.Generator().manual_seed(int(code))
    return torch.log_softmax(3.0 * torch.randn(VOCAB, generator=g, dtype=torch.float64), dim=-1)


def synthetic(k: int):
    """`expand_tree`'s children and run for the synthetic drafter: hidden states [R, T, 1] hold path codes."""

    def children(out: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        lp = torch.stack([torch.stack([log_probs(float(c)) for c in row[:, 0]]) for row in out])  # [R, T, V]
        return lp.topk(k, dim=-1)

    def run(step: int, hidden: torch.Tensor, tokens: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
        assert anc.shape == (*tokens.shape, step * k)
        return (hidden * 31.0 + tokens[..., None].double() + 1.0) % MOD  # [R, k, 1]

    return children, run


def reference(last: float, shape: DraftShape) -> tuple[list[int], list[int]]:
    """The EAGLE-2 rule walked node by node: record top-k children of the root, then at each step all k children of
    each of the k best frontier nodes; keep the `total` best records (ties: earlier record) in record order."""
    k = shape.top_k
    records = []  # (score, token, parent record, code)
    lp = log_probs(last)
    for tok in lp.topk(k).indices.tolist():
        records.append((float(lp[tok]), tok, -1, code_of(last, tok)))
    frontier = list(range(k))
    for _ in range(1, shape.depth):
        first = len(records)
        for f in frontier:
            score, _, _, code = records[f]
            lp = log_probs(code)
            for tok in lp.topk(k).indices.tolist():
                records.append((score + float(lp[tok]), tok, f, code_of(code, tok)))
        step = list(range(first, len(records)))
        frontier = sorted(step, key=lambda i: (-records[i][0], i))[:k]
    kept = sorted(sorted(range(len(records)), key=lambda i: (-records[i][0], i))[: shape.total])
    node = {rec: i for i, rec in enumerate(kept)}
    return [records[i][1] for i in kept], [node[records[i][2]] if records[i][2] >= 0 else -1 for i in kept]


@pytest.mark.parametrize("shape", [DraftShape(4, 3, 10), DraftShape(3, 4, 20), DraftShape(5, 2, 9),
                                   DraftShape.chain(4)])
@pytest.mark.parametrize("ranked", [False, True])
def test_expansion_matches_the_rule_walked_node_by_node(shape, ranked):
    last = torch.tensor([[17.0], [123.0], [4567.0]], dtype=torch.float64)  # three rows, three different trees
    children, run = synthetic(shape.top_k)
    tokens, parents = expand_tree(last, shape, children, run, lambda h: h, lambda ids: ids, ranked)
    assert tokens.shape == parents.shape == (3, shape.total)
    for r in range(3):
        want_tokens, want_parents = reference(float(last[r, 0]), shape)
        assert tokens[r].tolist() == want_tokens, r
        assert parents[r].tolist() == want_parents, r
        assert all(p < i for i, p in enumerate(want_parents))  # parents precede their children


def test_a_tree_of_top_k_one_is_a_chain():
    children, run = synthetic(1)
    tokens, parents = expand_tree(torch.tensor([[5.0]], dtype=torch.float64), DraftShape.chain(5), children, run,
                                  lambda h: h, lambda ids: ids)
    assert parents[0].tolist() == [-1, 0, 1, 2, 3]
    code, want = 5.0, []
    for _ in range(5):
        want.append(int(log_probs(code).argmax()))
        code = code_of(code, want[-1])
    assert tokens[0].tolist() == want


@pytest.mark.parametrize("shape", [DraftShape.chain(4), DraftShape(3, 3, 9)])
def test_a_token_the_grammar_forces_is_drafted_even_outside_the_draft_vocabulary(shape):
    """Where a constraint allows one token after a node, that token is the node's child (certain: the path's score
    does not fall) and drafting goes on below it, also where the draft vocabulary (here the even target ids) lacks
    it. The negative control: without the forcing the child would be a draft token, never the odd forced one."""
    k, forced = shape.top_k, 2 * 7 + 1  # target id 15: odd, outside the draft vocabulary
    _, run = synthetic(k)
    target_vocab = 2 * VOCAB

    def children(out, step, allowed=None):  # draft ids d are target ids 2d; restricted to what is allowed
        lp = torch.stack([torch.stack([log_probs(float(c)) for c in row[:, 0]]) for row in out])  # [R, T, Vd]
        if allowed is not None:
            ok = allowed[..., ::2]  # [R, T, Vd] in draft ids
            lp = torch.where(ok.any(dim=-1, keepdim=True), lp.masked_fill(~ok, float("-inf")), lp)
        return lp.topk(k, dim=-1)

    def constrain(step, frontier, tokens, parents):  # the root's child is forced; anything after it
        width = 1 if frontier is None else frontier.shape[1]
        allowed = torch.ones(1, width, target_vocab, dtype=torch.bool)
        if frontier is None:
            allowed[:] = False
            allowed[..., forced] = True
        return allowed

    tokens, parents = expand_tree(torch.tensor([[9.0]], dtype=torch.float64), shape, children, run, lambda h: h,
                                  lambda ids: 2 * ids, constrain=constrain)
    tokens, parents = tokens[0].tolist(), parents[0].tolist()
    assert tokens[0] == forced and parents[0] == -1
    assert parents.count(-1) == 1  # the forced token is the root's only child
    below = [t for t, p in zip(tokens, parents, strict=True) if p == 0]
    assert below and all(t % 2 == 0 for t in below)  # the drafter's own drafts continue past it
    free, _ = expand_tree(torch.tensor([[9.0]], dtype=torch.float64), shape, children, run, lambda h: h,
                          lambda ids: 2 * ids)
    assert forced not in free[0].tolist()
