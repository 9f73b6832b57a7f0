"""How the scheduler decodes (`PathsMixin`, methods of `Scheduler`): requests decode together as rows of a rows
backend, `FastRows` (static caches, captured cycles) or `HFRows` (any HF model), a request alone as one row. Every
backend runs through the same admission, cycle, metrics and speed gate here; where a drafter swap brings weights of
other shapes than the fast rows were built for, they decode plain from then on (`Scheduler._serve_with`)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eagle3.config import ConfigError, SamplingConfig
from eagle3.decoding.grammar import Grammar, GrammarCompiler
from eagle3.serving.policy import SpeedGate
from eagle3.serving.requests import GenParams, RequestHandle, _Row

if TYPE_CHECKING:
    from eagle3.decoding.hf_rows import HFRows
    from eagle3.fast.rows import FastRows


@dataclass
class _Batch:
    """A rows backend and the requests in its rows (`rows[i]` decodes in backend row i), its speed gate, and
    whether it may speculate (False once a drafter swap left its drafter behind). `name` labels its cycles."""

    name: str
    backend: FastRows | HFRows
    gate: SpeedGate | None
    rows: list[_Row] = field(default_factory=list)
    spec: bool = True


def _row_sampling(h: RequestHandle) -> SamplingConfig | None:
    """A request's settings for a sampled row (None: greedy)."""
    p = h.params
    if p.temperature == 0:
        return None
    return SamplingConfig(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=h.seed)


class PathsMixin:
    """`Scheduler` methods for the rows (see the `eagle3.serving.scheduler` docstring)."""

    # -- the rows ------------------------------------------------------------------------------
    def _batch_for(self, p: GenParams, context: int, taken: dict[str, int]) -> _Batch:
        """The first backend that takes a request with this context (`taken[name]` rows already promised to
        each); the last one (the HF rows) takes any."""
        for b in self._batches[:-1]:
            be = b.backend
            if ((p.temperature == 0 or be.sampling) and be.n + taken[b.name] < be.capacity
                    and be.fits(context, p.max_tokens - (context - len(p.prompt_ids)))):
                return b
        return self._batches[-1]

    def _admit(self, admitted: list[RequestHandle]) -> None:
        """Prefill the admitted requests on their backends (one padded forward each) and emit their first tokens."""
        taken: dict[str, int] = defaultdict(int)
        groups: dict[str, list[RequestHandle]] = defaultdict(list)
        for h in admitted:
            b = self._batch_for(h.params, len(h.params.prompt_ids), taken)
            taken[b.name] += 1
            groups[b.name].append(h)
        for b in self._batches:
            if groups[b.name]:
                self._add_rows(b, groups[b.name])

    def _add_rows(self, batch: _Batch, take: list[RequestHandle]) -> None:
        t0 = time.perf_counter()
        grammars: dict[str, Grammar | None] = {}
        for h in list(take):
            try:
                grammars[h.id] = self._grammar(h)
            except ConfigError as e:  # a schema the engine refuses for this tokenizer: this request only
                self._send_error(h, f"response_format cannot be followed: {e}", status=400)
                take.remove(h)
        if not take:
            return
        firsts = batch.backend.add_many([list(h.params.prompt_ids) for h in take],
                                        sampling=[_row_sampling(h) for h in take],
                                        grammars=[grammars[h.id] for h in take])
        now = time.perf_counter()
        self.metrics.observe("eagle3_prefill_seconds", now - t0)
        base = len(batch.rows)  # the new rows are base, base + 1, ... (as in the backend)
        for h in take:
            self.metrics.inc("eagle3_prompt_tokens_total", len(h.params.prompt_ids))
            self.metrics.observe("eagle3_time_to_first_token_seconds", now - h.arrival)
            h.drafter_version = self.drafter_version  # recorded traffic names the drafter it ran with
            batch.rows.append(_Row(h))
        for j in reversed(range(len(take))):  # from the end: a removal moves an already handled row
            if self._emit(batch.rows[base + j], [firsts[j]]):
                self._remove_row(batch, base + j)

    def _grammar(self, h: RequestHandle) -> Grammar | None:
        """A constrained request's fresh matcher: its response_format, or its forced tool call (the grammar
        engine's view of the vocabulary is built once)."""
        if h.params.grammar is None:
            return None
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.target.vocab_size, sorted(self.eos))
        return self._grammars.compile_text(h.params.grammar)

    def _remove_row(self, batch: _Batch, i: int) -> None:
        """Free row i; the last row moves into its place, here as in the backend."""
        batch.backend.remove(i)
        last = batch.rows.pop()
        if i < len(batch.rows):
            batch.rows[i] = last

    def _cycle(self, batch: _Batch) -> None:
        """One cycle of a backend's rows: the policy's shape for this many rows and the gate choose the mode."""
        t0 = time.perf_counter()
        be, m = batch.backend, self.metrics
        b = be.n
        shape = be.shape_of(b) if batch.spec and self.policy.enabled else None
        wanting = be.drafting if shape is not None else 0  # rows that draft if the cycle speculates
        spec, sampled = wanting > 0, be.sampled
        if spec and batch.gate is not None and not batch.gate.speculate(b, drafting=wanting, sampled=sampled):
            m.inc("eagle3_spec_paused_cycles_total")  # a plain cycle; the drafter catches up later
            spec = False
        new_tokens = be.cycle(spec)
        t_host = time.perf_counter()
        self._record(batch, new_tokens)
        finished = [self._emit(r, t) for r, t in zip(batch.rows, new_tokens, strict=True)]
        for i in reversed(range(len(finished))):
            if finished[i]:
                self._remove_row(batch, i)
        now = time.perf_counter()
        seconds = now - t0
        m.observe("eagle3_cycle_seconds", seconds)
        m.observe("eagle3_cycle_host_seconds", now - t_host)
        emitted = sum(len(t) for t in new_tokens)
        gated = batch.gate is not None and wanting > 0
        if gated:  # a choice the gate made: learn from it
            batch.gate.record(b, spec, seconds, emitted, drafting=wanting, sampled=sampled)
        self._trace_cycle(batch.name, b, spec, batch.gate if gated else None, seconds, emitted)

    def _record(self, batch: _Batch, new_tokens: list[list[int]]) -> None:
        """Cycle metrics, and each drafting row's cycles and accepted drafts."""
        m, be = self.metrics, batch.backend
        m.inc("eagle3_verify_steps_total")
        m.inc("eagle3_verified_tokens_total", be.n * (max(be.drafted, default=0) + 1))
        m.observe("eagle3_batch_size", be.n)
        m.set("eagle3_spec_draft_tokens", max(be.drafted, default=0))
        by_depth: dict[int, list[int]] = defaultdict(list)
        for r, toks, depth in zip(batch.rows, new_tokens, be.depths, strict=True):
            if depth > 0:
                by_depth[depth].append(len(toks) - 1)
                r.cycles += 1
                r.accepted += len(toks) - 1
        if by_depth:
            m.inc("eagle3_draft_tokens_total", sum(be.drafted))
        for depth, accepted in by_depth.items():
            m.inc("eagle3_accepted_tokens_total", sum(accepted))
            m.inc("eagle3_spec_row_steps_total", len(accepted))
            m.record_row_cycles(depth, accepted)
