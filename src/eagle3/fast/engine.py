"""`FastEngine`: one request at a time on the fast path, as one row of `eagle3.fast.rows.FastRows`.

Same `generate(...)` signature and `GenerationResult` as `eagle3.decoding.engine.SpeculativeEngine`, and the same
cycle as the server's batch: each cycle (draft -> verify -> accept -> compact -> feed the drafter) is one captured
graph on CUDA, and the host reads one small packet per cycle: the accepted count and the emitted tokens, which it
needs for EOS, stop strings and streaming. With `pipeline` (CUDA only) the next cycle is launched before that
packet is read, so the GPU does not wait for the host; when generation stops, the extra cycle's work is dropped.

Draft kinds: "none" (plain decoding), "eagle3" (chain or EAGLE-2 tree drafted on device), "ngram" and any
`eagle3.decoding.proposers.Proposer` (drafted on the host, padded to a fixed node count; one host round trip per
cycle). Sampled requests (temperature > 0) run the same cycles: the target's choice after each node is the
request's position-keyed draw (`eagle3.decoding.sampling`) instead of the argmax, computed inside the cycle.

`build_engine` returns a `FastEngine` when the target is of a fast-path family (`FAST_MODEL_TYPES`), else the
generic engine with a logged notice.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from eagle3.config import (
    DEFAULT_MAX_NEW_TOKENS,
    ConfigError,
    DraftShape,
    SamplingConfig,
    on_for_device,
)
from eagle3.decoding.engine import GenerationResult, GenerationStats, Request, SpeculativeEngine
from eagle3.decoding.grammar import Grammar
from eagle3.decoding.guard import EngineGuards, SpeculationGuard
from eagle3.decoding.proposers import NgramProposer, Proposer
from eagle3.decoding.sampling import GREEDY, sampling_mode
from eagle3.drafter import Eagle3Drafter
from eagle3.fast.drafter import FastDrafter
from eagle3.fast.rows import FastRows, cycle_margin, drafts_by_position
from eagle3.fast.target import STEP_ROWS, FastTarget, fast_support

log = logging.getLogger("eagle3.fast")

FAST_DRAFT_KINDS = ("none", "eagle3", "ngram")


@dataclass
class FastOptions:
    """How the fast path runs. `graphs` and `pipeline` only matter on CUDA."""

    graphs: bool = True  # capture each cycle in a CUDA graph (False: eager kernels, same code)
    compile_backend: str = "inductor"  # the compiled pieces' torch.compile backend ("aot_eager": no codegen)
    # compile the target's RoPE and SwiGLU (`Pointwise`, `fuse_level`): "elementwise" (True) or "off" (False); None
    # or "auto": elementwise on CUDA, off on a CPU. A shared target stays as it is.
    fuse_pointwise: bool | str | None = None
    # compile the cycle's pieces that do not run the target (`FastRows.compile_drafting`; emitted tokens unchanged).
    # None: on CUDA, where the compiled kernels are captured in the cycle's graph and shorten it; not on a CPU,
    # where compiling takes seconds and the target dominates a cycle.
    compile_drafting: bool | None = None
    # the target's attention in decoding forwards (`target_attention_for`): "split" (`eagle3.fast.split_attention`),
    # "sdpa", or None / "auto": split on CUDA where Triton imports, sdpa elsewhere. A shared target
    # takes the last engine's choice.
    target_attention: str | None = None
    pipeline: bool = True  # launch cycle i+1 before reading cycle i's packet (device drafting, greedy)
    # run each prompt's prefill (target, then drafter) padded to a power of two of at least 16 tokens, a
    # fixed-shape function captured per width like the cycles: an eager prefill launches every kernel from
    # Python (hundreds of launches) while the request waits for its first token. None: on CUDA
    # (`graph_prefill_by_default`), in the server, `eagle3 generate` and `bench` alike.
    graph_prefill: bool | None = None
    max_seq_len: int = 0  # cache slots to allocate up front (0: sized by the first request, grown on demand)
    # chains only, cycles that run eagerly (a CPU, or graphs off): stop drafting once the chain's joint draft
    # probability falls below this and verify only the drafted tokens (`FastRows(chain_stop=)`); None: draft
    # the full chain every cycle.
    chain_stop: float | None = None
    # time each request's cycles and pause drafting while it is slower than plain decoding
    # (`eagle3.decoding.guard`; EAGLE-3 drafting). Its plain steps are captured like the cycles.
    guard: bool = False
    seq_align: int = 128  # slot counts are rounded up to a multiple of this
    # sampled requests: draft with the noise of the target's own draws, coupling each draft to the token the
    # target will draw (`eagle3.decoding.expand.coupled_top_k`); False: the drafter's top-k, as for greedy ones
    coupled_drafts: bool = True
    # CUDA: pad every decoding forward to `STEP_ROWS` tokens so that each product runs one kernel whatever the
    # forward holds (`FastTarget.step_rows`): greedy trees of up to 63 nodes then keep plain decoding's bits by
    # construction, not only where the vendor's kernels happen to agree. A shared target takes the last choice.
    batch_invariant: bool = False


def graph_prefill_by_default(device: torch.device | str) -> bool:
    """`FastOptions.graph_prefill`'s default: on CUDA, where the prefill's graphs replay instead of launching each
    kernel; not on a CPU, where the padding to a power of two costs compute and there are no launches to save
    (the auto of every auto/on/off option)."""
    return on_for_device("auto", device)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def drafting_compiled_by_default(device: torch.device | str) -> bool:
    """`FastOptions.compile_drafting`'s default: on CUDA, where the compiled pieces are captured in the cycle's
    graph and shorten it."""
    return torch.device(device).type == "cuda"


class FastEngine:
    """Batch-1 speculative decoding on `eagle3.fast` (static caches, fixed shapes, CUDA graphs): one row of
    `FastRows`."""

    def __init__(
        self,
        model: torch.nn.Module,
        draft: str | Proposer = "none",
        spec: DraftShape | None = None,
        drafter: Eagle3Drafter | None = None,
        tokenizer=None,
        options: FastOptions | None = None,
        max_nodes: int | None = None,
        target: FastTarget | None = None,
    ):
        """`target`: a `FastTarget` to share with other engines (one copy of the fused weights); it must carry the
        drafter's aux layer ids when `draft` is 'eagle3'."""
        self.model, self.tokenizer = model, tokenizer
        self.options = options or FastOptions()
        self.spec = spec or DraftShape()  # the draft shape
        self.proposer: Proposer | None = None
        self.max_nodes = 0
        if isinstance(draft, Proposer):
            if not max_nodes:
                raise ConfigError("a host-side proposer needs max_nodes (the most draft nodes it proposes)")
            self.proposer, mode, self.draft, self.max_nodes = draft, "host", draft.name, int(max_nodes)
        elif draft == "none":
            mode, self.draft = "none", "none"
        elif draft == "ngram":
            k = self.spec.depth
            self.proposer, mode, self.draft, self.max_nodes = NgramProposer(length=k), "host", "ngram", k
        elif draft == "eagle3":
            if drafter is None:
                raise ConfigError("draft 'eagle3' needs a drafter (--drafter DIR)")
            mode, self.draft = "eagle3", "eagle3"
        else:
            raise ConfigError(f"unknown draft kind {draft!r}; expected one of {FAST_DRAFT_KINDS} or a Proposer")
        aux_ids = sorted(drafter.config.aux_layer_ids) if mode == "eagle3" else []
        if target is None:
            target = FastTarget(model, aux_ids)
        elif mode == "eagle3" and target.aux_layer_ids != aux_ids:
            raise ConfigError(f"the shared FastTarget taps layers {target.aux_layer_ids}; the drafter needs "
                              f"{aux_ids}: build the FastTarget with the drafter's aux_layer_ids")
        if not target.pointwise.compiled:  # `fuse_pointwise` resolves auto/off for the target's device
            target.fuse_pointwise(self.options.compile_backend, self.options.fuse_pointwise)
        self.target_attention = target.use_attention(self.options.target_attention)
        target.step_rows = STEP_ROWS if self.options.batch_invariant and target.device.type == "cuda" else 0
        self.target = target
        self.drafter = FastDrafter(drafter) if mode == "eagle3" else None  # shared by the rows of every size
        o = self.options
        if o.graph_prefill is None:
            self.options = o = replace(o, graph_prefill=graph_prefill_by_default(target.device))
        cd = drafting_compiled_by_default(target.device) if o.compile_drafting is None else o.compile_drafting
        self.compile_drafting = bool(cd) and mode != "none"
        self.mode = mode
        self.device = target.device
        if o.chain_stop is not None:
            if mode != "eagle3" or not self.spec.is_chain:
                raise ConfigError("chain_stop (--chain-stop) is for EAGLE-3 chains")
            if not 0.0 < o.chain_stop < 1.0:
                raise ConfigError(f"chain_stop {o.chain_stop}: expected a probability between 0 and 1")
            if not self.eager:
                raise ConfigError("chain_stop (--chain-stop) needs cycles that run eagerly, where the host can "
                                  "read each draft step: a CPU, or CUDA with graphs and compilation off")
        if o.guard and mode != "eagle3":
            raise ConfigError("the speculation guard is for EAGLE-3 drafting (--draft eagle3)")
        self.guards = EngineGuards(SpeculationGuard)  # what the guard learned, kept from request to request
        self.rows: FastRows | None = None  # built by `reserve`, again where a request needs more slots

    # -- setup ---------------------------------------------------------------------------------
    @property
    def eager(self) -> bool:
        """Whether cycles run eagerly (no graph, nothing compiled), so the host can act between draft steps."""
        return not ((self.options.graphs and self.device.type == "cuda") or self.compile_drafting)

    @property
    def seq_len(self) -> int:
        return self.rows.seq_len if self.rows is not None else 0

    def reserve(self, prompt_len: int, max_new_tokens: int) -> None:
        """Make the row's caches big enough for a request (room for one pipelined cycle beyond its end); new
        caches drop the captured graphs."""
        shapes = ([DraftShape.chain(self.max_nodes)] if self.max_nodes  # a host tree: as deep as its nodes
                  else [self.spec] if self.mode == "eagle3" else [])
        need = prompt_len + max_new_tokens + 2 * cycle_margin(shapes)
        if need <= self.seq_len:
            return
        o = self.options
        size = _round_up(max(need, o.max_seq_len, self.seq_len), o.seq_align)
        if self.rows is not None:
            log.info("fast path: caches resized (%d slots); capturing again", size)
        self.rows = FastRows(self.target, self.drafter, capacity=1, seq_len=size,
                             shapes=(lambda _b: self.spec) if self.mode == "eagle3" else None, graphs=o.graphs,
                             chain_stop=o.chain_stop, host_nodes=self.max_nodes, coupled=o.coupled_drafts,
                             prefill_graphs=o.graph_prefill, prefill_tokens=size)  # staging: one row's slots
        if self.compile_drafting:
            self.rows.compile_drafting(o.compile_backend)

    @torch.no_grad()
    def prepare(self, prompt_len: int, max_new_tokens: int, mode: int | tuple[int, ...] = GREEDY) -> float:
        """Allocate and capture everything a request of this size and sampling mode (`sampling_mode`; several:
        each of them) needs; returns the seconds it took."""
        t0 = time.perf_counter()
        self.reserve(prompt_len, max_new_tokens)
        modes = (mode,) if isinstance(mode, int) else tuple(mode)
        self.rows.prepare(modes, spec=self.mode != "none", plain=self.mode == "none" or self.options.guard,
                          max_prompt=prompt_len)
        return time.perf_counter() - t0

    @property
    def graphed(self) -> bool:
        """Whether every prepared step replays a CUDA graph (False on CPU, with --no-graphs, or after a
        capture failure)."""
        runners = [*self.rows._runners.values(), *self.rows._feeds.values()] if self.rows is not None else []
        return bool(runners) and all(r.graph is not None for r in runners)

    @property
    def drafting_compiled(self) -> bool:
        return self.rows.drafting_compiled if self.rows is not None else self.compile_drafting

    def settings(self) -> dict:
        """What this engine runs with, resolved for its device (for run records: `eagle3 eval`)."""
        o = self.options
        paths = drafts_by_position(self.target, self.drafter)
        return {"engine": "fast", "graphs": o.graphs and self.device.type == "cuda",
                "pointwise_compiled": sorted(self.target.pointwise.fused), "graph_prefill": o.graph_prefill,
                "drafting_compiled": self.drafting_compiled, "drafter_attention": "split" if paths else "mask",
                "target_attention": self.target_attention, "norms_folded": self.target.folded,
                "batch_invariant": self.target.step_rows > 0,
                "chain_stop": o.chain_stop, "guard": o.guard, "coupled_drafts": o.coupled_drafts}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- generate ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sampling: SamplingConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationResult:
        """`grammar` (`eagle3.decoding.grammar`, fresh) constrains every token to what it allows: the host computes
        its masks between the cycle's pieces (`eagle3.fast.row_grammar`)."""
        req = Request.check(prompt_ids, max_new_tokens, sampling, eos_token_ids, stop_strings, on_text,
                            self.tokenizer)
        eos, stream, prompt = req.eos, req.stream, req.prompt
        mode = self._mode(req)
        self.prepare(prompt.numel(), max_new_tokens, mode)
        rows = self.rows
        stats = GenerationStats()
        t0 = time.perf_counter()
        try:
            first = rows.add(prompt.tolist(), sampling=replace(req.sampling, seed=req.seed) if mode else None,
                             grammar=grammar)
            out = [first]
            finish = SpeculativeEngine._finished(out, eos, max_new_tokens, stream, stop_strings)
            if self.proposer is not None:
                self.proposer.begin(prompt, None, out[0])
            self._sync()
            stats.prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            if finish is None:
                emit = lambda new: self._emit(out, new, eos, max_new_tokens, stream, stop_strings)  # noqa: E731
                if self.mode == "host":
                    finish = self._loop_host(stats, emit)
                else:
                    guard = self.guards.for_request(mode != GREEDY) if self.options.guard else None
                    finish = self._loop(stats, emit, guard)
            self._sync()
            stats.verify_s = time.perf_counter() - t1  # cycles are fused: drafting time is inside verify_s
        finally:
            rows.clear()
        return stream.result(out, finish, stats, t0)

    def _emit(self, out, new, eos, max_new_tokens, stream, stop_strings) -> str | None:
        for tok in new:
            out.append(tok)
            finish = SpeculativeEngine._finished(out, eos, max_new_tokens, stream, stop_strings)
            if finish is not None:
                return finish
        return None

    @staticmethod
    def _mode(req: Request) -> int:
        s = req.sampling
        return sampling_mode(s.temperature, s.top_p, s.top_k)

    def _loop(self, stats: GenerationStats, emit: Callable[[list[int]], str | None],
              guard: SpeculationGuard | None = None) -> str:
        """Drafting on device (or none): one packet read per cycle, pipelined on CUDA (cycle i+1 is launched
        before cycle i's packet is read). Under a `guard` each cycle drafts, or is a plain step, as the guard
        says, timed from one packet to the next; its decisions then trail its measurements by a cycle."""
        rows, speculate = self.rows, self.mode == "eagle3"
        pipeline = self.device.type == "cuda" and self.options.pipeline
        in_flight: deque[bool] = deque()

        def launch() -> None:
            drafting = speculate and (guard is None or guard.drafting())
            rows.launch(drafting)
            in_flight.append(drafting)

        t = time.perf_counter()
        launch()
        while True:
            if pipeline:
                launch()
            drafting = in_flight.popleft()
            new = rows.collect()[0]
            n_acc = len(new) - 1
            if guard is not None:
                now = time.perf_counter()
                guard.record(drafting, now - t, n_acc + 1)
                t = now
            stats.cycles += 1
            stats.plain_steps += speculate and not drafting
            stats.accepted_per_cycle.append(n_acc)
            stats.drafted_depth_per_cycle.append(rows.depths[0])
            stats.drafted_tokens += rows.drafted[0]
            finish = emit(new)
            if finish is not None:
                return finish
            if not pipeline:
                launch()

    def _loop_host(self, stats: GenerationStats, emit: Callable[[list[int]], str | None]) -> str:
        """A host proposer: write its tree, run the cycle, read the packet."""
        rows = self.rows
        while True:
            tree = self.proposer.propose()
            tree.validate()
            rows.load_tree(0, tree.tokens.tolist(), tree.parents.tolist())
            new = rows.cycle(True)[0]
            stats.cycles += 1
            stats.accepted_per_cycle.append(len(new) - 1)
            stats.drafted_depth_per_cycle.append(rows.depths[0])
            stats.drafted_tokens += tree.n
            finish = emit(new)
            if finish is not None:
                return finish
            self.proposer.accept(None, torch.tensor(new))


