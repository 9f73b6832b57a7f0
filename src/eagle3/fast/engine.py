"""`FastEngine`: the speculative decoding loop on the static-cache, graph-captured path (batch size 1).

Same `generate(...)` signature and `GenerationResult` as `eagle3.decoding.engine.SpeculativeEngine`. Greedy
decoding runs one captured graph per cycle (draft -> verify -> accept -> compact -> feed the drafter) and reads
one small packet back per cycle: the accepted count and the emitted tokens, which the host needs for EOS, stop
strings and streaming. With `pipeline` (CUDA only) the next cycle is launched before that packet is read, so the
GPU does not wait for the host; when generation stops, the extra cycle's work is discarded.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from eagle3.attention import varying_shape_attention
from eagle3.config import (
    DEFAULT_MAX_NEW_TOKENS,
    ConfigError,
    DraftShape,
    SamplingConfig,
    on_for_device,
)
from eagle3.decoding.engine import GenerationResult, GenerationStats, Request, SpeculativeEngine
from eagle3.decoding.guard import EngineGuards, SpeculationGuard
from eagle3.decoding.proposers import NgramProposer, Proposer
from eagle3.decoding.sampling import GREEDY, sampling_mode
from eagle3.drafter import Eagle3Drafter
from eagle3.fast.core import FastCore
from eagle3.fast.drafter import FastDrafter, drafter_attention_for
from eagle3.fast.graphs import StepRunner, graph_pool
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
    # compile the cycle's pieces that do not run the target (`FastCore.compile_drafting`; emitted tokens unchanged).
    # None: on CUDA, where the compiled kernels are captured in the cycle's graph and shorten it; not on a CPU,
    # where compiling takes seconds and the target dominates a cycle.
    compile_drafting: bool | None = None
    # the drafter's attention (`drafter_attention_for`): "matmul" (`FastDrafter.use_matmul_attention`),
    # "split" (`FastDrafter.use_split_attention`), "prefix" (`prefix_attention`) or None / "auto": split on CUDA
    # where Triton and the head size allow, else matmul; prefix elsewhere
    drafter_attention: str | None = None
    # the target's attention in decoding forwards (`target_attention_for`): "split" (`eagle3.fast.split_attention`),
    # "sdpa", or None / "auto": split on CUDA where Triton imports, sdpa elsewhere. A shared target
    # takes the last engine's choice.
    target_attention: str | None = None
    pipeline: bool = True  # launch cycle i+1 before reading cycle i's packet (device drafting, greedy)
    # run each prompt's prefill (target, then drafter) padded to a power of two of at least PREFILL_MIN_WIDTH
    # tokens, a fixed-shape function captured per width like the cycles: an eager prefill launches every kernel
    # from Python (hundreds of launches) while the request waits for its first token. None: on CUDA
    # (`graph_prefill_by_default`), in the server, `eagle3 generate` and `bench` alike.
    graph_prefill: bool | None = None
    max_seq_len: int = 0  # cache slots to allocate up front (0: sized by the first request, grown on demand)
    # chains only, cycles that run eagerly (a CPU, or graphs off): stop drafting once the chain's joint draft
    # probability falls below this and verify only the drafted tokens (`FastCore.draft_chain_until`); None: draft
    # the full chain every cycle.
    chain_stop: float | None = None
    # time each request's cycles and pause drafting while it is slower than plain decoding
    # (`eagle3.decoding.guard`; EAGLE-3 drafting). Its plain steps are captured like the cycles.
    guard: bool = False
    seq_align: int = 128  # slot counts are rounded up to a multiple of this
    # sampled requests: draft with the noise of the target's own draws, coupling each draft to the token the
    # target will draw (`FastCore.choose_drafts`); False: the drafter's top-k, as for greedy requests
    coupled_drafts: bool = True
    # CUDA: pad every decoding forward to `STEP_ROWS` tokens so that each product runs one kernel whatever the
    # forward holds (`FastTarget.step_rows`): greedy trees of up to 63 nodes then keep plain decoding's bits by
    # construction, not only where the vendor's kernels happen to agree. A shared target takes the last choice.
    batch_invariant: bool = False


PREFILL_MIN_WIDTH = 16  # the narrowest fixed prefill (`FastOptions.graph_prefill`)


def graph_prefill_by_default(device: torch.device | str) -> bool:
    """`FastOptions.graph_prefill`'s default: on CUDA, where the prefill's graphs replay instead of launching each
    kernel; not on a CPU, where the padding to a power of two costs compute and there are no launches to save
    (the auto of every auto/on/off option)."""
    return on_for_device("auto", device)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def prefill_width(prompt_len: int, seq_len: int) -> int | None:
    """The fixed width a prompt's prefill runs at with `graph_prefill`: the next power of two, at least
    PREFILL_MIN_WIDTH; None where that exceeds the cache (that prompt prefills eagerly at its own length)."""
    w = max(PREFILL_MIN_WIDTH, 1 << (max(1, prompt_len) - 1).bit_length())
    return w if w <= seq_len else None


class FastEngine:
    """Batch-1 speculative decoding on `eagle3.fast` (static caches, fixed shapes, CUDA graphs)."""

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
        """`target`: a `FastTarget` to share with other engines (one copy of the fused weights and caches);
        it must carry the drafter's aux layer ids when `draft` is 'eagle3'."""
        self.model, self.tokenizer = model, tokenizer
        self.options = options or FastOptions()
        self.spec = spec or DraftShape()  # the draft shape
        self.proposer: Proposer | None = None
        if isinstance(draft, Proposer):
            if not max_nodes:
                raise ConfigError("a host-side proposer needs max_nodes (the most draft nodes it proposes)")
            self.proposer, mode, self.draft = draft, "host", draft.name
        elif draft == "none":
            mode, self.draft = "none", "none"
        elif draft == "ngram":
            k = self.spec.depth
            self.proposer, mode, self.draft, max_nodes = NgramProposer(length=k), "host", "ngram", k
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
        fd = FastDrafter(drafter) if mode == "eagle3" else None
        if fd is not None:  # "matmul" | "split" | "prefix"
            self.drafter_attention = fd.use_attention(self.options.drafter_attention)
        else:
            self.drafter_attention = drafter_attention_for(self.options.drafter_attention, self.target.device)
        if mode == "eagle3":
            self.core = FastCore(self.target, "eagle3", fd, self.spec)
        elif mode == "host":
            self.core = FastCore(self.target, "host", max_nodes=int(max_nodes))
        else:
            self.core = FastCore(self.target, "none")
        if self.options.graph_prefill is None:
            self.options = replace(self.options, graph_prefill=graph_prefill_by_default(self.target.device))
        o = self.options
        cd = FastCore.drafting_compiled_by_default(self.target.device) if o.compile_drafting is None \
            else o.compile_drafting
        if cd and mode != "none":
            self.core.compile_drafting(o.compile_backend)
        self.core.coupled = o.coupled_drafts
        if o.chain_stop is not None:
            if mode != "eagle3" or not self.spec.is_chain:
                raise ConfigError("chain_stop (--chain-stop) is for EAGLE-3 chains")
            if not 0.0 < o.chain_stop < 1.0:
                raise ConfigError(f"chain_stop {o.chain_stop}: expected a probability between 0 and 1")
            if not self.eager:
                raise ConfigError("chain_stop (--chain-stop) needs cycles that run eagerly, where the host can "
                                  "read each draft step: a CPU, or CUDA with graphs and compilation off")
            self.core.chain_stop = o.chain_stop
        if o.guard and mode != "eagle3":
            raise ConfigError("the speculation guard is for EAGLE-3 drafting (--draft eagle3)")
        self.mode = mode
        self.device = self.target.device
        self.guards = EngineGuards(SpeculationGuard)  # what the guard learned, kept from request to request
        self._pool = None
        self._alloc: tuple[int, int] | None = None  # cache allocation the runners were captured against
        self._runners: dict[str, StepRunner] = {}

    # -- setup ---------------------------------------------------------------------------------
    @property
    def eager(self) -> bool:
        """Whether cycles run eagerly (no graph, nothing compiled), so the host can act between draft steps."""
        o = self.options
        return not ((o.graphs and self.target.device.type == "cuda") or self.core.drafting_compiled)

    @property
    def seq_len(self) -> int:
        return self.core.seq_len

    def reserve(self, prompt_len: int, max_new_tokens: int) -> None:
        """Make the caches big enough for a request; (re)allocating drops captured graphs."""
        need = self.core.slots_needed(prompt_len, max_new_tokens)
        if need <= self.seq_len and self._alloc == self.core.alloc_ids():
            return
        size = _round_up(max(need, self.options.max_seq_len, self.seq_len), self.options.seq_align)
        if self._alloc is not None:
            log.info("fast path: caches resized or shared target reallocated (%d slots); capturing again", size)
        self._runners.clear()
        self.core.allocate(size)
        if self.options.graph_prefill:
            self.core.allocate_prefill()
        self._alloc = self.core.alloc_ids()
        self._pool = graph_pool(self.device)

    def _runner(self, name: str) -> StepRunner:
        if name not in self._runners:
            kind, _, arg = name.partition("_")  # "prefill_64": `prefill_fixed(64)`; "cycle_1": `cycle(1)`
            fn = {"cycle": lambda: self.core.cycle(int(arg)),
                  "plain": lambda: self.core.plain_verify(int(arg)),
                  "prefill": lambda: self.core.prefill_fixed(int(arg)),
                  "begin": lambda: self.core.begin_fixed(int(arg))}[kind]
            r = StepRunner(fn, self.device, graphs=self.options.graphs, pool=self._pool, name=name)
            r.prepare()
            self.core.reset()
            self._runners[name] = r
        return self._runners[name]

    @torch.no_grad()
    def prepare(self, prompt_len: int, max_new_tokens: int, mode: int | tuple[int, ...] = GREEDY) -> float:
        """Allocate and capture everything a request of this size and sampling mode (`sampling_mode`; several:
        each of them) needs; returns the seconds it took."""
        t0 = time.perf_counter()
        self.reserve(prompt_len, max_new_tokens)
        for m in (mode,) if isinstance(mode, int) else mode:
            self._runner(f"cycle_{m}")
            if self.options.guard:
                self._runner(f"plain_{m}")
        if self.options.graph_prefill:  # every width that fits and a prompt of up to prompt_len tokens can need
            w = PREFILL_MIN_WIDTH
            while w <= self.seq_len and (w == PREFILL_MIN_WIDTH or w // 2 < prompt_len):
                self._prefill_runners(w)
                w *= 2
        return time.perf_counter() - t0

    def _prefill_runners(self, width: int) -> tuple[StepRunner, StepRunner]:
        return self._runner(f"prefill_{width}"), self._runner(f"begin_{width}")

    @property
    def graphed(self) -> bool:
        """Whether every prepared step replays a CUDA graph (False on CPU, with --no-graphs, or after a
        capture failure)."""
        return bool(self._runners) and all(r.graph is not None for r in self._runners.values())

    def settings(self) -> dict:
        """What this engine runs with, resolved for its device (for run records: `eagle3 eval`)."""
        o = self.options
        return {"engine": "fast", "graphs": o.graphs and self.device.type == "cuda",
                "pointwise_compiled": sorted(self.target.pointwise.fused), "graph_prefill": o.graph_prefill,
                "drafting_compiled": self.core.drafting_compiled, "drafter_attention": self.drafter_attention,
                "target_attention": self.target_attention, "norms_folded": self.target.folded,
                "batch_invariant": self.target.step_rows > 0,
                "chain_stop": self.core.chain_stop, "guard": o.guard, "coupled_drafts": o.coupled_drafts}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- generate ------------------------------------------------------------------------------
    def _first_token(self, logits: torch.Tensor, req: Request) -> torch.Tensor:
        """The first new token [1] from the prefill's logits [V]: the token at position T of a T-token prompt."""
        last = req.prompt.numel() - 1  # the RoPE position of the prompt's last token
        return self.core.choose(logits[None], torch.tensor([last], device=self.device), self._mode(req))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sampling: SamplingConfig | None = None,
        eos_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        req = Request.check(prompt_ids, max_new_tokens, sampling, eos_token_ids, stop_strings, on_text,
                            self.tokenizer)
        eos, stream, prompt = req.eos, req.stream, req.prompt
        mode = self._mode(req)
        self.prepare(prompt.numel(), max_new_tokens, mode)
        self.core.sampling.set(0, [replace(req.sampling, seed=req.seed)])
        stats = GenerationStats()
        t0 = time.perf_counter()

        core = self.core
        dev_prompt = prompt.to(self.device)
        width = prefill_width(prompt.numel(), self.seq_len) if self.options.graph_prefill else None
        if width is not None:  # fixed shapes: replayed graphs on CUDA
            run_prefill, run_begin = self._prefill_runners(width)
            core.pre_ids[: prompt.numel()].copy_(dev_prompt)
            core.pre_len.fill_(prompt.numel())
            run_prefill()
            core.pre_first.copy_(self._first_token(core.pre_logits, req))
            run_begin()
            core.backlog_n = 0  # the replayed begin cleared the device's backlog, not the host's count
            first_t = core.pre_first
        else:
            with varying_shape_attention(self.device):  # the prompt length is new per request; cycles are fixed
                logits, aux = core.prefill(dev_prompt)  # [V], [T, 3·Ht]
                first_t = self._first_token(logits, req)
                core.begin(dev_prompt, aux, first_t)
        out = [int(first_t)]
        finish = SpeculativeEngine._finished(out, eos, max_new_tokens, stream, stop_strings)
        if self.proposer is not None:
            self.proposer.begin(prompt, None, out[0])
        self._sync()
        stats.prefill_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        if finish is None:
            cycle = self._runner(f"cycle_{mode}")
            if self.mode == "host":
                finish = self._loop_host(cycle, out, stats, eos, max_new_tokens, stream, stop_strings)
            else:
                guard = self.guards.for_request(mode != GREEDY) if self.options.guard else None
                finish = self._loop_device(cycle, mode, out, stats, eos, max_new_tokens, stream, stop_strings, guard)
        self._sync()
        stats.verify_s = time.perf_counter() - t1  # cycles are fused: drafting time is inside verify_s

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

    def _loop_device(self, cycle, mode, out, stats, eos, max_new_tokens, stream, stop_strings,
                     guard: SpeculationGuard | None = None) -> str:
        """Drafting on device: one graph and one packet read per cycle, pipelined on CUDA (cycle i+1 is launched
        before cycle i's packet is read). Under a `guard` each step drafts, or is a plain step (its own graph), as
        the guard says, timed from one packet to the next; its decisions then trail its measurements by a step."""
        core = self.core
        plain = self._runner(f"plain_{mode}") if guard is not None else None
        cuda = self.device.type == "cuda"
        pipeline = cuda and self.options.pipeline
        bufs = [torch.empty(core.packet.shape, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        drafted = [True, True]

        def launch(i: int) -> None:
            drafted[i % 2] = guard is None or guard.drafting()
            if drafted[i % 2]:
                if guard is not None:
                    core.feed_backlog()
                cycle()
            else:
                core.plain_step(mode, plain)
            bufs[i % 2].copy_(core.packet, non_blocking=cuda)
            if cuda:
                events[i % 2].record(torch.cuda.current_stream(self.device))  # this GPU's, current or not

        t = time.perf_counter()
        launch(0)
        i = 0
        while True:
            if pipeline:
                launch(i + 1)
            if cuda:
                events[i % 2].synchronize()
            pkt = bufs[i % 2].tolist()  # [n_acc, drafted depth, emitted...]
            n_acc, drafting = pkt[0], drafted[i % 2]
            if guard is not None:
                now = time.perf_counter()
                guard.record(drafting, now - t, n_acc + 1)
                t = now
            stats.cycles += 1
            stats.plain_steps += not drafting
            stats.accepted_per_cycle.append(n_acc)
            stats.drafted_depth_per_cycle.append(pkt[1])
            if drafting:  # a stopped chain drafts its depth
                stats.drafted_tokens += core.n_nodes if core.chain_stop is None else pkt[1]
            finish = self._emit(out, pkt[2 : 3 + n_acc], eos, max_new_tokens, stream, stop_strings)
            if finish is not None:
                return finish
            if not pipeline:
                launch(i + 1)
            i += 1

    def _loop_host(self, cycle, out, stats, eos, max_new_tokens, stream, stop_strings) -> str:
        """A host proposer: write its tree, run the cycle graph, read the packet."""
        core = self.core
        while True:
            tree = self.proposer.propose()
            tree.validate()
            core.load_tree(tree.tokens.tolist(), tree.parents.tolist())
            cycle()
            pkt = core.packet.tolist()
            n_acc = pkt[0]
            stats.cycles += 1
            stats.accepted_per_cycle.append(n_acc)
            stats.drafted_depth_per_cycle.append(pkt[1])
            stats.drafted_tokens += tree.n
            new = pkt[2 : 3 + n_acc]
            finish = self._emit(out, new, eos, max_new_tokens, stream, stop_strings)
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
