"""The device steps of `eagle3.fast.rows.FastRows`: fixed-shape functions of its buffers for a bucket of nb rows,
which a cycle runs in order (and a CUDA graph captures): plain cycle, the drafter's catch-up feed, and the
speculative cycle's draft, verification, acceptance and commit."""

from __future__ import annotations

from typing import NamedTuple

import torch

from eagle3.decoding.expand import coupled_top_k, expand_tree, top_k_last
from eagle3.decoding.grammar import allowed_tokens, restrict
from eagle3.decoding.sampling import GREEDY, SamplingRows
from eagle3.decoding.tree import ancestry, parents_with_root, path_slots, scratch_path_slots
from eagle3.decoding.verify import accept_rows


class Front(NamedTuple):
    """A speculative cycle up to the target's choices (`RowSteps._spec_front`), per row of the bucket."""

    tokens: torch.Tensor  # [nb, N] draft tokens
    parents1: torch.Tensor  # [nb, N+1] parents, N+1 indexing
    valid: torch.Tensor | None  # [nb, N] nodes that count (host trees), None: all
    anc: torch.Tensor  # bool [nb, N+1, N+1] ancestry
    top: torch.Tensor  # [nb, N+1] the target's choice after the root and each node
    aux: torch.Tensor | None  # [nb, N+1, 3·Ht] the drafter's features
    logits: torch.Tensor  # [nb, N+1, V]
    pos: torch.Tensor  # [nb, N+1] the position of the token each node predicts


