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

import torch

from eagle3.decoding.tree import DraftTree

__all__ = ["Acceptance", "accept"]


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
    matching subtree. Vectorised over the tree; one device-to-host copy at the end.
    """
    if choices.dim() != 1 or choices.shape[0] != tree.n + 1:
        raise ValueError(
            f"choices has shape {tuple(choices.shape)}; expected [N+1] = [{tree.n + 1}] "
            "(the target's choice after the root and after each draft node)"
        )
    tree = tree.to(choices.device)
    top = choices  # [N+1] target choice after each node
    if tree.n == 0:
        return Acceptance(path=[], next_token=int(top[0]))
    n = tree.n
    match = tree.tokens == top[tree.parents + 1]  # [N] draft equals the choice after its parent
    same_parent = tree.parents[:, None] == tree.parents[None, :]  # [N, N]
    same_token = tree.tokens[:, None] == tree.tokens[None, :]  # [N, N]
    earlier = torch.ones(n, n, dtype=torch.bool, device=top.device).tril(-1)  # [N, N] j < i
    shadowed = (same_parent & same_token & earlier).any(dim=-1)  # [N] an earlier sibling has this token
    ok = match & ~shadowed  # [N] at most one ok child per node
    anc = tree.ancestors()[1:, 1:]  # [N, N] draft-node ancestors, self included
    accepted = ~(anc & ~ok[None, :]).any(dim=-1)  # [N] the whole path to this node is ok
    # accepted nodes form one root path; its deepest node has the most ancestors
    depth = anc.sum(dim=-1)  # [N]
    deepest = torch.where(accepted, depth, 0).argmax()  # scalar
    last = torch.where(accepted.any(), deepest + 1, 0)  # scalar, N+1 indexing (0: nothing accepted)
    packed = torch.cat([accepted.long(), top[last].view(1)]).tolist()  # one host sync
    path = [i + 1 for i, a in enumerate(packed[:-1]) if a]
    return Acceptance(path=path, next_token=int(packed[-1]))