def build_engine(
    model: torch.nn.Module,
    draft: str = "none",
    spec: DraftShape | None = None,
    drafter: Eagle3Drafter | None = None,
    tokenizer=None,
    options: FastOptions | None = None,
):
    """A `FastEngine` when the target's family is supported, else `SpeculativeEngine` (with a logged notice)."""
    spec = spec or DraftShape()
    reason = fast_support(model)
    if reason is None:
        return FastEngine(model, draft=draft, spec=spec, drafter=drafter, tokenizer=tokenizer, options=options)
    log.warning("fast path unavailable (%s); using the generic engine", reason)
    from eagle3.runtime import make_proposer
    from eagle3.target import Target

    device = next(model.parameters()).device
    target = Target(model, drafter.config.aux_layer_ids if draft == "eagle3" and drafter is not None else [])
    return SpeculativeEngine(target, make_proposer(draft, spec, drafter, device), tokenizer)


def fast_engine_for(runtime, options: FastOptions | None = None):
    """The fast engine for an `eagle3.runtime.Runtime` (what `eagle3 generate --fast` uses), or its own
    generic engine when the target is not supported (logged)."""
    reason = fast_support(runtime.model)
    if reason is not None:
        log.warning("fast path unavailable (%s); using the generic engine", reason)
        return runtime.engine
    return FastEngine(runtime.model, draft=runtime.draft, spec=runtime.spec, drafter=runtime.drafter,
                      tokenizer=runtime.tokenizer, options=options)
