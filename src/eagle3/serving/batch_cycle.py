"""The scheduler's generic batch (`BatchCycleMixin`, methods of `Scheduler`): batched prefill, and one decode
cycle over padded rows: draft, one batched verify forward, per-row acceptance, KV compaction, drafter catch-up."""

from __future__ import annotations

import time

import torch

from eagle3.config import SamplingConfig
from eagle3.decoding.sampling import race_sample
from eagle3.decoding.tree import ancestry, parents_with_root
from eagle3.serving.batch import accept_batch, batched_forward, prefill
from eagle3.serving.policy import RowAcceptance
from eagle3.serving.requests import RequestHandle, _Row

# Drafter input a row may have held back (plain cycles, resting) before it stops drafting for good: for an 8B
# target that is 1,024 x 3 x 4,096 bf16 values, 24 MB per row.
MAX_HELD_TOKENS = 1024


def _stop_for_good(r: _Row) -> None:
    """The row drafts no more: the drafter stops following it and nothing is held back for it."""
    r.drafting = r.tracked = False
    r.pending_aux, r.pending_tokens = [], []


class BatchCycleMixin:
    """`Scheduler` methods for the rows of the generic batch: their prefill and their decode cycles."""

    # -- prefill -----------------------------------------------------------------------------
    def _prefill(self, handles: list[RequestHandle]) -> None:
        prompts = [list(h.params.prompt_ids) for h in handles]
        t0 = time.perf_counter()
        kv, last, aux = prefill(self.target, prompts)  # last [b, V]
        first = last.argmax(dim=-1)  # [b]
        for i, h in enumerate(handles):
            p = h.params
            if p.temperature > 0:
                pos = torch.tensor([len(prompts[i])], device=last.device)  # the first token's position
                first[i] = race_sample(last[i : i + 1], pos, h.seed, p.temperature, p.top_p, p.top_k,
                                       fused=last.is_cuda)[0]
        first_ids = first.tolist()
        now = time.perf_counter()
        self.metrics.observe("eagle3_prefill_seconds", now - t0)
        use_draft = self.drafter is not None and self.policy.enabled
        survivors, rows = [], []
        for i, h in enumerate(handles):
            self.metrics.inc("eagle3_prompt_tokens_total", len(prompts[i]))
            h.first_token_at = now
            self.metrics.observe("eagle3_time_to_first_token_seconds", now - h.arrival)
            row = _Row(h, drafting=use_draft)
            h.drafter_version = self.drafter_version  # recorded traffic names the drafter it ran with
            if not self._emit(row, [first_ids[i]]):
                survivors.append(i)
                rows.append(row)
        if not survivors:
            return
        if len(survivors) < len(handles):
            kv.select(survivors)
        if self.drafter is not None:
            sub_aux = aux[torch.tensor(survivors, device=aux.device)] if aux is not None else None
            self.drafter.add([prompts[i] for i in survivors], sub_aux, [first_ids[i] for i in survivors])
        self._kv.merge(kv)
        self._rows.extend(rows)

    # -- one decode cycle ----------------------------------------------------------------------
    def _cycle(self) -> None:
        t0 = time.perf_counter()
        rows, dev = self._rows, self.target.device
        b = len(rows)
        tokens, parents, wanting = self._draft(rows)  # [B, N], -1 = padding (rows not drafting, shorter trees)
        n = tokens.shape[1]
        roots = torch.tensor([r.root for r in rows], dtype=torch.long, device=dev)  # [B]
        ids = torch.cat([roots[:, None], tokens.clamp(min=0)], dim=1)  # [B, N+1]
        parents1 = parents_with_root(parents)  # [B, N+1]
        anc = ancestry(parents1, n)  # [B, N+1, N+1]
        offsets = anc.sum(dim=-1) - 1  # [B, N+1] depth of each node
        lengths = list(self._kv.lengths)
        appended_at = self._kv.width
        logits, aux = batched_forward(self.target, ids, self._kv, anc, offsets)  # [B, N+1, V]
        top = self._choose(rows, logits, offsets, lengths)  # [B, N+1]
        paths, nxt = accept_batch(tokens, parents1, anc, top)
        keep = [[0, *p] for p in paths]  # root + accepted nodes, offsets into the appended block
        self._kv.compact(appended_at, keep)
        tok_host = tokens.tolist()
        depths = (offsets[:, 1:] * (tokens >= 0)).amax(dim=1).tolist() if n else [0] * b  # tree depth per row
        new_tokens = [[tok_host[i][j - 1] for j in paths[i]] + [nxt[i]] for i in range(b)]
        self._record(rows, n, tok_host, depths, paths)
        finished = [self._emit(r, new_tokens[i]) for i, r in enumerate(rows)]
        self._extend_drafter(rows, aux, keep, new_tokens, finished)  # rows that drafted
        self._defer_drafter(rows, aux, new_tokens, finished)  # rows the drafter follows that did not
        if any(finished):
            self._select([i for i, f in enumerate(finished) if not f])
        seconds = time.perf_counter() - t0
        self.metrics.observe("eagle3_cycle_seconds", seconds)
        emitted = sum(len(t) for t in new_tokens)
        if self.gate is not None and wanting:  # a choice the gate made: learn from it
            self.gate.record(b, n > 0, seconds, emitted, drafting=wanting)
        self._trace_cycle("batch", b, n > 0, self.gate if wanting else None, seconds, emitted)

    def _draft(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Padded draft trees for the batch, [B, N] tokens and parents (N = 0 when nobody drafts), and how many
        rows wanted to draft (what the gate chose for)."""
        b, dev = len(rows), self.target.device
        shape = self.policy.shape(b) if self.drafter is not None else None
        for r in rows:
            r.drafted = False
            if r.tracked and not r.drafting:
                r.rest -= 1
                if r.rest <= 0 and self.policy.retry_after > 0:  # rested long enough: try again, afresh
                    r.drafting, r.acc = True, RowAcceptance()
        if shape is None:
            for r in rows:  # no room for drafts at this batch size: rest (features are held back meanwhile)
                if r.drafting:
                    self._rest(r)
        drafting = [i for i, r in enumerate(rows) if r.drafting]
        wanting = len(drafting)
        if drafting and self.gate is not None and not self.gate.speculate(b, drafting=wanting):
            self.metrics.inc("eagle3_spec_paused_cycles_total")  # a plain cycle; the drafter catches up later
            drafting = []
        if drafting:
            self._flush_deferred(rows)
        if not drafting:
            empty = torch.full((b, 0), -1, dtype=torch.long, device=dev)
            return empty, empty.clone(), wanting
        for i in drafting:
            rows[i].drafted = True
        sampling = [SamplingConfig(temperature=h.params.temperature, top_p=h.params.top_p, top_k=h.params.top_k,
                                   seed=h.seed) for h in (rows[i].handle for i in drafting)]
        t, p = self.drafter.propose(drafting, shape, sampling)  # [R, N]
        tokens = torch.full((b, t.shape[1]), -1, dtype=torch.long, device=dev)  # [B, N]
        parents = tokens.clone()
        idx = torch.tensor(drafting, dtype=torch.long, device=dev)
        tokens[idx], parents[idx] = t.to(dev), p.to(dev)
        return tokens, parents, wanting

    def _record(self, rows: list[_Row], n: int, tokens: list[list[int]], depths: list[int],
                paths: list[list[int]]) -> None:
        """Cycle metrics, and each drafting row's running acceptance (which may switch its drafting off)."""
        m = self.metrics
        m.inc("eagle3_verify_steps_total")
        m.inc("eagle3_verified_tokens_total", len(rows) * (n + 1))
        m.observe("eagle3_batch_size", len(rows))
        m.set("eagle3_spec_draft_tokens", n)
        for r, toks, depth, path in zip(rows, tokens, depths, paths, strict=True):
            if not (r.drafting and depth > 0):
                continue
            m.inc("eagle3_draft_tokens_total", sum(1 for x in toks if x >= 0))
            m.inc("eagle3_accepted_tokens_total", len(path))
            m.inc("eagle3_spec_row_steps_total")
            m.record_row_cycle(depth, len(path))
            r.acc.update(len(path), self.policy.ema)
            if not self.policy.keep_drafting(r.acc):
                self._rest(r)

    def _rest(self, r: _Row) -> None:
        """Stop drafting for `policy.retry_after` cycles; for good when it is 0."""
        r.drafting, r.rest = False, self.policy.retry_after
        if self.policy.retry_after == 0:
            _stop_for_good(r)

    def _extend_drafter(self, rows: list[_Row], aux: torch.Tensor | None, keep: list[list[int]],
                        new_tokens: list[list[int]], finished: list[bool]) -> None:
        """Feed the kept features (root + accepted nodes) of each row that drafted this cycle to the drafter."""
        if self.drafter is None or not any(r.drafted for r in rows):
            return
        counts = [len(k) if (r.drafted and not f) else 0 for r, k, f in zip(rows, keep, finished, strict=True)]
        aux_rows = None
        if aux is not None and any(counts):
            width = max(counts)
            gidx = torch.zeros(len(rows), width, dtype=torch.long)  # [B, M] kept node offsets
            for i, k in enumerate(keep):
                gidx[i, : min(len(k), width)] = torch.tensor(k[:width])
            gidx = gidx.to(aux.device)[:, :, None].expand(-1, -1, aux.shape[-1])  # [B, M, 3Ht]
            aux_rows = aux.gather(1, gidx)  # [B, M, 3Ht]
        self.drafter.extend(aux_rows, new_tokens, counts)

    def _defer_drafter(self, rows: list[_Row], aux: torch.Tensor | None, new_tokens: list[list[int]],
                       finished: list[bool]) -> None:
        """Rows the drafter follows but which did not draft this cycle (a plain cycle, or resting): keep their
        root features and next tokens for the drafter, which takes them all in one batched extension when the
        row drafts again (one drafter forward, not one per cycle)."""
        held = [i for i, (r, f) in enumerate(zip(rows, finished, strict=True))
                if r.tracked and not r.drafted and not f]
        if not held:
            return
        # the roots only, copied once per cycle: a view into `aux` [B, N+1, 3·Ht] would keep the whole cycle's
        # features alive for as long as any row holds its root back
        roots = aux[:, 0].clone() if aux is not None else None  # [B, 3·Ht]
        for i in held:
            r = rows[i]
            if roots is not None:
                r.pending_aux.append(roots[i : i + 1])  # [1, 3·Ht]: the root, the only node of a plain cycle
            r.pending_tokens.extend(new_tokens[i])
            if len(r.pending_tokens) > MAX_HELD_TOKENS:  # bounded memory: held back this long, stop for good
                _stop_for_good(r)

    def _flush_deferred(self, rows: list[_Row]) -> None:
        """Feed the drafter what plain cycles held back for the rows drafting now, so its cache covers their
        text again. A resting row keeps what it holds until it drafts again: dropped here, its drafter would
        resume with a gap in its cache and propose from a stale text."""
        counts = [len(r.pending_tokens) if r.drafting else 0 for r in rows]
        if any(counts):
            ref = next((r.pending_aux[0] for r in rows if r.pending_aux), None)  # None: the drafter needs no aux
            aux_rows = None if ref is None else ref.new_zeros(len(rows), max(counts), ref.shape[-1])  # [B, M, 3·Ht]
            for i, (r, c) in enumerate(zip(rows, counts, strict=True)):
                if c and aux_rows is not None:
                    aux_rows[i, :c] = torch.cat(r.pending_aux)
            self.drafter.extend(aux_rows, [r.pending_tokens for r in rows], counts)
        for r in rows:
            if r.drafting:
                r.pending_aux, r.pending_tokens = [], []

    def _choose(self, rows: list[_Row], logits: torch.Tensor, offsets: torch.Tensor, lengths: list[int]):
        """The target's token after each node [B, N+1]: argmax, or a position-keyed sample per row."""
        top = logits.argmax(dim=-1)  # [B, N+1]
        for i, r in enumerate(rows):
            p = r.handle.params
            if p.temperature > 0:
                pos = lengths[i] + offsets[i] + 1  # [N+1] position of the token each node predicts
                top[i] = race_sample(logits[i], pos, r.handle.seed, p.temperature, p.top_p, p.top_k,
                                     fused=logits.is_cuda)
        return top
