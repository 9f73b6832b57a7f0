"""Cycles of `eagle3.fast.rows.FastRows` where a row follows a grammar (`eagle3.decoding.grammar`).

The host computes a constrained row's masks between the device's steps, so such a cycle runs in pieces, each a
fixed-shape step that a CUDA graph captures like any other cycle:

    plain    the host writes each row's mask for its next token (`mask_words`), then the plain cycle chooses under it
    front    draft and verify: the target's logits for every node of every row's tree
    walk     one step of `eagle3.decoding.grammar.walk_tree` per emitted token that needs its mask (the front's own
             choice is kept where the grammar allows it and the draw is greedy or temperature-only): the host writes
             each walking row's node and mask, the step takes the target's choice there under the mask into the
             front's choices
    back     acceptance by those choices, commit, the drafter's feed: the rest of an ordinary speculative cycle

Rows without a grammar take every token, so they decode as in any other cycle. Where cycles run eagerly (a CPU)
the drafter proposes only tokens the grammar allows: the host gives each frontier node's children their mask at
every expansion step (`_frontier_allowed`), and a node whose mask allows one token gets it as its child, certain
(`eagle3.decoding.expand.force_single`), also where the draft vocabulary lacks it. Captured drafting cannot wait
for the host, so there the host writes before the front the masks it knows: the next token's, and the masks along
the tokens the grammar forces from there (`forced_path_masks`); drafts past that are the drafter's own, and a draft
the grammar refuses is never accepted. The pieces are captured the first time a constrained
cycle of that bucket and mode runs; the rows' state is put back after each warm-up cycle.
"""

from __future__ import annotations

import torch

from eagle3.decoding.grammar import allowed_tokens, forced_path_masks, frontier_allowed, next_masks, walk_tree
from eagle3.decoding.sampling import FILTERED
from eagle3.fast.graphs import StepRunner

GRAMMAR_PIECES = ("plain", "front", "walk", "back")


