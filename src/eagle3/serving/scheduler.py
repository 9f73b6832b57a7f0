"""Continuous batching with speculative decoding: one background thread owns the model and runs cycles.

Each loop iteration:

1. admit waiting requests (up to `max_batch_size` rows and `max_prefill_tokens` padded prompt tokens): each goes
   to the first rows backend that takes it (the fast rows where the server has them and the request fits their
   caches, else the HF rows), is prefilled with the others there in one padded forward, and emits its first token;
2. drop rows whose client went away;
3. run one cycle of each backend's rows (`eagle3.serving.paths`): the policy picks the draft shape for that many
   rows, the speed gate whether to speculate; the backend drafts a tree per row, verifies every row's [root, tree]
   in ONE target forward, keeps each row's accepted path (greedy, or position-keyed sampling, see
   `eagle3.decoding.sampling`) and feeds the drafter; the new tokens go to the clients;
4. finished rows (EOS, stop string, max_tokens) leave.

The rows backends share one interface (`add_many`, `cycle`, `remove`): `eagle3.fast.rows.FastRows` (static caches,
one cycle per batch-size bucket, captured as a CUDA graph on a GPU; families the fast path covers) and
`eagle3.decoding.hf_rows.HFRows` (any HF causal LM, one padded cache). Sampled rows draw the same position-keyed
tokens on both.

Results reach the HTTP side through each request's `sink` (called from this thread). Greedy output equals
`SpeculativeEngine` with `NoDraftProposer` token for token, whatever else shares the batch (padded batched
kernels differ from bs=1 ones only by float rounding, which could flip an exact argmax tie).

Drafter swaps (`swap_drafter`, `rollback_drafter`, called from any thread): the candidate is loaded and checked
against the target by the caller, then handed to this thread, which at the top of a loop iteration (between
cycles) runs the identity probe (`eagle3.decoding.drafters.identity_probe`) and switches: rows already decoding stop
drafting (the old drafter's cache is theirs; their greedy tokens are the target's either way), new rows draft with
the new drafter. The fast rows hold their own copy of the drafter's weights: a swap writes the new weights into it
where the shapes match (`FastDrafter.load_weights`; their captured graphs stay valid), else they decode plain from
then on.

The scheduler's parts: `requests` (what it serves), `paths` (the rows), `hf_rows` (the HF backend)
and `output` (text and events), all in `eagle3.serving`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from eagle3.config import ConfigError, DraftShape
from eagle3.decoding.drafters import BatchDrafter, Eagle3BatchDrafter, identity_probe
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.hf_rows import HFRows
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.drafter import Eagle3Drafter
from eagle3.runtime import drafter_for, encode_prompt
from eagle3.serving.config import ServeConfig
from eagle3.serving.metrics import Metrics
from eagle3.serving.output import OutputMixin, _stock_decode
from eagle3.serving.paths import PathsMixin, _Batch
from eagle3.serving.policy import SpecPolicy, SpeedGate
from eagle3.serving.requests import RequestHandle, SchedulerUnavailable
from eagle3.target import Target

if TYPE_CHECKING:
    from eagle3.fast.rows import FastRows

__all__ = ["LoadedDrafter", "Scheduler", "SwapRefused"]

log = logging.getLogger("eagle3.serving")

TRACE_CYCLES = 16384  # decode cycles kept for `cycle_trace` (a benchmark level runs a few hundred)
PROBE_PROMPT, PROBE_TOKENS = "Once upon a time", 16  # the identity probe a candidate drafter passes before a swap


@dataclass
class LoadedDrafter:
    """A drafter the server serves with: its version label, checkpoint folder (None: built in-process), and when
    it started serving new requests (unix seconds)."""

    version: str
    path: str | None
    loaded_at: float
    drafter: Eagle3Drafter | None = field(default=None, repr=False)

    def describe(self) -> dict:
        return {"version": self.version, "path": self.path, "loaded_at": round(self.loaded_at, 3)}


class SwapRefused(Exception):
    """A drafter swap the server refused, the old drafter still serving: `status` is the HTTP status to answer
    with (400: a bad candidate, 409: it fails the probe or there is nothing to roll back to, 503: shutting down)."""

    def __init__(self, message: str, status: int, code: str):
        super().__init__(message)
        self.status, self.code = status, code


class _SwapOrder:
    """A swap to `candidate` (None: a rollback) for the scheduler thread, which sets `done` once it has applied or
    refused it (`error`)."""

    def __init__(self, candidate: LoadedDrafter | None):
        self.candidate = candidate
        self.done = threading.Event()
        self.error: SwapRefused | None = None


class Scheduler(PathsMixin, OutputMixin):
    """Owns the target, the drafter and the rows; `start()` runs the loop in a daemon thread."""

    def __init__(
        self,
        target: Target,
        tokenizer,
        eos_token_ids: Sequence[int],
        drafter: BatchDrafter | None = None,
        policy: SpecPolicy | None = None,
        config: ServeConfig | None = None,
        metrics: Metrics | None = None,
        rows: FastRows | None = None,
    ):
        """`rows`: `FastRows` on the same model (see the module docstring)."""
        self.target = target
        self.tokenizer = tokenizer
        self.tokenizer_lock = threading.Lock()  # HF tokenizers are not safe to share across threads
        self.eos = set(int(e) for e in eos_token_ids)
        self.policy = policy or SpecPolicy(largest=DraftShape() if drafter is not None else None)
        self.config = config or ServeConfig()
        self.batch = HFRows(target, drafter, self.config.max_batch_size, shapes=self.policy.shape)
        self.metrics = metrics or Metrics(self.config.model_name)
        self.fast_rows = rows
        self.loaded = LoadedDrafter("v1" if drafter is not None else "none", None, time.time(),
                                    drafter.drafter if isinstance(drafter, Eagle3BatchDrafter) else None)
        self.previous: LoadedDrafter | None = None  # what `rollback_drafter` returns to
        self.metrics.set_info("eagle3_drafter_version", version=self.loaded.version)
        self._swaps: deque[_SwapOrder] = deque()
        self._swap_lock = threading.Lock()  # one swap at a time, from loading to switching
        self._next_version = 2
        self._probe_plain: tuple[list[int], list[int]] | None = None  # the probe's prompt and plain tokens
        self._grammars = None  # `GrammarCompiler`, built for the first constrained request
        self.recorder = None
        if self.config.record:
            from eagle3.traffic import TrafficRecorder

            self.recorder = TrafficRecorder(self.config.record, shard_rows=self.config.record_shard_rows)
        # window decoding is exact unless the tokenizer rewrites spaces around punctuation after decoding
        self._incremental = tokenizer is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        # without that clean-up, a fast tokenizer's `decode` is its Rust backend's; calling the backend directly
        # skips the Python wrapper, which was most of the host time of a 64-row cycle
        # (only where the tokenizer class keeps the stock `decode`: a subclass that rewrites text keeps its own)
        self._backend = (getattr(tokenizer, "backend_tokenizer", None)
                         if self._incremental and _stock_decode(tokenizer) else None)
        if rows is not None and rows.capacity < self.config.max_batch_size:
            raise ValueError(f"FastRows holds {rows.capacity} rows; the server admits {self.config.max_batch_size}")

        def gate() -> SpeedGate | None:
            return self.policy.speed_gate() if self.policy.measure else None

        # the backends in the order they take requests; the HF rows, last, take any
        self._batches = [_Batch("rows", rows, gate())] if rows is not None else []
        self._batches.append(_Batch("batch", self.batch, gate()))
        self._trace: deque[tuple[str, int, bool, bool, float, int]] = deque(maxlen=TRACE_CYCLES)
        self.cycles_traced = 0  # cycles ever appended to the trace
        self._cond = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
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
    def drafter(self) -> BatchDrafter | None:
        """The drafter of the HF rows (the one a swap replaces)."""
        return self.batch.drafter

    @property
    def running(self) -> int:
        return sum(len(b.rows) for b in self._batches)

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
        while ((self.running or self._waiting) and time.monotonic() < deadline
               and self._thread_alive()):
            time.sleep(0.01)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, timeout))
        if self.recorder is not None:  # what was recorded and not yet in a shard
            self.recorder.close()

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- drafter swaps -------------------------------------------------------------------------
    @property
    def drafter_version(self) -> str:
        """The version label of the drafter new requests get ("none": no drafter); recorded traffic carries it."""
        return self.loaded.version

    def swap_drafter(self, path: str) -> LoadedDrafter:
        """Serve new requests with the drafter saved at `path` from the next cycle boundary on; returns it once it
        serves. Raises `SwapRefused` (the current drafter keeps serving) for a candidate that does not load against
        the target, reads other aux layers than the target taps, or fails the identity probe."""
        with self._swap_lock:
            if not isinstance(self.drafter, Eagle3BatchDrafter):
                raise SwapRefused("this server runs no EAGLE-3 drafter (started without --drafter, or with --draft "
                                  "ngram or --no-spec), so its target taps no layers: restart it with --drafter DIR",
                                  400, "no_drafter")
            try:
                candidate = drafter_for(self.target.model, path)
            except ConfigError as e:
                raise SwapRefused(str(e), 400, "invalid_drafter") from None
            except (OSError, ValueError, RuntimeError) as e:  # unreadable weights
                raise SwapRefused(f"{path}: {type(e).__name__}: {e}", 400, "invalid_drafter") from None
            taps, reads = sorted(self.target.aux_layer_ids), sorted(candidate.config.aux_layer_ids)
            if reads != taps:
                raise SwapRefused(f"the candidate reads aux layers {reads}; this server's target taps {taps}, fixed "
                                  f"at start: restart the server with --drafter {path} to serve it", 400,
                                  "aux_layers_differ")
            loaded = self._order(LoadedDrafter(f"v{self._next_version}", str(path), time.time(), candidate))
            self._next_version += 1
            return loaded

    def rollback_drafter(self) -> LoadedDrafter:
        """Serve new requests with the drafter the last swap replaced (kept until then; one level only)."""
        with self._swap_lock:
            return self._order(None)

    def _order(self, candidate: LoadedDrafter | None) -> LoadedDrafter:
        order = _SwapOrder(candidate)
        with self._cond:
            if self._closing or not self._thread_alive():
                raise SwapRefused("the server is shutting down", 503, "server_unavailable")
            self._swaps.append(order)
            self._cond.notify_all()
        while not order.done.wait(0.5):
            if not self._thread_alive():
                raise SwapRefused("the scheduler stopped before the swap", 503, "server_unavailable")
        if order.error is not None:
            raise order.error
        return self.loaded

    def _apply_swaps(self) -> None:
        """Apply or refuse the pending swap orders (this thread, between cycles)."""
        with self._cond:
            orders, self._swaps = list(self._swaps), deque()
        for order in orders:
            try:
                if order.candidate is None:
                    if self.previous is None:
                        raise SwapRefused("there is no previous drafter to roll back to", 409, "nothing_to_roll_back")
                    self._serve_with(self.previous, previous=None)
                else:
                    why = self._probe(order.candidate.drafter)
                    if why is not None:
                        raise SwapRefused(f"greedy decoding with the candidate differs from the target's own: {why}",
                                          409, "probe_mismatch")
                    self._serve_with(order.candidate, previous=self.loaded)
            except SwapRefused as e:
                order.error = e
            except Exception as e:  # a probe run that crashes: the candidate cannot draft for this target
                log.exception("drafter swap failed; the current drafter keeps serving")
                order.error = SwapRefused(f"the candidate failed its probe run: {type(e).__name__}: {e}", 400,
                                          "invalid_drafter")
            finally:
                order.done.set()

    def _probe(self, candidate: Eagle3Drafter) -> str | None:
        if self._probe_plain is None:  # the target's own greedy tokens, once
            with self.tokenizer_lock:
                prompt = encode_prompt(self.tokenizer, prompt=PROBE_PROMPT) if self.tokenizer is not None else [1]
            plain = SpeculativeEngine(self.target, NoDraftProposer(self.target.device)).generate(prompt, PROBE_TOKENS)
            self._probe_plain = (prompt, plain.token_ids)
        prompt, plain_ids = self._probe_plain
        return identity_probe(self.target, candidate, self.policy.largest or DraftShape(), prompt, plain_ids)

    def _serve_with(self, new: LoadedDrafter, previous: LoadedDrafter | None) -> None:
        """Switch drafters: the HF rows decoding now finish without drafting, new rows draft with `new`. The fast
        rows take `new`'s weights into their own tensors (their graphs stay valid) where its shapes allow
        (`FastDrafter.mismatch`), else they decode plain from now on."""
        from eagle3.fast.drafter import load_in_place

        self.batch.swap_drafter(Eagle3BatchDrafter(new.drafter))
        fast = [b.backend.d for b in self._batches
                if b.backend is not self.batch and b.spec and b.backend.d is not None]
        why = load_in_place(fast, new.drafter)
        if why is not None:
            log.warning("the fast rows decode plain from now on: %s", why)
            for b in self._batches:
                b.spec = b.backend is self.batch
        old = self.loaded.version
        new.loaded_at = time.time()
        self.loaded, self.previous = new, previous
        self.metrics.set_info("eagle3_drafter_version", version=new.version)
        log.info("drafter %s (%s) serves new requests, replacing %s; %d rows in flight finish without drafting on "
                 "the HF rows", new.version, new.path, old, self.running)

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
                        while not self.running and not self._waiting and not self._swaps and not self._stopping:
                            self._cond.wait()
                        self.metrics.inc("eagle3_idle_seconds_total", time.perf_counter() - t0)
                        if self._stopping:
                            break
                        admitted = self._take_waiting()
                    if self._swaps:
                        self._apply_swaps()  # before the admitted rows join: they draft with the new drafter
                    self._step(admitted)
        except BaseException as e:  # the loop must never die silently: fail everything in flight
            self.error = e
            log.exception("scheduler loop died")
            raise
        finally:
            self._abort_all("the server is shutting down")
            with self._cond:
                orders, self._swaps = list(self._swaps), deque()
            for order in orders:
                order.error = SwapRefused("the server is shutting down", 503, "server_unavailable")
                order.done.set()

    def _step(self, admitted: list[RequestHandle]) -> None:
        try:
            self._drop_cancelled()
            if admitted:
                t0 = time.perf_counter()
                self._admit(admitted)
                self._note_prefill(time.perf_counter() - t0)
            for b in self._batches:
                if b.rows:
                    self._cycle(b)
        except Exception as e:  # a failed forward must not hang clients: fail this batch, keep serving
            log.exception("decoding step failed; failing %d in-flight requests", self.running + len(admitted))
            msg = f"internal error while decoding: {type(e).__name__}: {e}"
            for h in [r.handle for b in self._batches for r in b.rows] + admitted:
                self._send_error(h, msg, status=500)
            self._reset()
        finally:
            self.metrics.set("eagle3_running_requests", self.running)
            self.metrics.set("eagle3_queue_depth", len(self._waiting))

    def _reset(self) -> None:
        for b in self._batches:  # free every row, also one a failed step added without a mirror
            b.rows = []
            b.backend.clear()

    def _abort_all(self, message: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for h in [r.handle for b in self._batches for r in b.rows] + waiting:
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
        for b in self._batches:
            for i in reversed(range(len(b.rows))):
                h = b.rows[i].handle
                if h.cancelled:
                    h.finished = True
                    self.metrics.inc("eagle3_requests_total", endpoint=h.params.endpoint, finish_reason="cancelled")
                    self._remove_row(b, i)

    def _trace_cycle(self, path: str, rows: int, spec: bool, gate: SpeedGate | None, seconds: float,
                     tokens: int) -> None:
        """One decode cycle for `cycle_trace`: which path, rows, mode, whether the gate probed, time, tokens."""
        self._trace.append((path, rows, spec, gate is not None and gate.last_probe, seconds, tokens))
        self.cycles_traced += 1

    def cycle_trace(self, since: int = 0) -> dict[str, list]:
        """The decode cycles traced after the first `since` (at most the last TRACE_CYCLES), as columns: path
        ("rows": the fast rows, "batch": the HF rows), rows, spec, probe (a gate probe of the slower mode), ms,
        tokens. Read it while the server is idle (between benchmark levels): the
        scheduler thread appends without a lock."""
        cycles = list(self._trace)[max(0, len(self._trace) - (self.cycles_traced - since)):]
        cols = ("path", "rows", "spec", "probe", "ms", "tokens")
        out = {c: [x[i] for x in cycles] for i, c in enumerate(cols)}
        out["ms"] = [round(1000 * s, 3) for s in out["ms"]]
        return out

    def gate_snapshots(self) -> dict[str, dict]:
        """The speed gates' current beliefs (`SpeedGate.snapshot`) by path: fast rows, HF rows."""
        return {b.name: b.gate.snapshot() for b in self._batches if b.gate is not None}
