"""The scheduler's fast paths (`FastPathsMixin`, methods of `Scheduler`): the fast lane, one greedy request alone
on a batch-1 `FastEngine`, and the fast rows, requests on the static-cache batch of `FastRows`. Both hold the
drafter the server started with; after a drafter swap the lane runs a drafter-less engine and the rows decode
plain (`Scheduler._serve_with`)."""

from __future__ import annotations

import time

from eagle3.config import SamplingConfig
from eagle3.serving.batch import prefill
from eagle3.serving.requests import GenParams, RequestHandle, _Row


def _row_sampling(h: RequestHandle) -> SamplingConfig | None:
    """A request's settings for a sampled fast row (None: greedy)."""
    p = h.params
    if p.temperature == 0:
        return None
    return SamplingConfig(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=h.seed)


class FastPathsMixin:
    """`Scheduler` methods for the fast lane and the fast rows (see the `eagle3.serving.scheduler` docstring)."""

    # -- the fast lane: one greedy request alone on the batch-1 fast path ------------------------
    def _lane_takes(self, admitted: list[RequestHandle]) -> bool:
        return (self.fast is not None and not self._rows and not self._frows and len(admitted) == 1
                and not self._waiting and admitted[0].params.temperature == 0)

    def _run_lane(self, h: RequestHandle) -> _Row | None:
        """Decode `h` on the fast engine until it finishes, is cancelled, or another request arrives; returns
        its row in the last case (to join the batch), else None."""
        p, m = h.params, self.metrics
        row = _Row(h, drafting=self.drafter is not None and self.policy.enabled)
        h.drafter_version = self.drafter_version  # recorded traffic names the drafter it ran with
        m.inc("eagle3_prompt_tokens_total", len(p.prompt_ids))
        engine = self.fast
        if self._lane_gate is not None and not self._lane_gate.speculate(1):
            engine = self._lane_plain
            m.inc("eagle3_spec_paused_cycles_total")
        spec = engine.mode != "none"
        last = [None]  # perf_counter of the previous callback: None until the first token
        first = [0.0]

        def on_tokens(new: list[int]) -> bool:
            now = time.perf_counter()
            if last[0] is None:
                h.first_token_at = first[0] = now
                m.observe("eagle3_time_to_first_token_seconds", now - h.arrival)
            else:  # one verification cycle of a batch of one
                m.observe("eagle3_cycle_seconds", now - last[0])
                m.inc("eagle3_verify_steps_total")
                m.observe("eagle3_batch_size", 1)
                if spec:
                    m.inc("eagle3_verified_tokens_total", engine.core.n_nodes + 1)
                    m.inc("eagle3_draft_tokens_total", engine.core.n_nodes)
                    m.inc("eagle3_accepted_tokens_total", len(new) - 1)
                    m.inc("eagle3_spec_row_steps_total")
                    m.record_row_cycle(engine.core.depth or engine.core.n_nodes, len(new) - 1)
                else:
                    m.inc("eagle3_verified_tokens_total")
                self._trace_cycle("lane", 1, spec, self._lane_gate, now - last[0], len(new))
            last[0] = now
            if self._emit(row, new):
                return True
            return h.cancelled or self._stopping or bool(self._waiting) or bool(self._swaps)

        m.set("eagle3_running_requests", 1)
        self._in_lane = True
        try:
            engine.generate(p.prompt_ids, max_new_tokens=p.max_tokens, on_tokens=on_tokens)
        finally:
            self._in_lane = False
        if self._lane_gate is not None and len(row.out) > 1 and last[0] > first[0]:
            self._lane_gate.record(1, spec, last[0] - first[0], len(row.out) - 1)  # decoding rate after the prefill
        if h.finished:
            return None
        if h.cancelled:
            h.finished = True
            m.inc("eagle3_requests_total", endpoint=p.endpoint, finish_reason="cancelled")
            return None
        return row

    def _join_batch(self, row: _Row) -> None:
        """Move a lane request into the batch: prefill its text so far (the root, its last token, stays out of
        the cache as for every row) and the drafter's history."""
        ctx = list(row.handle.params.prompt_ids) + row.out[:-1]
        if self._fits_fast_rows(row.handle.params, len(ctx)):
            self.fast_rows.add(ctx, root=row.root)
            self._frows.append(row)
            return
        kv, _, aux = prefill(self.target, [ctx])
        if self.drafter is not None:
            self.drafter.add([ctx], aux, [row.root])
        self._kv.merge(kv)
        self._rows.append(row)

    # -- fast rows: requests on the static-cache batch -----------------------------------------
    def _fits_fast_rows(self, p: GenParams, context: int) -> bool:
        fr = self.fast_rows
        return (fr is not None and (p.temperature == 0 or fr.sampling) and fr.n < fr.capacity
                and fr.fits(context, p.max_tokens - (context - len(p.prompt_ids))))

    def _add_fast_rows(self, admitted: list[RequestHandle]) -> list[RequestHandle]:
        """Prefill the admitted requests that fit the fast rows there (one padded forward) and emit their first
        tokens; returns the others."""
        fr, take, rest = self.fast_rows, [], []
        if fr is None:
            return admitted
        for h in admitted:
            p = h.params
            fits = fr.n + len(take) < fr.capacity and self._fits_fast_rows(p, len(p.prompt_ids))
            (take if fits else rest).append(h)
        if not take:
            return rest
        t0 = time.perf_counter()
        firsts = fr.add_many([list(h.params.prompt_ids) for h in take], sampling=[_row_sampling(h) for h in take])
        now = time.perf_counter()
        self.metrics.observe("eagle3_prefill_seconds", now - t0)
        base = len(self._frows)  # the new rows are base, base + 1, ... (as in FastRows)
        for h in take:
            self.metrics.inc("eagle3_prompt_tokens_total", len(h.params.prompt_ids))
            h.first_token_at = now
            self.metrics.observe("eagle3_time_to_first_token_seconds", now - h.arrival)
            h.drafter_version = self.drafter_version
            self._frows.append(_Row(h, drafting=False))
        for j in reversed(range(len(take))):  # from the end: a removal moves an already handled row
            if self._emit(self._frows[base + j], [firsts[j]]):
                self._remove_fast_row(base + j)
        return rest

    def _remove_fast_row(self, i: int) -> None:
        """Free fast row i; the last row moves into its place, here as in `FastRows.remove`."""
        self.fast_rows.remove(i)
        last = self._frows.pop()
        if i < len(self._frows):
            self._frows[i] = last

    def _fast_cycle(self) -> None:
        t0 = time.perf_counter()
        fr, m = self.fast_rows, self.metrics
        b = fr.n
        shape = fr.shape_of(b)
        spec = shape is not None and self.policy.enabled and self._rows_spec  # off after a drafter swap
        if spec and self._rows_gate is not None and not self._rows_gate.speculate(b):
            m.inc("eagle3_spec_paused_cycles_total")
            spec = False
        new_tokens = fr.cycle(spec)
        t_host = time.perf_counter()
        n = shape.total if spec else 0
        m.inc("eagle3_verify_steps_total")
        m.inc("eagle3_verified_tokens_total", b * (n + 1))
        m.observe("eagle3_batch_size", b)
        m.set("eagle3_spec_draft_tokens", n)
        if spec:
            m.inc("eagle3_draft_tokens_total", b * n)
            m.inc("eagle3_accepted_tokens_total", sum(len(t) - 1 for t in new_tokens))
            m.inc("eagle3_spec_row_steps_total", b)
            m.record_row_cycles(shape.depth, [len(t) - 1 for t in new_tokens])
        finished = [self._emit(r, t) for r, t in zip(self._frows, new_tokens, strict=True)]
        for i in reversed(range(len(finished))):
            if finished[i]:
                self._remove_fast_row(i)
        now = time.perf_counter()
        seconds = now - t0
        m.observe("eagle3_cycle_seconds", seconds)
        m.observe("eagle3_cycle_host_seconds", now - t_host)
        emitted = sum(len(t) for t in new_tokens)
        gated = self._rows_gate is not None and shape is not None and self.policy.enabled and self._rows_spec
        if gated:
            self._rows_gate.record(b, spec, seconds, emitted)
        self._trace_cycle("rows", b, spec, self._rows_gate if gated else None, seconds, emitted)