class GrammarSteps:
    """Mixed into `FastRows`: `grammars` [n] (None: unconstrained) mirrors the active rows; `mask_words` [B, W]
    (int32 bitmasks), `walk_in` [2, B] (each row's node, whether it walks) and `walk_out` [B] (the choice) are the
    pieces' inputs and output; `_fronts` holds each (bucket, mode)'s front outputs for its walk and back."""

    def _frontier_allowed(self, nb: int, frontier: torch.Tensor | None, tokens: torch.Tensor | None,
                          parents: torch.Tensor | None) -> torch.Tensor:
        """`eagle3.decoding.expand.Constrain` for the drafting of the first nb rows: [nb, T, V]."""
        return frontier_allowed(self._bucket_grammars(nb), frontier, tokens, parents, self.t.vocab_size, self.device)

    def _bucket_grammars(self, nb: int) -> list:
        return [*self.grammars[:nb], *[None] * (nb - len(self.grammars))]  # idle rows of a bucket: None

    def _constrained_cycle(self, nb: int, spec: bool, mode: int) -> None:
        """One cycle of the first nb rows under the grammars' masks (module docstring)."""
        grammars = self._bucket_grammars(nb)
        if not spec:
            plain = self._grammar_piece("plain", nb, mode)
            self.mask_words[:nb].copy_(next_masks(grammars, nb, self.mask_words.shape[1]))
            plain()
            return
        front = self._grammar_piece("front", nb, mode)
        first = None  # the next-token masks, where computed before the front (the walk's first step takes them)
        if self.d is not None and not self.graphs:  # eager drafting under the frontier's masks
            self.constrain = lambda _s, f, t, p: self._frontier_allowed(nb, f, t, p)
        elif self.d is not None:  # captured drafting: under the masks the host knows before it starts
            levels = forced_path_masks(grammars, nb, self.draft_words.shape[1], self.draft_words.shape[2])
            self.draft_words[:nb].copy_(levels)
            first = levels[:, 0]
        try:
            front()
        finally:
            self.constrain = None
        # captured after the front has run: a capture records without running, so the front's outputs, which
        # their warm-up cycles read, hold this cycle's values only from its first replay on
        new = ("back", nb, mode) not in self._runners
        walk, back = (self._grammar_piece(k, nb, mode) for k in ("walk", "back"))
        if new and self.graphs:  # the back's warm-up cycles moved the tree's K/V in the cache: verify again
            front()
        f = self._fronts[(nb, mode)]
        tokens = f.tokens if f.valid is None else f.tokens.masked_fill(~f.valid, -1)  # [nb, N]
        # one read: tokens, parents and the target's unmasked choices, which the walk takes where the grammar allows
        # them (not under top-p / top-k, which the mask changes)
        host = torch.cat([tokens, f.parents1[:, 1:] - 1, f.top], dim=1).tolist()  # [nb, 3N+1]
        n = tokens.shape[1]

        def choose(nodes: list[int], masks: torch.Tensor, walking: list[bool]) -> list[int]:
            self.mask_words[:nb].copy_(masks)
            self.walk_in[:, :nb].copy_(torch.tensor([nodes, walking], dtype=torch.long))
            walk()
            return self.walk_out[:nb].tolist()

        top = [h[2 * n:] for h in host] if mode != FILTERED else None
        walk_tree(grammars, [h[:n] for h in host], [h[n : 2 * n] for h in host], choose, first, top)
        back()

    def _grammar_piece(self, kind: str, nb: int, mode: int) -> StepRunner:
        """The runner of one piece (`GRAMMAR_PIECES`) for a bucket and mode, captured on first use."""
        key = (kind, nb, mode)
        runner = self._runners.get(key)
        if runner is None:
            fn = {"plain": lambda: self._masked_plain(nb, mode),
                  "front": lambda: self._fronts.__setitem__((nb, mode), self._masked_front(nb, mode)),
                  "walk": lambda: self._walk_step(nb, mode),
                  "back": lambda: self._spec_back(nb, self._fronts[(nb, mode)])}[kind]
            if kind == "walk":  # its warm-up cycles must not write the front's choices
                self.walk_in[1].zero_()
            runner = StepRunner(fn, self.device, graphs=self.graphs, pool=self._pool,
                                name=f"rows_grammar_{kind}_b{nb}_m{mode}", reset=self._state_keeper())
            runner.prepare()
            self._runners[key] = runner
        return runner

    def _state_keeper(self):
        """A capture's warm-up cycles run for real on the active rows: what puts their step state back after each
        (None without active rows). Every step writes the caches only at or past a row's length, so the committed
        rows survive without a copy."""
        if not (self.graphs and self.n):
            return None
        state = [self.root, self.length]
        if self.d is not None:
            state.append(self.last_out)
        if self.feed_window:
            state.append(self.held_n)
        saved = [t.clone() for t in state]

        def restore() -> None:
            for t, s in zip(state, saved, strict=True):
                t.copy_(s)

        return restore

    def _masked_plain(self, nb: int, mode: int) -> None:
        """A plain cycle choosing each row's token under its mask in `mask_words`."""
        self.allowed = allowed_tokens(self.mask_words[:nb], self.t.vocab_size)[:, None]  # [nb, 1, V]
        try:
            self._plain_cycle(nb, mode)
        finally:
            self.allowed = None

    def _masked_front(self, nb: int, mode: int):
        """`_spec_front`; where drafting is captured, each expansion step drafts among the tokens of its level of
        `draft_words`: the next token's mask, then the masks along the tokens the grammar forces from there (the
        masks after tokens the drafter chooses depend on the drafts: the host cannot give them in time)."""
        if self.d is None or self.constrain is not None:
            return self._spec_front(nb, mode)
        return self._spec_front(nb, mode, self.draft_words[:nb])

    def _walk_step(self, nb: int, mode: int) -> None:
        """The target's choice after node walk_in[0, r] of each row r under its mask, into `walk_out` and, for the
        rows that walk (walk_in[1]), into the front's choices."""
        f = self._fronts[(nb, mode)]
        rows = torch.arange(nb, device=self.device)
        node, walking = self.walk_in[0, :nb], self.walk_in[1, :nb].bool()  # [nb]
        self.allowed = allowed_tokens(self.mask_words[:nb], self.t.vocab_size)[:, None]  # [nb, 1, V]
        try:
            choice = self._choose(self.row_sampling, f.logits[rows, node][:, None], f.pos[rows, node][:, None],
                                  mode)[:, 0]  # [nb]
        finally:
            self.allowed = None
        f.top[rows, node] = torch.where(walking, choice, f.top[rows, node])
        self.walk_out[:nb].copy_(choice)

    def _follow(self) -> None:
        """Feed the token of the plain cycle just run to the active rows' grammars (a host read)."""
        pkt = self.packet[: self.n].tolist()
        for g, p in zip(self.grammars, pkt, strict=True):
            if g is not None:
                g.consume(p[2 : 3 + p[0]])
