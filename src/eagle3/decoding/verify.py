"""Accept or reject a draft tree against the target's logits, losslessly (greedy and sampling).

The target scores `[root, node 0, ..., node N-1]` in one pass; row `u` of `target_logits` [N+1, V] is its
next-token prediction after node `u` (N+1 indexing, see `DraftTree`). Both rules walk down from the root and
return the accepted nodes plus one token sampled from the target (the bonus token after a fully accepted
path, or the correction token after a rejection), so a cycle always emits `len(path) + 1` tokens.

Greedy: follow the child whose token is the target's argmax (SafeAILab/EAGLE `eagle/model/utils.py`
`evaluate_posterior`, temperature 0). Output equals plain greedy decoding token for token.

Sampling: drafts are deterministic (top-k / argmax), i.e. point masses, so the speculative-sampling ratio
p(x)/q(x) becomes p(x). At node u with target distribution p, for each child x in order: accept with
probability p(x) / (remaining mass); on rejection set p(x) = 0 (the residual). If a child is accepted, move
there and restart with that node's p; if every child is rejected (or u is a leaf) sample the next token from
the residual p. This is EAGLE `evaluate_posterior` (temperature > 0) and vLLM's rejection sampler with
`draft_probs=None` (`vllm/v1/sample/rejection_sampler.py`), and it samples exactly from the target's
processed distribution. Using a draft softmax as q would be wrong here (reference pitfall 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.config import SamplingConfig
from eagle3.decoding.sampling import process_logits, sample
from eagle3.decoding.tree import DraftTree

__all__ = ["Acceptance", "accept", "accept_from_probs", "accept_greedy", "accept_sampling"]

# A child holding all but this much of the remaining mass is accepted outright, so float32 rounding of
# p(x) / remaining cannot reject the only token left (which would leave an all-zero residual). The bias
# this introduces in any output probability is below this value.
_MASS_EPS = 1e-6


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


def _check_logits(tree: DraftTree, target_logits: torch.Tensor) -> None:
    if target_logits.dim() != 2 or target_logits.shape[0] != tree.n + 1:
        raise ValueError(
            f"target_logits has shape {tuple(target_logits.shape)}; expected [N+1, V] = [{tree.n + 1}, V] "
            "(one row for the root and one per draft node)"
        )


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Acceptance:
    """Greedy acceptance: follow, from the root, the child whose token is the target's argmax.

    Among siblings with the same token, the first one is followed (as the sequential walk and the sampling
    rule do), even if a later duplicate has a deeper matching subtree. Vectorised
    over the tree; one device-to-host copy at the end.
    """
    _check_logits(tree, target_logits)
    tree = tree.to(target_logits.device)
    top = target_logits.argmax(dim=-1)  # [N+1] target choice after each node
    if tree.n == 0:
        return Acceptance(path=[], next_token=int(top[0]))
    n = tree.n
    match = tree.tokens == top[tree.parents + 1]  # [N] draft equals the argmax after its parent
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


def accept_from_probs(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> Acceptance:
    """Lossless sampling acceptance given the target's processed distributions `probs` [N+1, V].

    `generator` must live on `probs.device` (None: torch's default generator). One uniform per node is
    drawn up front (each is used at most once) and everything the walk reads is copied to the host in one
    transfer; the walk itself is plain Python over N small numbers, then one token is sampled on device.
    """
    _check_logits(tree, probs)
    tree = tree.to(probs.device)
    n = tree.n
    node, path, rejected = 0, [], []
    if n:
        p_draft = probs[tree.parents + 1, tree.tokens]  # [N] p(token of i | parent of i)
        u = torch.rand(n, generator=generator, device=probs.device)  # [N]
        row_mass = probs.sum(dim=-1)  # [N+1] ~1: the float32 total each residual starts from
        packed = torch.cat(
            [p_draft.double(), u.double(), row_mass.double(), tree.tokens.double(), tree.parents.double()]
        )
        host = packed.tolist()  # [5N+1], the one host sync of the walk
        p_host, u_host, mass_host = host[:n], host[n : 2 * n], host[2 * n : 3 * n + 1]
        tok_host = [int(t) for t in host[3 * n + 1 : 4 * n + 1]]
        kids: list[list[int]] = [[] for _ in range(n + 1)]
        for i, parent in enumerate(host[4 * n + 1 :]):
            kids[int(parent) + 1].append(i + 1)
        while kids[node]:
            remaining = mass_host[node]  # mass of p not yet zeroed at this node
            rejected = []
            for child in kids[node]:
                tok, px = tok_host[child - 1], p_host[child - 1]
                if tok in rejected:
                    continue  # a duplicate of a rejected sibling: its residual probability is 0
                if px > 0 and (px >= remaining - _MASS_EPS or u_host[child - 1] * remaining < px):
                    break  # accepted with probability px / remaining
                rejected.append(tok)
                remaining -= px
            else:
                break  # every child rejected: the next token comes from the residual at `node`
            node, rejected = child, []
            path.append(node)
    residual = probs[node]  # [V]
    if rejected:
        zeroed = residual.clone()
        zeroed[torch.tensor(rejected, dtype=torch.long, device=probs.device)] = 0.0
        residual = torch.where(zeroed.sum() > 0, zeroed, residual)  # guard: never sample an all-zero row
    return Acceptance(path=path, next_token=int(sample(residual, generator)))


def accept_sampling(
    tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> Acceptance:
    """Lossless sampling acceptance on raw target logits [N+1, V] (temperature, top-k, top-p applied here)."""
    if sampling.greedy:
        raise ValueError(
            "accept_sampling needs temperature > 0; use accept_greedy (or accept) for temperature 0"
        )
    _check_logits(tree, target_logits)
    probs = process_logits(target_logits, sampling.temperature, sampling.top_p, sampling.top_k)  # [N+1, V]
    return accept_from_probs(tree, probs, generator)


def accept(
    tree: DraftTree,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Greedy acceptance at temperature 0, lossless sampling acceptance otherwise."""
    if sampling.greedy:
        return accept_greedy(tree, target_logits)
    return accept_sampling(tree, target_logits, sampling, generator)
