"""Continuous batching with speculative decoding: one background thread owns the model and runs cycles.

Each loop iteration:

1. admit waiting requests (up to `max_batch_size` rows and `max_prefill_tokens` padded prompt tokens),
   prefill them in one batched forward, emit their first token, and append them to the batch;
2. drop rows whose client went away;
3. run one cycle over all rows: the policy picks a draft shape for this batch size, the drafter proposes
   a tree for each drafting row, ONE batched target forward verifies every row's [root, tree] (padded to
   N+1 tokens), each row accepts its own path (greedy, or position-keyed sampling, see
   `eagle3.decoding.sampling`), the batch KV cache keeps each row's prefix + root + accepted nodes, the
   drafter is extended with the accepted features, and tokens are emitted to the clients;
4. finished rows (EOS, stop string, max_tokens) leave the batch.

The fast lane (when the server has a `FastEngine`): a greedy request that arrives at an idle server decodes
alone on the batch-1 static-cache path (CUDA graphs on a GPU), which is many times faster than a batch of one
on the generic path. When another request arrives it stops after its current cycle, is prefilled into the batch
with the text it has so far, and continues there; outputs are the same either way (greedy, lossless).

The fast rows (when the server has `FastRows`, on a GPU): requests that fit its caches, greedy or sampled, decode
as rows of a static-cache batch instead (`eagle3.fast.rows`): one graph-captured cycle per batch-size bucket,
speculative with the policy's shape for that bucket where the speed gate measures it faster, plain otherwise.
Sampled rows draw the same position-keyed tokens there as here. Requests that do not fit use the generic batch;
both batches advance once per loop iteration.

Results reach the HTTP side through each request's `sink` (called from this thread). Greedy output equals
`SpeculativeEngine` with `NoDraftProposer` token for token, whatever else shares the batch (padded batched
kernels differ from bs=1 ones only by float rounding, which could flip an exact argmax tie).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from eagle3.attention import varying_shape_attention
from eagle3.config import ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.sampling import new_seed, race_sample
from eagle3.serving.batch import BatchKV, accept_greedy_batch, batch_ancestors, batched_forward, prefill
from eagle3.serving.config import ServeConfig
from eagle3.serving.drafting import BatchDrafter
from eagle3.serving.metrics import Metrics
from eagle3.serving.policy import RowAcceptance, SpecPolicy, SpeedGate
from eagle3.target import Target

if TYPE_CHECKING:
    from eagle3.fast.engine import FastEngine
    from eagle3.fast.rows import FastRows

__all__ = ["Event", "GenParams", "RequestHandle", "Scheduler", "SchedulerUnavailable"]

log = logging.getLogger("eagle3.serving")


@dataclass
class GenParams:
    """One validated request, in token ids."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stream: bool = False
    endpoint: str = "completions"  # a metrics label


@dataclass
class Event:
    """What the scheduler tells a request: a text `delta`, `done` (with usage), or an `error`."""

    kind: str
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    status: int = 500  # for errors: the HTTP status to answer with


class RequestHandle:
    """A submitted request: its parameters, where its events go, and a cancel flag the client side sets."""

    def __init__(self, params: GenParams, sink: Callable[[Event], None]):
        self.params = params
        self.sink = sink
        self.id = uuid.uuid4().hex
        self.seed = params.seed if params.seed is not None else new_seed()
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.cancelled = False
        self.finished = False


def _row_sampling(h: RequestHandle) -> SamplingConfig | None:
    """A request's settings for a sampled fast row (None: greedy)."""
    p = h.params
    if p.temperature == 0:
        return None
    return SamplingConfig(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=h.seed)


def _stock_decode(tokenizer) -> bool:
    """True when `tokenizer.decode` is transformers' own fast-tokenizer decode (no subclass override)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    cls = type(tokenizer)
    return all(getattr(cls, name, None) is getattr(PreTrainedTokenizerFast, name, None) for name in ("decode", "_decode"))


class SchedulerUnavailable(Exception):
    """The scheduler refuses new work: `status` is the HTTP status to answer with (503)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