class RowSteps:
    """Mixed into `FastRows`, whose state (module docstring there) every step reads and writes."""

    def _choose(self, rows: SamplingRows, logits: torch.Tensor, positions: torch.Tensor, mode: int) -> torch.Tensor:
        """The token after each of logits [nb, M, V], predicting `positions` [nb, M]: argmax in greedy buckets,
        else each row's own choice (`SamplingRows.draw`), over the tokens `allowed` [nb, M, V] where a grammar
        constrains a row (`eagle3.fast.row_grammar`). [nb, M]."""
        if self.allowed is not None:
            logits = logits.masked_fill(~self.allowed, float("-inf"))
        if mode == GREEDY:  # [nb, M]: by `eagle3.fast.row_argmax` where the target attends by splits
            return self.t.argmax(logits.flatten(0, 1)).view(logits.shape[:2])
        return rows.draw(logits, positions, mode, self.fused_sampling)

    def _advance(self, nb: int, n_acc: torch.Tensor, new_root: torch.Tensor) -> None:
        self.root[:nb].copy_(new_root)
        last = self.seq_len - self.margin  # idle rows stay inside their caches; active rows never get here
        self.length[:nb].copy_((self.length[:nb] + n_acc + 1).clamp(max=last))

    def _plain_cycle(self, nb: int, mode: int) -> None:
        length, root = self.length[:nb], self.root[:nb]
        k, v, ar_s = self._caches(nb)
        pos = length[:, None]  # [nb, 1]
        if self.t.by_splits(1):  # by position: the prefix, then the root at its own slot
            mask, path = None, (length, pos[:, :, None])  # tail [nb, 1, 1]
        else:
            mask, path = (ar_s[None, :] <= length[:, None])[:, None, :], None  # [nb, 1, S]
        logits, aux = self.t.forward_rows(root[:, None], pos, pos, mask, k, v, self.rope,
                                          want_aux=self.d is not None, path=path)  # [nb, 1, V]
        # [nb]: the token at length + 1
        tok = self._choose(self.row_sampling, logits, pos + 1, mode)[:, 0]
        if self.feed_window:  # hold (features, next token) back for `_feed_held`
            rows = torch.arange(nb, device=self.device)
            j = self.held_n[:nb].clamp(max=self.feed_window - 1)  # idle rows may reach the end: they stay there
            self.held_aux[rows, j] = aux[:, 0]
            self.held_tok[rows, j] = tok
            self.held_n[:nb].copy_((self.held_n[:nb] + 1).clamp(max=self.feed_window))
        elif self.d is not None:
            dk, dv, ar_sd = self._d_caches(nb)
            dmask = (ar_sd[None, :] <= length[:, None])[:, None, :]  # [nb, 1, Sd]
            out = self.d.forward_rows(self.d.combine(aux), tok[:, None], pos, pos, dmask, dk, dv,
                                      self.d_rope)  # [nb, 1, H]
            self.last_out[:nb].copy_(out[:, 0])
        zero = torch.zeros_like(tok)
        self.packet[:nb, :3].copy_(torch.stack([zero, zero, tok], dim=1))
        self._advance(nb, zero, tok)

    def _feed_held(self, nb: int) -> None:
        """Feed the drafter every row's held tokens in one forward of [nb, W] rows (row j of a row that holds n
        tokens is position length - n + j, the pair the plain cycle would have fed there); last_out becomes the
        output at the newest held token. Rows j >= n are padding: they write drafter K/V at slots >= length,
        which nothing reads before it is overwritten."""
        n_held = self.held_n[:nb]  # [nb]
        dk, dv, ar_sd = self._d_caches(nb)
        start = (self.length[:nb] - n_held).clamp(min=0)  # [nb] position of the first held token
        pos = (start[:, None] + self.ar_w[None]).clamp(max=ar_sd.shape[0] - 1)  # [nb, W]
        mask = ar_sd[None, None, :] <= pos[:, :, None]  # [nb, W, Sd] causal over the row's drafter cache
        out = self.d.forward_rows(self.d.combine(self.held_aux[:nb]), self.held_tok[:nb], pos, pos, mask, dk, dv,
                                  self.d_rope)  # [nb, W, H]
        newest = out[torch.arange(nb, device=self.device), (n_held - 1).clamp(min=0)]  # [nb, H]
        self.last_out[:nb].copy_(torch.where((n_held > 0)[:, None], newest, self.last_out[:nb]))
        self.held_n[:nb].zero_()

    def _spec_cycle(self, nb: int, mode: int) -> None:
        self._spec_back(nb, self._spec_front(nb, mode))

    def _spec_front(self, nb: int, mode: int, levels: torch.Tensor | None = None) -> Front:
        """Draft (or take the trees `load_tree` wrote) and verify: the cycle up to the target's choices. `levels`
        [nb, D, W] int32: the bitmasks of the tokens allowed at each expansion step (`_draft`)."""
        if self.host_nodes:
            tokens, parents1, valid = self.tree_tokens[:nb], self.tree_parents1[:nb], self.tree_valid[:nb]
            self._nodes = self.host_nodes
        elif self.constrain is not None:  # drafts under the frontier's masks: the host reads every step
            tokens, parents1, valid = *self._draft(nb, mode), None
        else:
            tokens, parents1 = self.pieces.run("_draft", nb, mode, levels)  # [nb, N], [nb, N+1]
            valid = None
        return Front(tokens, parents1, valid, *self._verify(nb, tokens, parents1, mode))

    def _spec_back(self, nb: int, f: Front) -> None:
        """Accept by the choices in `f.top`, commit, feed the drafter."""
        keep, n_acc, emitted = self.pieces.run("_accept", nb, f.tokens, f.parents1, f.anc, f.top, f.valid)
        self._commit(nb, keep, n_acc, emitted, f.aux)

    def _draft(self, nb: int, mode: int = GREEDY,
               levels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The EAGLE-2 tree of every row (`eagle3.decoding.expand`): tokens [nb, N] and parents [nb, N+1] (N+1
        indexing; the root is its own parent). Row r drafts its token at length[r] + 1 + step; a chain stops
        drafting once every row's joint draft probability is below `chain_stop`. `levels` [nb, D, W] int32: the
        bitmasks of the tokens allowed to every frontier node at each step, as the host gave them before drafting
        (`eagle3.decoding.grammar.forced_path_masks`; None: all, or as `constrain` says). Sampled rows draft
        coupled to their own draws (`coupled_top_k`; the first child is the drafter's token under the row's noise)."""
        shape = self.shape_of(nb)
        d, k = self.d, shape.top_k
        length = self.length[:nb]
        dk, dv, ar_sd = self._d_caches(nb)

        def children(out: torch.Tensor, step: int, allowed: torch.Tensor | None = None):  # out [nb, T, H]
            return self.choose_drafts(out, length + 1 + step, mode, k, allowed)

        def run(step: int, hidden: torch.Tensor, tokens: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
            cols = length[:, None] + ar_sd[None, : step * k]  # [nb, step·k] scratch slots so far
            pos = (length - 1 + step)[:, None].expand(nb, k).contiguous()  # [nb, k]
            if d.paths_op is not None:  # by position: the committed rows, then each row's path in scratch
                paths, mask = (length, scratch_path_slots(anc, length, k)), None  # tail [nb, k, step]
            else:  # [nb, k, Sd]: the committed rows and each row's ancestors in scratch
                paths, mask = None, (ar_sd[None, None, :] < length[:, None, None]).expand(nb, k, -1).clone()
                mask.scatter_(2, cols[:, None, :].expand(nb, k, -1), anc)
            return d.forward_rows(hidden, tokens, pos, cols[:, -k:], mask, dk, dv, self.d_rope, paths=paths)

        until = None
        if self.chain_stop is not None and shape.is_chain:  # every row unsure: stop
            stop = self.chain_stop
            until = lambda scores: float(scores.exp().max()) < stop  # noqa: E731
        constrain = self.constrain
        if levels is not None:  # each step's frontier under its level's mask, unpacked one level at a time

            def constrain(step: int, frontier, _tokens, _parents) -> torch.Tensor:  # [nb, T, V]
                allowed = allowed_tokens(levels[:, step], self.t.vocab_size)[:, None]  # [nb, 1, V]
                return allowed.expand(nb, 1 if frontier is None else k, -1)

        tokens, parents = expand_tree(self.last_out[:nb], shape, children, run, d.feedback, d.to_target_ids,
                                      self.ranked, until, constrain)
        self._nodes = tokens.shape[1]
        return tokens, parents_with_root(parents)  # [nb, N], [nb, N+1]

    def _draft_ids(self) -> torch.Tensor:
        """The draft vocabulary's target ids [Vd], read each time: a drafter swapped in place may map them anew."""
        return self.d.to_target_ids(torch.arange(self.d.lm_head.shape[0], device=self.device))

    def choose_drafts(self, out: torch.Tensor, positions: torch.Tensor, mode: int, k: int,
                      allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The k drafts after each of the drafter's outputs out [nb, T, H], candidates for row r's token at
        positions[r]: draft log-probabilities [nb, T, k] (what a tree ranks its paths by) and draft-vocabulary ids
        [nb, T, k]. Greedy rows (or `coupled` off): the drafter's top k; sampled rows: `coupled_top_k`, the first
        coupled to the row's own draw. A draft is accepted where it equals the target's choice either way.
        `allowed` [nb, T, V]: the tokens a grammar allows there (the drafter's distribution restricted to those
        of its vocabulary; an output with none of them allowed keeps all, and its drafts are never accepted)."""
        d = self.d
        if allowed is None:
            if mode == GREEDY or not self.coupled:
                return d.top_k(out, k, self._top_k_ops.get(k), self.ranked)
            return coupled_top_k(d.logits(out), positions, self.row_sampling, mode, d.draft_h, k, self.ranked)
        logits = restrict(d.logits(out), allowed[..., self._draft_ids()])  # [nb, T, Vd]
        if mode == GREEDY or not self.coupled:
            return top_k_last(torch.log_softmax(logits, dim=-1), k, self.ranked)
        return coupled_top_k(logits, positions, self.row_sampling, mode, d.draft_h, k, self.ranked)

    def _tree_inputs(self, nb: int, tokens: torch.Tensor, parents1: torch.Tensor, by_paths: bool):
        """What the verification forward reads per row: ancestry [nb, N+1, N+1], ids, RoPE positions and cache
        slots [nb, N+1], and how the target sees each row's cache: with `by_paths`, each node's path by depth,
        tail [nb, N+1, D+1] (`eagle3.decoding.tree.path_slots`), else the mask [nb, N+1, S]; the other is
        None."""
        shape = self.shape_of(nb)
        n1 = tokens.shape[1] + 1
        length = self.length[:nb]
        anc = ancestry(parents1, shape.depth)  # [nb, N+1, N+1]
        ids = torch.cat([self.root[:nb, None], tokens], dim=1)  # [nb, N+1]
        pos = length[:, None] + anc.sum(dim=-1) - 1  # [nb, N+1]
        slots = length[:, None] + self.ar[:n1][None]  # [nb, N+1]
        if by_paths:
            return anc, ids, pos, slots, None, path_slots(anc, length, shape.depth)
        mask = (self.ar_s[None, : self.span] < length[:, None])[:, None, :].repeat(1, n1, 1)  # [nb, N+1, S]
        mask.scatter_(2, slots[:, None, :].expand(nb, n1, n1), anc)
        return anc, ids, pos, slots, mask, None

    def _verify(self, nb: int, tokens: torch.Tensor, parents1: torch.Tensor, mode: int):
        """Target forward over [root, nodes] per row: ancestry [nb, N+1, N+1], the target's choice after each node
        [nb, N+1] (argmax, or the row's position-keyed draw), aux, the logits [nb, N+1, V] and the position each
        node predicts [nb, N+1]."""
        by_paths = self.t.by_splits(tokens.shape[1] + 1)
        anc, ids, pos, slots, mask, tail = self.pieces.run("_tree_inputs", nb, tokens, parents1, by_paths)
        k, v, _ = self._caches(nb)
        logits, aux = self.t.forward_rows(ids, pos, slots, mask, k, v, self.rope, want_aux=self.d is not None,
                                          path=(self.length[:nb], tail) if by_paths else None)
        # logits [nb, N+1, V], aux [nb, N+1, 3·Ht]
        # node j predicts the token at pos[j] + 1
        top = self._choose(self.row_sampling, logits, pos + 1, mode)  # [nb, N+1]
        return anc, top, aux, logits, pos + 1

    def _accept(self, nb: int, tokens, parents1, anc, top, valid=None):
        """Acceptance per row (`eagle3.decoding.verify.accept_rows`; `valid` [nb, N]: the nodes of host trees
        that count): keep [nb, D+1], n_acc [nb], emitted [nb, D+1]."""
        acc = accept_rows(tokens, parents1, anc, top, self.packet.shape[1] - 3, valid, root=self.root[:nb])
        self.packet[:nb].copy_(torch.cat([acc.n_acc[:, None], acc.drafted[:, None], acc.emitted], dim=1))
        return acc.keep, acc.n_acc, acc.emitted

    def _commit(self, nb: int, keep, n_acc, emitted, aux) -> None:
        """Accepted K/V next to each row's prefix, then `_feed_rows`."""
        rows = torch.arange(nb, device=self.device)[:, None]  # [nb, 1]
        length = self.length[:nb]
        dst = length[:, None] + self.ar[: keep.shape[1]][None]  # [nb, D+1]
        src = length[:, None] + keep  # src >= dst elementwise: gather first, then write
        base = self.head_base[:nb, :, None]  # [nb, nkv, 1]
        kv = self.kv.view(2 * self.t.num_layers, -1, self.t.hd)  # [2·L, B·nkv·S, hd]
        kv[:, (base + dst[:, None]).flatten()] = kv[:, (base + src[:, None]).flatten()]  # [2·L, nb·nkv·(D+1), hd]
        if self.d is None:
            self._advance(nb, n_acc, emitted.gather(1, n_acc[:, None])[:, 0])
        else:
            self.pieces.run("_feed_rows", nb, keep, n_acc, emitted, aux, rows, dst)

    def _feed_rows(self, nb: int, keep, n_acc, emitted, aux, rows: torch.Tensor, dst: torch.Tensor) -> None:
        """The drafter fed with each row's accepted path (`rows` [nb, 1], its cache slots `dst` [nb, D+1]), state
        advanced."""
        hidden = self.d.combine(aux[rows, keep])  # [nb, D+1, H]
        dk, dv, ar_sd = self._d_caches(nb)
        dmask = ar_sd[None, None, :] <= dst[:, :, None]  # [nb, D+1, Sd]
        out = self.d.forward_rows(hidden, emitted, dst, dst, dmask, dk, dv, self.d_rope)  # [nb, D+1, H]
        # (rows past n_acc are padding)
        self.last_out[:nb].copy_(out[rows[:, 0], n_acc])
        self._advance(nb, n_acc, emitted.gather(1, n_acc[:, None])[:, 0])
