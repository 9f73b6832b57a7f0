"""The draft tree that one verification step checks: tokens, parent pointers, and what the target needs.

A drafter (EAGLE-3 tree or chain, n-gram, ...) proposes a `DraftTree`; the target runs one forward pass over
`[root, node 0, ..., node N-1]` with `attention_mask()` and positions `prefix_len + position_offsets()`;
`eagle3.decoding.verify` then walks the tree. Chains are trees whose every node has one child.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DraftTree", "ancestry", "parents_with_root", "path_slots"]


def ancestry(parents1: torch.Tensor, depth: int) -> torch.Tensor:
    """Bool [..., N+1, N+1]: [i, j] iff node j is node i or one of its ancestors, for trees given by parents1
    [..., N+1] (N+1 indexing: the root is node 0 and its own parent; padding nodes hang off the root) whose paths
    are at most `depth` long. By pointer jumping: each step joins every node's set with that of its ancestor
    2^s levels up, so ceil(log2(depth)) steps of fixed shape, no host reads."""
    idx = torch.arange(parents1.shape[-1], device=parents1.device)
    anc = idx[:, None] == idx[None, :]  # self
    if depth < 1:  # the root alone
        return anc.expand(*parents1.shape, parents1.shape[-1])
    anc = anc | (parents1[..., :, None] == idx)  # self or parent
    up = parents1  # each node's ancestor `covered` levels up (the root stays the root)
    covered = 1
    while covered < depth:
        anc = anc | anc.gather(-2, up[..., :, None].expand(anc.shape))
        up = up.gather(-1, up)
        covered *= 2
    return anc


def path_slots(anc: torch.Tensor, first: torch.Tensor, depth: int) -> torch.Tensor:
    """Long [..., N+1, D+1]: for each node, the cache slot of its ancestor at depth j (itself at its own depth;
    `first` past it), where node i of a verification sits at slot first + i. anc [..., N+1, N+1] from `ancestry`,
    first [...] (or [1] for a single tree), D = `depth`. What attention by position reads as a node's path
    (`eagle3.fast.split_attention.Paths.tail`)."""
    n1 = anc.shape[-1]
    idx = torch.arange(n1, device=anc.device)
    at = anc[..., :, None, :] & ((anc.sum(dim=-1) - 1)[..., None, None, :] ==
                                 torch.arange(depth + 1, device=anc.device)[:, None])  # [..., N+1, D+1, N+1]
    return first.reshape(*anc.shape[:-2], 1, 1) + (at.long() * idx).sum(dim=-1)


def scratch_path_slots(anc: torch.Tensor, first: torch.Tensor, k: int) -> torch.Tensor:
    """Long [..., T, S]: for each of the T frontier rows of a drafting step, the scratch slot of its ancestor at
    each of the S steps so far (its own slot last), where step j's k rows sit at slots first + j·k + [0, k).
    anc [..., T, S·k] (bool: a row's ancestors and itself among the scratch rows, one per step), first [...]. What
    the drafter's attention by position reads as a row's path (`eagle3.fast.split_attention.Paths.tail`)."""
    *lead, t, sk = anc.shape
    steps = sk // k
    within = (anc.view(*lead, t, steps, k).long() * torch.arange(k, device=anc.device)).sum(dim=-1)  # [..., T, S]
    return first.reshape(*lead, 1, 1) + torch.arange(steps, device=anc.device) * k + within


def parents_with_root(parents: torch.Tensor) -> torch.Tensor:
    """Long [..., N+1]: parents [..., N] (-1: the root) in N+1 indexing, the root (node 0) its own parent."""
    return torch.cat([parents.new_zeros(*parents.shape[:-1], 1), parents + 1], dim=-1)


@dataclass
class DraftTree:
    """Draft nodes below a root, as token ids and parent pointers; parents precede children.

    The root is the last accepted token: the target has not scored it yet, it is part of the verification
    input, but it is not stored here. Two indexings are in use:

    * *node index* `i` in `0..N-1` for `tokens` and `parents` (`parents[i] == -1`: child of the root);
    * *N+1 indexing* for everything the target sees: `0` is the root and draft node `i` is `i + 1`
      (rows of the verification logits, `attention_mask()`, `position_offsets()`, `children()`, and
      `Acceptance.path`).

    Worked example (N = 5)::

                 root                         N+1 index:        0
               /      \\                                      /     \\
           "the"      "a"                                   1       2
           /    \\                                        /   \\
        "cat"  "dog"                                      3     4
          |                                               |
        "sat"                                             5

        tokens   = [the, a, cat, dog, sat]
        parents  = [-1, -1, 0, 0, 2]
        depths()            = [1, 1, 2, 2, 3]
        position_offsets()  = [0, 1, 1, 2, 2, 3]          # root first
        children()          = [[1, 2], [3, 4], [], [5], [], []]
        attention_mask()[5] = columns {0, 1, 3, 5} True    # "sat" sees root, "the", "cat", itself

    Row `j` of the verification logits is the target's prediction after node `j`, so the draft at node
    `3` ("cat") is checked against row `1` (after "the").
    """

    tokens: torch.Tensor  # [N] long, target-vocabulary ids
    parents: torch.Tensor  # [N] long, in -1..i-1

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.parents.dim() != 1:
            raise ValueError(
                f"DraftTree.tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} must be 1-D"
            )
        if self.tokens.shape != self.parents.shape:
            raise ValueError(
                f"DraftTree has {self.tokens.numel()} tokens but {self.parents.numel()} parents; "
                "give one parent per token"
            )

    # -- construction ------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Number of draft nodes N (the root excluded)."""
        return self.tokens.numel()

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> DraftTree:
        """No drafts: verification then only samples the next token after the root."""
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(tokens=z, parents=z.clone())

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> DraftTree:
        """A chain `root -> tokens[0] -> tokens[1] -> ...`."""
        tokens = tokens.reshape(-1).long()
        parents = torch.arange(tokens.numel(), device=tokens.device) - 1  # [N] = [-1, 0, 1, ...]
        return cls(tokens=tokens, parents=parents)

    def validate(self) -> None:
        """Raise ValueError unless every parent is -1 or an earlier node and every token id is >= 0."""
        if self.tokens.dtype != torch.long or self.parents.dtype != torch.long:
            raise ValueError(
                f"DraftTree tensors must be torch.long, got tokens {self.tokens.dtype}, parents {self.parents.dtype}"
            )
        for i, p in enumerate(self.parents.tolist()):
            if not -1 <= p < i:
                raise ValueError(
                    f"DraftTree node {i} has parent {p}; a parent must be -1 (the root) or an earlier node "
                    f"in 0..{i - 1} (sort nodes so that parents precede children)"
                )
        if self.n and int(self.tokens.min()) < 0:
            raise ValueError(f"DraftTree tokens must be vocabulary ids >= 0, got {self.tokens.tolist()}")

    # -- what the target needs ----------------------------------------------------------------
    def parents1(self) -> torch.Tensor:
        """Long [N+1]: each node's parent in N+1 indexing (the root, node 0, is its own parent)."""
        return parents_with_root(self.parents)

    def ancestors(self) -> torch.Tensor:
        """Bool [N+1, N+1]: entry [i, j] is True iff node j is node i or an ancestor of it (N+1 indexing)."""
        return ancestry(self.parents1(), self.n)

    def attention_mask(self) -> torch.Tensor:
        """Bool [N+1, N+1]: row i may attend to column j (itself and its ancestors; column 0 all True)."""
        return self.ancestors()

    def depths(self) -> torch.Tensor:
        """Long [N]: depth of each draft node, 1 for children of the root."""
        return self.position_offsets()[1:]

    def position_offsets(self) -> torch.Tensor:
        """Long [N+1]: depth of each node with the root at 0; positions are `prefix_len + offsets`."""
        return self.ancestors().sum(dim=-1) - 1  # [N+1]

    def children(self) -> list[list[int]]:
        """For each node in N+1 indexing, its children in N+1 indexing, in node order."""
        kids: list[list[int]] = [[] for _ in range(self.n + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i + 1)
        return kids

    def to(self, device: torch.device | str) -> DraftTree:
        """This tree with both tensors on `device` (itself when already there)."""
        device = torch.device(device)
        if self.tokens.device == device and self.parents.device == device:
            return self
        return DraftTree(tokens=self.tokens.to(device), parents=self.parents.to(device))