# Drafter input a row may have held back (plain cycles, resting) before it stops drafting for good: for an 8B
# target that is 1,024 x 3 x 4,096 bf16 values, 24 MB per row.
MAX_HELD_TOKENS = 1024
TRACE_CYCLES = 16384  # decode cycles kept for `cycle_trace` (a benchmark level runs a few hundred)


class _Row:
    def __init__(self, handle: RequestHandle, drafting: bool):
        self.handle = handle
        self.out: list[int] = []
        self.root = -1  # last emitted token, not yet in the KV cache
        self.drafting = drafting  # drafts when the cycle speculates
        self.tracked = drafting  # the drafter's cache follows this row (drafting or resting)
        self.drafted = False  # drafted in the current cycle
        self.rest = 0  # cycles left before a row that stopped drafting tries again
        self.acc = RowAcceptance()
        self.sent = 0  # characters already streamed
        self.streamed = 0  # tokens of `out` covered by the last streamed chunk
        # incremental detokenization (`Scheduler._stable_text`): the text of out[:read_at], decoded in windows
        self.text = ""
        self.prefix_at = self.read_at = 0
        # drafter input held back during plain cycles (fed in one batched extension when drafting resumes)
        self.pending_aux: list[torch.Tensor] = []  # [1, 3·Ht] each
        self.pending_tokens: list[int] = []


def _stop_for_good(r: _Row) -> None:
    """The row drafts no more: the drafter stops following it and nothing is held back for it."""
    r.drafting = r.tracked = False
    r.pending_aux, r.pending_tokens = [], []


def _find_stop(text: str, stops: Sequence[str]) -> int:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else -1


