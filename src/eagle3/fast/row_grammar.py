"""Cycles of `eagle3.fast.rows.FastRows` where a row follows a grammar (`eagle3.decoding.grammar`).

Such cycles run eagerly, because the host computes the masks between the device's steps:

    draft    at each expansion step, the host reads the frontier's paths and gives each node's children the tokens
             the row's grammar allows after it (`_frontier_allowed`), so the drafter proposes only those
    verify   the host walks the drafted tree with the row's matcher (`Grammar.tree_masks`) and the target's choice
             after every node is taken over that node's allowed tokens; nodes the grammar refuses never count
    advance  the emitted tokens are fed to the matchers before the cycle returns

Rows without a grammar take every token, so they decode as in any other cycle. The same masks give the first
token at admission and the token of a plain cycle (`eagle3.decoding.grammar.next_allowed`).
"""

from __future__ import annotations

import torch

from eagle3.decoding.grammar import frontier_allowed, next_allowed, tree_allowed


class GrammarSteps:
    """Mixed into `FastRows`: `grammars` [n] (None: unconstrained) mirrors the active rows."""

    def _frontier_allowed(self, nb: int, frontier: torch.Tensor | None, tokens: torch.Tensor | None,
                          parents: torch.Tensor | None) -> torch.Tensor:
        """`eagle3.decoding.expand.Constrain` for the drafting of the first nb rows, in draft ids: [nb, T, Vd]."""
        grammars = [*self.grammars[:nb], *[None] * (nb - len(self.grammars))]  # idle rows of a bucket: None
        allowed = frontier_allowed(grammars, frontier, tokens, parents, self.t.vocab_size, self.device)
        # the draft vocabulary's target ids, read now: a drafter swapped in place may map them anew
        ids = self.d.to_target_ids(torch.arange(self.d.lm_head.shape[0], device=self.device))  # [Vd]
        return allowed[..., ids]  # [nb, T, Vd]

    def _constrained_cycle(self, nb: int, spec: bool, mode: int) -> None:
        """One cycle of the first nb rows with the grammars' masks (module docstring), eagerly."""
        if not spec:
            self.allowed = next_allowed(self.grammars, nb, self.t.vocab_size, self.device)  # [nb, 1, V]
            try:
                self._plain_cycle(nb, mode)
            finally:
                self.allowed = None
            return
        if self.host_nodes:
            tokens, parents1, valid = self.tree_tokens[:nb], self.tree_parents1[:nb], self.tree_valid[:nb]
            self._nodes = self.host_nodes
        else:
            self.constrain = lambda f, t, p: self._frontier_allowed(nb, f, t, p)
            try:
                tokens, parents1 = self._draft(nb, mode)  # [nb, N], [nb, N+1]
            finally:
                self.constrain = None
            valid = torch.ones(tokens.shape, dtype=torch.bool, device=self.device)
        # [nb, N+1, V], [nb, N]
        self.allowed, ok = tree_allowed(self.grammars, tokens.tolist(), (parents1[:, 1:] - 1).tolist(),
                                        self.t.vocab_size, self.device)
        try:
            anc, top, aux = self._verify(nb, tokens, parents1, mode)
        finally:
            self.allowed = None
        # eagerly: a compiled acceptance would compile again for the `valid` argument
        keep, n_acc, emitted = self._accept(nb, tokens, parents1, anc, top, valid & ok)
        self._commit(nb, keep, n_acc, emitted, aux)

    def _follow(self) -> None:
        """Feed the tokens of the cycle just run to the active rows' grammars (a host read)."""
        pkt = self.packet[: self.n].tolist()
        for g, p in zip(self.grammars, pkt, strict=True):
            if g is not None:
                g.consume(p[2 : 3 + p[0]])
