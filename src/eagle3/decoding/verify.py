"""Accept a draft tree against the target's choices, losslessly, for greedy and sampled requests alike.

The target scores `[root, node 0, ..., node N-1]` in one pass; row `u` of its logits is the next-token
prediction after node `u` (N+1 indexing, see `DraftTree`). `eagle3.decoding.sampling.choose` turns each row into
the target's *choice* after that node: the argmax at temperature 0, else the draw keyed by the predicted token's
position. Those choices are what plain decoding would emit after each node, so acceptance walks down from the
root following the child whose token equals the choice after its parent, and ends with the choice after the
deepest accepted node (the bonus token after a fully accepted path, the correction after a rejection). A cycle
always emits `len(path) + 1` tokens, and a speculative run emits exactly the tokens plain decoding emits with
the same seed: greedy decoding's token for token, and sampled text distributed exactly as the target's
(SafeAILab/EAGLE `eagle/model/utils.py` `evaluate_posterior` at temperature 0; at temperature > 0 this replaces
its residual rule, whose outcome depends on the draws spent on rejected drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from eagle3.decoding.tree import DraftTree, ancestry

__all__ = ["Acceptance", "Accepted", "accept", "accept_rows"]


class Accepted(NamedTuple):
    """Acceptance of R trees at once (`accept_rows`), as fixed-shape tensors."""

    keep: torch.Tensor  # [R, D+1] long: the root (0), then the accepted node at each depth (N+1 indexing), 0-padded
    n_acc: torch.Tensor  # [R] long: accepted nodes
    bonus: torch.Tensor  # [R] long: the target's choice after the deepest accepted node (or the root)
    drafted: torch.Tensor  # [R] long: the deepest valid node's depth
    emitted: torch.Tensor | None  # [R, D+1] long: the accepted tokens, then the bonus at n_acc (padded); needs root


def accept_rows(
    tokens: torch.Tensor,  # [R, N] draft tokens (padding: -1, or invalid in `valid`)
    parents1: torch.Tensor,  # [R, N+1] parents, N+1 indexing
    anc: torch.Tensor,  # bool [R, N+1, N+1] from `ancestry`
    top: torch.Tensor,  # [R, N+1] the target's choice after the root and after each node
    depth: int,  # D, the trees' maximum depth
    valid: torch.Tensor | None = None,  # bool [R, N]: nodes that count (None: all)
    root: torch.Tensor | None = None,  # [R] each tree's root token, for `Accepted.emitted`
) -> Accepted:
    """The rule of `accept` for R trees: from the root, follow the child whose token is the target's choice after
    its parent (the first of equal siblings). Fixed shapes, no host reads: CUDA graphs capture it."""
    r, n = tokens.shape
    dev = tokens.device
    if n == 0:
        zero = torch.zeros(r, dtype=torch.long, device=dev)
        emitted = None if root is None else top[:, :1].expand(r, depth + 1)
        return Accepted(torch.zeros(r, depth + 1, dtype=torch.long, device=dev), zero, top[:, 0], zero, emitted)
    ar = torch.arange(max(n, depth) + 1, device=dev)
    par = parents1[:, 1:]  # [R, N]
    match = tokens == top.gather(1, par)  # [R, N] the draft equals the choice after its parent
    if valid is not None:
        match = match & valid
    same = (par[:, :, None] == par[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])  # [R, N, N] siblings
    earlier = ar[None, :n] < ar[:n, None]  # [N, N] j < i
    ok = match & ~(same & earlier).any(dim=-1)  # [R, N] the first of equal siblings only
    a = anc[:, 1:, 1:]  # [R, N, N] draft-node ancestors, self included
    accepted = ~(a & ~ok[:, None, :]).any(dim=-1)  # [R, N] every node on its path is ok: one root path
    node_depth = a.sum(dim=-1)  # [R, N] 1 for children of the root
    n_acc = accepted.sum(dim=-1)  # [R]
    at_depth = accepted[:, None, :] & (node_depth[:, None, :] == ar[1 : depth + 1, None])  # [R, D, N] one-hot
    path = (at_depth.long() * ar[1 : n + 1]).sum(dim=-1)  # [R, D] the node at depth i+1, or 0
    keep = torch.cat([torch.zeros(r, 1, dtype=torch.long, device=dev), path], dim=1)  # [R, D+1]
    bonus = top.gather(1, keep.gather(1, n_acc[:, None]))[:, 0]  # [R]
    drafted = (node_depth if valid is None else node_depth * valid).amax(dim=-1)  # [R]
    emitted = None
    if root is not None:
        tok1 = torch.cat([root[:, None], tokens], dim=1)  # [R, N+1]
        at_end = ar[: depth + 1] == n_acc[:, None]  # [R, D+1]
        emitted = torch.where(at_end, bonus[:, None], torch.cat([tok1.gather(1, path), bonus[:, None]], dim=1))
    return Accepted(keep, n_acc, bonus, drafted, emitted)


@dataclass
class Acceptance:
    """Outcome of one verification: accepted nodes (N+1 indexing, root to deepest) and the next token."""

    path: list[int]
    next_token: int

    @property
    def n_accepted(self) -> int:
        return len(self.path)

    def emitted(self, tree: DraftTree) -> list[int]:
        """Token ids this cycle emits: the accepted drafts, then `next_token`."""
        if not self.path:
            return [self.next_token]
        idx = torch.tensor(self.path, dtype=torch.long, device=tree.tokens.device) - 1  # [A]
        return [*tree.tokens[idx].tolist(), self.next_token]


def accept(tree: DraftTree, choices: torch.Tensor) -> Acceptance:
    """Follow, from the root, the child whose token is the target's choice after its parent (`choices` [N+1],
    long: the choice after the root and after each node).

    Among siblings with the same token, the first one is followed, even if a later duplicate has a deeper
    matching subtree. `accept_rows` for one tree; one device-to-host copy at the end.
    """
    if choices.dim() != 1 or choices.shape[0] != tree.n + 1:
        raise ValueError(
            f"choices has shape {tuple(choices.shape)}; expected [N+1] = [{tree.n + 1}] "
            "(the target's choice after the root and after each draft node)"
        )
    tree = tree.to(choices.device)
    parents1 = tree.parents1()[None]  # [1, N+1]
    acc = accept_rows(tree.tokens[None], parents1, ancestry(parents1, tree.n), choices[None], tree.n)
    packed = torch.cat([acc.n_acc, acc.bonus, acc.keep[0, 1:]]).tolist()  # one host sync
    return Acceptance(path=packed[2 : 2 + packed[0]], next_token=packed[1])