class Scheduler:
    """Owns the target, the drafter and the batch; `start()` runs the loop in a daemon thread."""

    def __init__(
        self,
        target: Target,
        tokenizer,
        eos_token_ids: Sequence[int],
        drafter: BatchDrafter | None = None,
        policy: SpecPolicy | None = None,
        config: ServeConfig | None = None,
        metrics: Metrics | None = None,
        fast: FastEngine | None = None,
        rows: FastRows | None = None,
    ):
        """`fast`: a batch-1 `FastEngine` on the same model (with this server's drafter and largest shape) for
        the fast lane: a greedy request that finds the server idle runs on it alone, and moves into the batch
        (re-prefilled) as soon as another request arrives. With the speed gate on, lane requests alternate
        between it and a drafter-less engine on the same weights until one is measured faster.
        `rows`: `FastRows` on the same model (see the module docstring)."""
        if getattr(target, "recurrent_layers", None):
            # the padded batch cache (`eagle3.serving.batch.BatchKV`) holds keys/values only: rows of a hybrid
            # target would share, and never roll back, its linear layers' recurrent state
            raise ConfigError(f"{target.family} has linear-attention layers with a recurrent state per sequence, "
                              "which the batched server does not keep per row; serve it elsewhere, or run "
                              "`eagle3 generate --target ... --chain K`")
        self.target = target
        self.fast = fast
        self._in_lane = False  # a request is decoding on the fast lane (neither waiting nor in the batch)
        self.tokenizer = tokenizer
        self.tokenizer_lock = threading.Lock()  # HF tokenizers are not safe to share across threads
        self.eos = set(int(e) for e in eos_token_ids)
        self.drafter = drafter
        self.policy = policy or SpecPolicy(largest=DraftShape() if drafter is not None else None)
        self.gate = self.policy.speed_gate() if self.policy.measure else None
        # the lane's own gate, in whole requests: speculative lane requests vs plain ones on a drafter-less
        # engine that shares the lane's fused weights and caches
        self._lane_plain, self._lane_gate = None, None
        if fast is not None and fast.mode != "none" and self.policy.measure:
            from eagle3.fast.engine import FastEngine

            self._lane_plain = FastEngine(fast.model, draft="none", target=fast.target, options=fast.options)
            self._lane_gate = self.policy.lane_gate()
        self.config = config or ServeConfig()
        if self._lane_plain is not None and fast.seq_len:
            # capture (and compile) it now, on the caches the lane already holds, not inside its first request
            # (with `graph_prefill`, its prefills too, for every prompt those caches hold)
            plain = self._lane_plain
            plain.prepare(max(1, fast.seq_len - plain.core.slots_needed(0, 0)), 0)
        self.metrics = metrics or Metrics(self.config.model_name)
        self.fast_rows = rows
        # window decoding is exact unless the tokenizer rewrites spaces around punctuation after decoding
        self._incremental = tokenizer is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        # without that clean-up, a fast tokenizer's `decode` is its Rust backend's; calling the backend directly
        # skips the Python wrapper, which was most of the host time of a 64-row cycle
        # (only where the tokenizer class keeps the stock `decode`: a subclass that rewrites text keeps its own)
        self._backend = (getattr(tokenizer, "backend_tokenizer", None)
                         if self._incremental and _stock_decode(tokenizer) else None)
        self._frows: list[_Row] = []  # mirrors the active rows of `fast_rows`, in order
        if rows is not None and rows.capacity < self.config.max_batch_size:
            raise ValueError(f"FastRows holds {rows.capacity} rows; the server admits {self.config.max_batch_size}")
        self._rows_gate = self.policy.speed_gate() if rows is not None and self.policy.measure else None
        self._trace: deque[tuple[str, int, bool, bool, float, int]] = deque(maxlen=TRACE_CYCLES)
        self.cycles_traced = 0  # cycles ever appended to the trace
        self._cond = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        self._rows: list[_Row] = []
        self._kv = BatchKV()
        self._prefill_ema: float | None = None  # seconds per admission (prefill + first tokens), moving average
        self._first_prefill: float | None = None  # the first measurement, held until a second confirms it
        self._closing = False  # no new requests
        self._stopping = False  # leave the loop
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # set if the loop itself died

    # -- client side -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="eagle3-scheduler", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    @property
    def running(self) -> int:
        return len(self._rows) + len(self._frows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, handle: RequestHandle) -> None:
        with self._cond:
            if self._closing or not (self._thread and self._thread.is_alive()):
                raise SchedulerUnavailable("the server is shutting down; retry on another replica")
            if len(self._waiting) >= self.config.max_waiting:
                raise SchedulerUnavailable(
                    f"the server is overloaded ({len(self._waiting)} requests waiting); retry later")
            self._waiting.append(handle)
            self.metrics.set("eagle3_queue_depth", len(self._waiting))
            self._cond.notify_all()

    def cancel(self, handle: RequestHandle) -> None:
        """Free the request's slot at the next cycle boundary (its client went away)."""
        if handle.finished:
            return
        handle.cancelled = True
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """Stop admitting; let in-flight requests finish for up to `timeout` s, then cancel the rest."""
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        while ((self._rows or self._frows or self._waiting or self._in_lane) and time.monotonic() < deadline
               and self._thread_alive()):
            time.sleep(0.01)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, timeout))

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        dev = self.target.device
        # the current CUDA device is per thread, and this thread starts on cuda:0 whatever the model's GPU is
        on_gpu = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        try:
            with on_gpu, torch.inference_mode():
                while True:
                    with self._cond:
                        t0 = time.perf_counter()
                        while not self._rows and not self._frows and not self._waiting and not self._stopping:
                            self._cond.wait()
                        self.metrics.inc("eagle3_idle_seconds_total", time.perf_counter() - t0)
                        if self._stopping:
                            break
                        admitted = self._take_waiting()
                    self._step(admitted)
        except BaseException as e:  # the loop must never die silently: fail everything in flight
            self.error = e
            log.exception("scheduler loop died")
            raise
        finally:
            self._abort_all("the server is shutting down")

    def _step(self, admitted: list[RequestHandle]) -> None:
        try:
            self._drop_cancelled()
            if self._lane_takes(admitted):
                row = self._run_lane(admitted[0])
                if row is not None:  # interrupted by an arrival (or shutdown): continue in the batch
                    with varying_shape_attention(self.target.device):
                        self._join_batch(row)
                return
            if admitted:
                t0 = time.perf_counter()
                with varying_shape_attention(self.target.device):  # the batch cache widens every cycle
                    rest = self._add_fast_rows(admitted)
                    if rest:
                        self._prefill(rest)
                self._note_prefill(time.perf_counter() - t0)
            if self._frows:
                self._fast_cycle()
            if self._rows:
                with varying_shape_attention(self.target.device):
                    self._cycle()
        except Exception as e:  # a failed forward must not hang clients: fail this batch, keep serving
            log.exception("decoding step failed; failing %d in-flight requests", self.running + len(admitted))
            msg = f"internal error while decoding: {type(e).__name__}: {e}"
            for h in [r.handle for r in self._rows + self._frows] + admitted:
                self._send_error(h, msg, status=500)
            self._reset()
        finally:
            self.metrics.set("eagle3_running_requests", self.running)
            self.metrics.set("eagle3_queue_depth", len(self._waiting))

    def _reset(self) -> None:
        self._rows = []
        self._kv = BatchKV()
        self._frows = []
        if self.fast_rows is not None:  # free every row, also one a failed step added without a mirror
            while self.fast_rows.n:
                self.fast_rows.remove(self.fast_rows.n - 1)
        if self.drafter is not None:
            self.drafter.select([])

    def _abort_all(self, message: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for h in [r.handle for r in self._rows + self._frows] + waiting:
            self._send_error(h, message, status=503)
        self._reset()

    def _admission_due(self) -> bool:
        """Whether to admit the waiting requests now, or let more gather for one shared prefill while the batch
        decodes (`ServeConfig.admit_wait`): each prefill stalls every running row, and at small batch sizes one
        prefill of several prompts costs about what one of a single prompt does. With staggered finishes
        (speculative rows finish on different cycles) admitting at once meant one prefill per request."""
        wait = self.config.admit_wait
        if not self._waiting or not self.running or self._closing or wait == 0 or self._prefill_ema is None:
            return True
        if len(self._waiting) >= self.config.max_batch_size - self.running:  # nothing more could join
            return True
        return time.perf_counter() - self._waiting[0].arrival >= wait * self._prefill_ema

    def _note_prefill(self, seconds: float) -> None:
        """A moving average of admission time that follows a drop at once. The first measurement may be cold
        (first use of a kernel or shape), so it only counts once a second one is in: until then requests are
        admitted at once; a cold first one is then replaced by the (smaller) second."""
        if self._prefill_ema is None and self._first_prefill is None:
            self._first_prefill = seconds
            return
        ema = self._prefill_ema if self._prefill_ema is not None else self._first_prefill
        self._prefill_ema = min(seconds, 0.8 * ema + 0.2 * seconds)

    def _take_waiting(self) -> list[RequestHandle]:
        out: list[RequestHandle] = []
        if not self._admission_due():
            return out
        longest = 0
        while self._waiting and self.running + len(out) < self.config.max_batch_size:
            h = self._waiting[0]
            if h.cancelled:
                self._waiting.popleft()
                h.finished = True
                self.metrics.inc("eagle3_requests_total", endpoint=h.params.endpoint, finish_reason="cancelled")
                continue
            n = len(h.params.prompt_ids)
            if out and max(longest, n) * (len(out) + 1) > self.config.max_prefill_tokens:
                break
            longest = max(longest, n)
            out.append(self._waiting.popleft())
        return out

    def _drop_cancelled(self) -> None:
        for i in reversed(range(len(self._frows))):
            if self._frows[i].handle.cancelled:
                h = self._frows[i].handle
                h.finished = True
                self.metrics.inc("eagle3_requests_total", endpoint=h.params.endpoint, finish_reason="cancelled")
                self._remove_fast_row(i)
        keep = [i for i, r in enumerate(self._rows) if not r.handle.cancelled]
        if len(keep) == len(self._rows):
            return
        for r in self._rows:
            if r.handle.cancelled:
                r.handle.finished = True
                self.metrics.inc("eagle3_requests_total", endpoint=r.handle.params.endpoint,
                                 finish_reason="cancelled")
        self._select(keep)

    def _select(self, keep: list[int]) -> None:
        self._rows = [self._rows[i] for i in keep]
        self._kv.select(keep)
        if self.drafter is not None:
            self.drafter.select(keep)

    def _trace_cycle(self, path: str, rows: int, spec: bool, gate: SpeedGate | None, seconds: float,
                     tokens: int) -> None:
        """One decode cycle for `cycle_trace`: which path, rows, mode, whether the gate probed, time, tokens."""
        self._trace.append((path, rows, spec, gate is not None and gate.last_probe, seconds, tokens))
        self.cycles_traced += 1

    def cycle_trace(self, since: int = 0) -> dict[str, list]:
        """The decode cycles traced after the first `since` (at most the last TRACE_CYCLES), as columns: path
        ("rows", "batch" or "lane"; a lane cycle is timed between its token callbacks), rows, spec, probe (a gate
        probe of the slower mode), ms, tokens. Read it while the server is idle (between benchmark levels): the
        scheduler thread appends without a lock."""
        cycles = list(self._trace)[max(0, len(self._trace) - (self.cycles_traced - since)):]
        cols = ("path", "rows", "spec", "probe", "ms", "tokens")
        out = {c: [x[i] for x in cycles] for i, c in enumerate(cols)}
        out["ms"] = [round(1000 * s, 3) for s in out["ms"]]
        return out

    def gate_snapshots(self) -> dict[str, dict]:
        """The speed gates' current beliefs (`SpeedGate.snapshot`) by path: generic batch, fast lane, fast rows."""
        gates = {"batch": self.gate, "lane": self._lane_gate, "rows": self._rows_gate}
        return {name: g.snapshot() for name, g in gates.items() if g is not None}

    # -- the fast lane: one greedy request alone on the batch-1 fast path ------------------------
    def _lane_takes(self, admitted: list[RequestHandle]) -> bool:
        if not (self.fast is not None and not self._rows and not self._frows and len(admitted) == 1
                and not self._waiting and admitted[0].params.temperature == 0):
            return False
        # a compiled lane takes only what its prepared caches hold: growing them would recompile mid-request
        p = admitted[0].params
        return not self.fast.options.compile or self.fast.fits(len(p.prompt_ids), p.max_tokens)

    def _run_lane(self, h: RequestHandle) -> _Row | None:
        """Decode `h` on the fast engine until it finishes, is cancelled, or another request arrives; returns
        its row in the last case (to join the batch), else None."""
        p, m = h.params, self.metrics
        row = _Row(h, drafting=self.drafter is not None and self.policy.enabled)
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
            return h.cancelled or self._stopping or bool(self._waiting)

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
        spec = shape is not None and self.policy.enabled
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
        gated = self._rows_gate is not None and shape is not None and self.policy.enabled
        if gated:
            self._rows_gate.record(b, spec, seconds, emitted)
        self._trace_cycle("rows", b, spec, self._rows_gate if gated else None, seconds, emitted)

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
        anc = batch_ancestors(parents)  # [B, N+1, N+1]
        offsets = anc.sum(dim=-1) - 1  # [B, N+1] depth of each node
        lengths = list(self._kv.lengths)
        appended_at = self._kv.width
        logits, aux = batched_forward(self.target, ids, self._kv, anc, offsets)  # [B, N+1, V]
        top = self._choose(rows, logits, offsets, lengths)  # [B, N+1]
        paths, nxt = accept_greedy_batch(tokens, parents, anc, top)
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
        t, p = self.drafter.propose(drafting, shape)  # [R, N]
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

    # -- output --------------------------------------------------------------------------------
    def _stable_text(self, row: _Row) -> str:
        """The text of `row.out` so far, up to its last complete character, decoding only the newest tokens: the
        window from the previous read point is decoded with and without the new tokens and the difference is
        appended (both decodes start at the same token, so a tokenizer that drops a leading space does so in
        both; the offsets of vLLM's incremental detokenizer, vllm/transformers_utils/detokenizer_utils.py).
        A full decode per cycle costs O(length) per row, which at 64 streamed rows was host time per cycle."""
        out = row.out
        before = self._text(out[row.prefix_at : row.read_at])
        now = self._text(out[row.prefix_at :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            row.text += now[len(before) :]
            row.prefix_at, row.read_at = row.read_at, len(out)
        return row.text

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # token-level use (tests): no text, no stop strings
            return ""
        with self.tokenizer_lock:
            if self._backend is not None:
                return self._backend.decode(ids, skip_special_tokens=True)
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, row: _Row, new_tokens: list[int]) -> bool:
        """Append tokens until one finishes the request; stream text; True when the request is done."""
        p = row.handle.params
        finish, text, before = None, None, len(row.out)
        for tok in new_tokens:
            row.out.append(tok)
            text = None
            if tok in self.eos:
                finish = "stop"
                break
            if p.stop:
                text = self._text(row.out)
                if _find_stop(text, p.stop) >= 0:
                    finish = "stop"
                    break
            if len(row.out) >= p.max_tokens:
                finish = "length"
                break
        row.root = row.out[-1]
        self.metrics.inc("eagle3_generation_tokens_total", len(row.out) - before)
        if finish is None:
            # stream every `stream_interval` tokens (the first chunk at once): fewer, larger chunks cost less host
            # time per token at high concurrency (vLLM's and SGLang's `stream_interval`, in tokens as there)
            if p.stream and (row.sent == 0 or len(row.out) - row.streamed >= self.config.stream_interval):
                if text is None:
                    text = self._stable_text(row) if self._incremental else self._text(row.out)
                self._stream(row, text, final=False)
            return False
        text = self._text(row.out) if text is None else text
        cut = _find_stop(text, p.stop)
        if cut >= 0:
            text = text[:cut]
        if p.stream:
            self._stream(row, text, final=True)
        self._finish(row, finish, text)
        return True

    def _stream(self, row: _Row, text: str, final: bool) -> None:
        end = len(text)
        if not final:
            end = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character
            for s in row.handle.params.stop:  # hold back a suffix that could start a stop string
                for j in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:j]):
                        end -= j
                        break
        if end > row.sent:
            self._send(row.handle, Event("delta", text=text[row.sent : end]))
            row.sent, row.streamed = end, len(row.out)

    def _finish(self, row: _Row, reason: str, text: str) -> None:
        h = row.handle
        h.finished = True
        self.metrics.inc("eagle3_requests_total", endpoint=h.params.endpoint, finish_reason=reason)
        self.metrics.observe("eagle3_request_latency_seconds", time.perf_counter() - h.arrival)
        self._send(h, Event("done", text=text, finish_reason=reason, prompt_tokens=len(h.params.prompt_ids),
                            completion_tokens=len(row.out), token_ids=list(row.out)))

    def _send(self, handle: RequestHandle, event: Event) -> None:
        try:
            handle.sink(event)
        except Exception:  # a broken sink (client side gone) must not stop the batch
            log.exception("could not deliver an event for request %s", handle.id)
            handle.cancelled = True

    def _send_error(self, handle: RequestHandle, message: str, status: int) -> None:
        if handle.finished:
            return
        handle.finished = True
        self.metrics.inc("eagle3_requests_total", endpoint=handle.params.endpoint, finish_reason="error")
        self._send(handle, Event("error", text=message, status=status))
