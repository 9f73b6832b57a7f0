"""The speculative cycle on the fast path: B rows, each with its own static KV cache, plain or speculative.

Every fast decoding runs here: the server's batch (`eagle3.serving.scheduler`) and `FastEngine`, which decodes
one request as one row (`generate`, `eval`, `bench`, `demo`). Row b's token at position p
lives in slot p of row b's cache (`[L, B, n_kv, S, hd]`), so rows of any lengths decode together without padding
or cross-row masks. Where the split-KV kernel runs (CUDA), every decoding forward attends by position
(`eagle3.fast.split_attention.Paths` with a row axis). One cycle of the first `nb` rows (a batch-size bucket) is a
fixed-shape function of device buffers, replayed as a CUDA graph:

    spec cycle   draft a tree per row (EAGLE-2 expansion, `eagle3.decoding.expand`; or a tree the host wrote with
                 `load_tree`, for host proposers), verify [nb, N+1], accept per row, move each row's accepted K/V
                 next to its prefix, feed the drafter, advance.
    plain cycle  one token per row; with a drafter, each row's features and new token are held back (up to
                 `feed_window`) and fed to the drafter in one batched step before the next speculative cycle.

State per row: length [B] (committed tokens), root [B] (last emitted token, not yet cached), last_out [B, H]
(drafter output of the newest committed row), held_n [B] (tokens held back for the drafter, their features
held_aux [B, W, 3·Ht] and next tokens held_tok [B, W]). The host reads packet [nb, D+3] = [n_acc, drafted depth,
emitted...] once per cycle: `cycle` is `launch` then `collect`, and a caller may launch the next cycle before it
collects this one's packet (on CUDA the GPU then never waits for the host).

Admission (`add_many`) prefills R prompts right-padded to T tokens in a staging cache rounded up to a prefill
bucket (R to a batch bucket, T to a power of two), each bucket a captured graph (eagerly at the prompts' own
width where prefills are not captured), and copies the result into the rows' caches. Rows [n, nb) of a captured bucket are idle (their lengths clamped inside the cache); eager cycles (a
CPU) run the active rows only, over the cache slots they can reach. A row that leaves is replaced by the last one. Sampled rows carry their own settings (`add_many(..., sampling=)`): their tokens are the
position-keyed draws of `eagle3.decoding.sampling` (the same text as anywhere else), drafted coupled to those draws
(`eagle3.decoding.expand.coupled_top_k`), in cycles captured per sampling mode.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from eagle3.attention import varying_shape_attention
from eagle3.config import FEED_WINDOW, ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.grammar import ALL, Grammar, bitmask_words, next_masks
from eagle3.decoding.sampling import GREEDY, MODES, SamplingRows, sampling_mode
from eagle3.drafter import Eagle3Drafter
from eagle3.fast import split_attention as split
from eagle3.fast.drafter import FastDrafter, draft_top_k_op_for, ranked_top_k
from eagle3.fast.graphs import CompiledPieces, StepRunner, graph_pool
from eagle3.fast.row_grammar import GrammarSteps
from eagle3.fast.row_steps import RowSteps
from eagle3.fast.rows_prefill import MIN_PREFILL_WIDTH, Prefill, prefill_buckets, prefill_key, prefill_step
from eagle3.fast.target import FastTarget

__all__ = ["FastRows"]

# The speculative cycle's pieces that never run the target's weights (`FastRows.compile_drafting`)
DRAFTING_PIECES = ("_draft", "_tree_inputs", "_accept", "_feed_rows")


def cycle_margin(shapes: list[DraftShape]) -> int:
    """Cache slots a cycle of these draft shapes may write beyond a row's length."""
    return max([s.total for s in shapes] + [0]) + max([s.depth for s in shapes] + [0]) + 2


def drafts_by_position(target: FastTarget, drafter: FastDrafter | None) -> bool:
    """Whether the rows' drafter attends by position (the split kernels), as the target's forwards do."""
    return drafter is not None and target.attention == "split" and split.supports(drafter.hd, 1)


class FastRows(RowSteps, GrammarSteps):
    """Up to `capacity` rows over per-row static caches of `seq_len` slots; see the module docstring.

    `shapes(bucket)` is the draft shape of that bucket's speculative cycle (None: plain only). `host_nodes` > 0
    (no drafter): speculative cycles verify trees of up to that many nodes that the host writes with `load_tree`.
    `add` prefills a row and returns its first token; `cycle(spec)` runs one cycle of all active rows and
    returns each row's new tokens; `remove(i)` frees row i (the last row takes its place).
    """

    def __init__(self, target: FastTarget, drafter: Eagle3Drafter | FastDrafter | None, capacity: int, seq_len: int,
                 shapes: Callable[[int], DraftShape | None] | None = None, graphs: bool = True,
                 prefill_tokens: int = 8192, sampling: bool = True, feed_window: int = FEED_WINDOW,
                 fused_sampling: bool | None = None, compile_drafting: bool = False,
                 chain_stop: float | None = None, host_nodes: int = 0, coupled: bool = True,
                 prefill_graphs: bool | None = None):
        if capacity < 1 or seq_len < 8:
            raise ConfigError(f"FastRows needs capacity >= 1 and seq_len >= 8 (got {capacity}, {seq_len})")
        if feed_window < 0:
            raise ConfigError(f"feed_window={feed_window} must be >= 0 (0: feed the drafter in every plain cycle)")
        if host_nodes and drafter is not None:
            raise ConfigError("host trees (host_nodes) and an EAGLE-3 drafter exclude each other")
        self.d = drafter if isinstance(drafter, FastDrafter) or drafter is None else FastDrafter(drafter)
        if self.d is not None and target.aux_layer_ids != sorted(self.d.config.aux_layer_ids):
            raise ConfigError(f"the FastTarget taps layers {target.aux_layer_ids}; the drafter needs "
                              f"{sorted(self.d.config.aux_layer_ids)}")
        self.t, self.capacity, self.seq_len = target, capacity, seq_len
        self.host_nodes = host_nodes
        self.buckets = [1 << i for i in range((capacity - 1).bit_length())] + [capacity]  # one graph each
        if host_nodes:  # a host tree of N nodes may be as deep as a chain of N
            shapes = lambda _b: DraftShape.chain(host_nodes)  # noqa: E731
        drafts = self.d is not None or host_nodes
        self.shapes = {b: (shapes(b) if drafts and shapes is not None else None) for b in self.buckets}
        d_max = max([s.depth for s in self.shapes.values() if s] + [0])
        n_max = max([s.total for s in self.shapes.values() if s] + [0])
        scratch = max([s.scratch for s in self.shapes.values() if s] + [0])
        self.margin = cycle_margin([s for s in self.shapes.values() if s])  # slots beyond a row's length
        dev, dt, t = target.device, target.dtype, target
        self.device = dev
        self.rope = t.rope_table(seq_len)
        shape = (t.num_layers, capacity, t.nkv, seq_len, t.hd)
        self.kv = torch.zeros((2, *shape), dtype=dt, device=dev)  # [2, L, B, nkv, S, hd]: one buffer, so that
        self.k, self.v = self.kv[0], self.kv[1]  # a commit moves K and V of every layer in one gather and write
        # [B, nkv]: where row b's head h starts in a layer's cache flattened to slots (`_commit`)
        self.head_base = (torch.arange(capacity * t.nkv, device=dev) * seq_len).view(capacity, t.nkv)
        self.ar_s = torch.arange(seq_len, device=dev)
        self.ar = torch.arange(max(n_max, d_max, 1) + 2, device=dev)
        self.length = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.root = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.packet = torch.zeros(capacity, d_max + 3, dtype=torch.long, device=dev)
        if host_nodes:  # `load_tree`'s trees: tokens [B, N], parents [B, N+1] (N+1 indexing), valid [B, N]
            self.tree_tokens = torch.zeros(capacity, host_nodes, dtype=torch.long, device=dev)
            self.tree_parents1 = torch.zeros(capacity, host_nodes + 1, dtype=torch.long, device=dev)
            self.tree_valid = torch.zeros(capacity, host_nodes, dtype=torch.bool, device=dev)
        self.sampling = sampling  # sampled rows allowed: their cycles are captured too
        # sampled draws compiled into one kernel (None: on CUDA, where the cycles are graphs; the noise is ~30 eager
        # passes over [rows, positions, V] otherwise; eagle3.decoding.sampling)
        self.fused_sampling = dev.type == "cuda" if fused_sampling is None else fused_sampling
        self.row_sampling = SamplingRows(capacity, target.vocab_size, dev)
        # sampled rows draft with the noise of their own draws (`coupled_top_k`); False: the drafter's top-k
        self.coupled = coupled
        self._modes: list[int] = []  # host mirror: how active row i chooses its tokens
        # rows that follow a grammar (`eagle3.fast.row_grammar`): `_choose` takes the tokens `allowed` (bool
        # [nb, M, V]) where set, eager drafting the drafter's in `constrain`; the pieces' inputs and output
        self.grammars: list[Grammar | None] = []
        self.allowed: torch.Tensor | None = None
        self.constrain = None
        words = bitmask_words(target.vocab_size)
        self.mask_words = torch.full((capacity, words), ALL, dtype=torch.int32, device=dev)  # [B, W]
        # captured drafting's masks, one level per expansion step (`forced_path_masks`) [B, D, W]
        self.draft_words = torch.full((capacity, max(d_max, 1), words), ALL, dtype=torch.int32, device=dev)
        self.walk_in = torch.zeros(2, capacity, dtype=torch.long, device=dev)  # [2, B] node, walking
        self.walk_out = torch.zeros(capacity, dtype=torch.long, device=dev)  # [B] the choice there
        self._fronts: dict = {}  # (bucket, mode) -> its `Front`
        if self.d is not None:
            fd = self.d
            self.sd = seq_len + scratch + d_max + 2
            self.d_rope = fd.rope_table(self.sd)
            self.dk = torch.zeros(capacity, fd.nkv, self.sd, fd.hd, dtype=fd.dtype, device=dev)
            self.dv = torch.zeros_like(self.dk)
            self.ar_sd = torch.arange(self.sd, device=dev)
            self.last_out = torch.zeros(capacity, fd.hidden_size, dtype=fd.dtype, device=dev)
        self.feed_window = feed_window if self.d is not None else 0
        if self.feed_window:
            w = self.feed_window
            width = len(target.aux_layer_ids) * target.hidden_size
            self.held_aux = torch.zeros(capacity, w, width, dtype=dt, device=dev)  # [B, W, 3·Ht]
            self.held_tok = torch.zeros(capacity, w, dtype=torch.long, device=dev)  # [B, W]
            self.held_n = torch.zeros(capacity, dtype=torch.long, device=dev)  # [B]
            self.ar_w = torch.arange(w, device=dev)
        self._held: list[int] = []  # host mirror of held_n for the active rows
        # per row, of the last cycle collected: depth and draft tokens drafted (0: did not draft)
        self.depths: list[int] = []
        self._nodes = 0  # draft nodes of the last speculative cycle run
        self.drafted: list[int] = []
        self.n = 0  # active rows: [0, n)
        self._lens: list[int] = []  # host mirror of length for the active rows
        self.cycles = self.spec_cycles = self.feeds = 0  # cycles run (all, speculative), feed steps run
        self.graphs = graphs and dev.type == "cuda"
        # admission in fixed buckets, each a captured step (None: where cycles are graphs); else at each width
        self.prefill_graphs = self.graphs if prefill_graphs is None else prefill_graphs
        # Chains stop drafting once every row's joint draft probability is below this: the host reads each draft
        # step's scores, so only where cycles run eagerly
        if chain_stop is not None and (self.graphs or compile_drafting):
            raise ConfigError("chain_stop needs cycles that run eagerly (a CPU, or graphs and compilation off)")
        self.chain_stop = chain_stop
        self._set_span()  # span, d_span: the cache slots the next cycle attends over
        self._pool = graph_pool(dev)
        self._runners: dict[tuple, StepRunner] = {}  # (bucket, spec, mode), or a grammar piece's key
        self._feeds: dict[int, StepRunner] = {}  # bucket -> its feed step
        self._launched: deque[tuple[torch.Tensor, torch.cuda.Event | None, int]] = deque()  # `collect`
        self._packets = [torch.empty(self.packet.shape, dtype=torch.long, pin_memory=dev.type == "cuda")
                         for _ in range(2)]  # host copies of two cycles' packets
        # prefill buckets (R, T) of at most `prefill_tokens` padded tokens share flat staging buffers
        self.prefill_tokens = prefill_tokens
        self.flat_staging: dict[str, torch.Tensor] = {}
        self._prefills: dict[tuple[int, int], Prefill] = {}
        self.pieces = CompiledPieces(self)
        self.ranked = False  # top-k by ranking inside compiled drafting (`ranked_top_k`)
        # greedy drafting's log-softmax and top-k as Triton kernels where they run (CUDA)
        self._top_k_ops = {s.top_k: draft_top_k_op_for(self.d, s.top_k) for s in self.shapes.values() if s}
        if drafts_by_position(target, self.d):
            self.d.use_paths_attention()
        if compile_drafting and (self.d is not None or host_nodes):
            self.compile_drafting()

    def compile_drafting(self, backend: str | Callable = "inductor") -> None:
        """Compile the cycle's pieces that do not run the target (`DRAFTING_PIECES`) with inductor from now on, one
        variant per bucket and sampling mode (they compile on first use: call before cycles are captured). A piece
        that fails to compile logs a warning and runs eagerly (`CompiledPieces`). Emitted tokens are unchanged:
        the target's arithmetic is untouched, acceptance is integer logic, and the drafter only decides what is
        proposed."""
        if self._runners:
            raise RuntimeError("compile_drafting() must come before cycles are captured")
        names = [n for n in DRAFTING_PIECES if self.d is not None or n in ("_tree_inputs", "_accept")]
        self.pieces.compile(names, backend)
        self.ranked = ranked_top_k(self.device)

    @property
    def drafting_compiled(self) -> bool:
        return bool(self.pieces)

    # -- host side ---------------------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def fits(self, context: int, max_new_tokens: int) -> bool:
        """Whether a request of this many prompt and new tokens fits a row's cache."""
        return context + max_new_tokens + self.margin <= self.seq_len

    @torch.no_grad()
    def prepare(self, modes: Sequence[int] | None = None, spec: bool = True, plain: bool = True,
                max_prompt: int | None = None) -> float:
        """Capture cycles before rows exist (warm-up runs real cycles on the buffers): for every bucket and each
        of `modes` (None: every mode these rows take), the speculative cycle where a shape is set and `spec`, the
        plain cycle where `plain` (and the drafter's feed step), and the prefill buckets for prompts of up to
        `max_prompt` tokens (None: all). Already captured ones are kept. Returns the seconds it took."""
        if self.n:
            raise RuntimeError("prepare() runs real cycles: call it before adding rows")
        t0 = time.perf_counter()
        for mode in modes if modes is not None else MODES if self.sampling else (GREEDY,):
            for b in self.buckets:
                if plain:
                    self._runner(b, False, mode)
                if spec and self.shapes[b] is not None:
                    self._runner(b, True, mode)
        if self.feed_window and plain:
            for b in self.buckets:
                self._feed_runner(b)
        if self.prefill_graphs:
            for r, t in prefill_buckets(self):
                if max_prompt is None or t // 2 < max(max_prompt, 1) or t == MIN_PREFILL_WIDTH:
                    self._prefill_slot(r, t)
        self._reset_rows(0, self.capacity)
        return time.perf_counter() - t0

    @property
    def cycles_prepared(self) -> int:
        return len(self._runners) + len(self._feeds)

    def _prefill_slot(self, r: int, t: int) -> Prefill:
        p = self._prefills.get((r, t))
        if p is None:
            p = Prefill(self, r, t)
            p.runner = StepRunner(lambda: prefill_step(self, p), self.device, graphs=self.graphs, pool=self._pool,
                                  name=f"rows_prefill_r{r}_t{t}")
            p.runner.prepare()
            self._prefills[(r, t)] = p
        return p

    def _runner(self, nb: int, spec: bool, mode: int) -> StepRunner:
        key = (nb, spec, mode)
        if key not in self._runners:
            if mode != GREEDY and not self.sampling:
                raise ValueError("these FastRows were built with sampling=False")
            fn = (lambda: self._spec_cycle(nb, mode)) if spec else (lambda: self._plain_cycle(nb, mode))
            r = StepRunner(fn, self.device, graphs=self.graphs, pool=self._pool,
                           name=f"rows_{'spec' if spec else 'plain'}_b{nb}_m{mode}")
            r.prepare()
            self._runners[key] = r
        return self._runners[key]

    def _feed_runner(self, nb: int) -> StepRunner:
        if nb not in self._feeds:
            r = StepRunner(lambda: self._feed_held(nb), self.device, graphs=self.graphs, pool=self._pool,
                           name=f"rows_feed_b{nb}")
            r.prepare()
            self._feeds[nb] = r
        return self._feeds[nb]

    @torch.no_grad()
    def add(self, prompt: list[int], root: int | None = None, sampling: SamplingConfig | None = None,
            grammar: Grammar | None = None) -> int:
        """Prefill `prompt` into a new row (index `n` before the call); returns the row's first new token
        (`root` when given: a request moving in from elsewhere, whose next token is already known). `sampling`
        with a temperature > 0 (and a seed) makes the row sample; None is greedy. `grammar` (fresh, nothing
        consumed) constrains every token the row emits."""
        return self.add_many([prompt], [root], [sampling], [grammar])[0]

    @torch.no_grad()
    def add_many(self, prompts: list[list[int]], roots: list[int | None] | None = None,
                 sampling: list[SamplingConfig | None] | None = None,
                 grammars: list[Grammar | None] | None = None) -> list[int]:
        """Prefill several prompts into new rows n, n+1, ... in one right-padded forward (and one drafter
        forward); returns their first new tokens (see `add`). Padding writes K/V past each prompt, into slots a
        row's length never covers before they are overwritten, and the causal mask keeps real tokens from it."""
        r, i = len(prompts), self.n
        roots = roots or [None] * r
        sampling = sampling or [None] * r
        grammars = grammars or [None] * r
        constrained = any(g is not None for g in grammars)
        modes = [GREEDY if s is None else sampling_mode(s.temperature, s.top_p, s.top_k) for s in sampling]
        if any(modes) and not self.sampling:
            raise ConfigError("these FastRows were built with sampling=False; sampled requests need sampling=True")
        for g in grammars:
            if g is not None and g.words != self.mask_words.shape[1]:
                raise ConfigError(f"the grammar masks {g.words * 32} token ids; the target has {self.t.vocab_size}")
        for s, mode in zip(sampling, modes, strict=True):
            if mode != GREEDY and s.seed is None:
                raise ConfigError("a sampled row needs a seed (its draws are keyed by seed and position)")
        if i + r > self.capacity:
            raise RuntimeError(f"{r} more rows do not fit: {i} of {self.capacity} are in use")
        for p in prompts:
            if not p or not self.fits(len(p), 1):
                raise ConfigError(f"a {len(p)}-token context does not fit {self.seq_len} cache slots")
        width = max(len(p) for p in prompts)
        key = prefill_key(self, r, width) if self.prefill_graphs else None
        p = self._prefill_slot(*key) if key is not None else Prefill(self, r, width, shared=False)  # eager
        ids = torch.zeros(p.r, p.t, dtype=torch.long)
        lens = torch.ones(p.r, dtype=torch.long)
        root = torch.zeros(p.r, dtype=torch.long)
        for j, (prompt, x) in enumerate(zip(prompts, roots, strict=True)):
            ids[j, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            lens[j] = len(prompt)
            root[j] = -1 if x is None else x
        p.ids.copy_(ids)
        p.lens.copy_(lens)
        p.root.copy_(root.clamp(min=0))
        p.has_root.copy_(root >= 0)
        if self.sampling:
            p.sampling.set(0, [*sampling, *[None] * (p.r - r)])
        if constrained or p.masked:  # the first tokens under each grammar's first mask
            p.mask_words.copy_(next_masks(grammars, p.r, p.mask_words.shape[1]))
            p.masked = constrained
        if p.runner is not None:
            p.runner()
        else:
            with varying_shape_attention(self.device):  # a new width per admission
                prefill_step(self, p, max(modes))
        t = p.t  # padding K/V lands in slots a row's length never covers before they are overwritten
        self.k[:, i : i + r, :, :t].copy_(p.k[:, :r])
        self.v[:, i : i + r, :, :t].copy_(p.v[:, :r])
        if self.d is not None:
            self.dk[i : i + r, :, :t].copy_(p.dk[:r])
            self.dv[i : i + r, :, :t].copy_(p.dv[:r])
            self.last_out[i : i + r].copy_(p.last_out[:r])
        if self.feed_window:
            self.held_n[i : i + r] = 0  # the prefill fed the drafter up to each prompt's last token
        self._held += [0] * r
        self.root[i : i + r] = p.first[:r]
        self.length[i : i + r] = p.lens[:r]
        self._lens += [len(x) for x in prompts]
        self.row_sampling.set(i, sampling)
        self._modes += modes
        self.n += r
        firsts = p.first[:r].tolist()
        for g, x in zip(grammars, firsts, strict=True):
            if g is not None:
                g.consume([x])
        self.grammars += grammars
        return firsts

    @torch.no_grad()
    def remove(self, i: int) -> None:
        """Free row i; the last active row moves into it (callers mirror that move in their own row lists)."""
        last = self.n - 1
        if not 0 <= i <= last:
            raise IndexError(f"row {i} is not active (rows 0..{last})")
        if i != last:
            self.kv[:, :, i].copy_(self.kv[:, :, last])
            for state in self._row_state():
                state[i].copy_(state[last])
            self.row_sampling.move(i, last)
            self._modes[i] = self._modes[last]
            self.grammars[i] = self.grammars[last]
            self._held[i] = self._held[last]
            self._lens[i] = self._lens[last]
        self._modes.pop()
        self.grammars.pop()
        self._held.pop()
        self._lens.pop()
        self._reset_rows(last, last + 1)
        self.n -= 1

    def clear(self) -> None:
        """Free every row; cycles still in flight are dropped (their work is discarded)."""
        for _, event, _ in self._launched:
            if event is not None:
                event.synchronize()
        self._launched.clear()
        self._reset_rows(0, self.capacity)
        self._modes, self._held, self._lens, self.n = [], [], [], 0
        self.grammars = []

    @property
    def drafting(self) -> int:
        """Rows that draft in a speculative cycle."""
        return self.n if self.d is not None else 0

    def _row_state(self) -> list[torch.Tensor]:
        """The per-row state besides the target's caches, row axis first."""
        held = [self.held_aux, self.held_tok, self.held_n] if self.feed_window else []
        return [self.root, self.length, *([self.dk, self.dv, self.last_out] if self.d is not None else []), *held]

    def _reset_rows(self, lo: int, hi: int) -> None:
        self.length[lo:hi] = 0
        self.root[lo:hi] = 0
        if self.d is not None:
            self.last_out[lo:hi] = 0
        if self.feed_window:
            self.held_n[lo:hi] = 0

    @property
    def mode(self) -> int:
        """The cycle variant the active rows need: GREEDY, TEMPERATURE or FILTERED (the largest of theirs)."""
        return max(self._modes, default=GREEDY)

    @property
    def sampled(self) -> bool:
        """Whether a row samples (the speed gate measures such cycles apart)."""
        return self.mode != GREEDY

    @torch.no_grad()
    def cycle(self, spec: bool) -> list[list[int]]:
        """One cycle of the active rows; returns each row's new tokens (accepted drafts, then the target's
        next token). `spec` needs a draft shape for the current bucket."""
        self.launch(spec)
        return self.collect()

    @torch.no_grad()
    def launch(self, spec: bool) -> None:
        """Start one cycle of the active rows (see `cycle`); its packet is read by the next `collect`. At most two
        cycles may be in flight. Eager cycles attend over what `collect` last saw: collect before launching."""
        if self.n == 0:
            raise RuntimeError("no active rows")
        if len(self._launched) == 2:
            raise RuntimeError("two cycles are in flight: collect one first")
        nb = self.bucket(self.n) if self.graphs else self.n  # eager cycles run the active rows only
        if spec and self.shape_of(nb) is None:
            raise ValueError(f"bucket {self.bucket(nb)} has no draft shape")
        self._set_span()
        if spec and max(self._held):  # the drafter catches up before it drafts
            self._feed(nb)
        constrained = any(g is not None for g in self.grammars)
        if constrained:
            self._constrained_cycle(nb, spec, self.mode)
        else:
            self._runner(nb, spec, self.mode)()
        self.cycles += 1
        self.spec_cycles += spec
        if not spec and self.feed_window:
            self._held = [h + 1 for h in self._held]
            if max(self._held) >= self.feed_window:  # a full window: feed before the next plain cycle
                self._feed(nb)
        buf = self._packets[self.cycles % 2]
        cuda = self.device.type == "cuda"
        buf.copy_(self.packet, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._launched.append((buf, event, self._nodes if spec else 0))
        if constrained and not spec:  # the next cycle's masks follow this token (a speculative cycle's walk
            self._follow()  # consumed its tokens)

    def collect(self) -> list[list[int]]:
        """The new tokens of the oldest cycle in flight, per row (the one host sync per cycle)."""
        buf, event, nodes = self._launched.popleft()
        if event is not None:
            event.synchronize()
        pkt = buf[: self.n].tolist()
        self._lens = [n + p[0] + 1 for n, p in zip(self._lens, pkt, strict=True)]
        self.depths = [p[1] for p in pkt]
        self.drafted = [nodes] * self.n
        return [p[2 : 3 + p[0]] for p in pkt]

    @torch.no_grad()
    def load_tree(self, i: int, tokens: list[int], parents: list[int]) -> None:
        """Row i's tree for the next speculative cycle (host proposers, `host_nodes`): tokens, and parents (-1: the
        root, else an earlier node), padded to `host_nodes` invalid children of the root."""
        n, m = self.host_nodes, len(tokens)
        if m > n:
            raise ValueError(f"the proposer drafted {m} nodes; these rows verify at most {n}")
        pad = n - m
        host = torch.tensor([*tokens, *[0] * pad, 0, *[p + 1 for p in parents], *[0] * pad, *[1] * m, *[0] * pad],
                            dtype=torch.long).to(self.device)
        self.tree_tokens[i].copy_(host[:n])
        self.tree_parents1[i].copy_(host[n : 2 * n + 1])
        self.tree_valid[i].copy_(host[2 * n + 1 :].bool())

    def _set_span(self) -> None:
        """Eager cycles (a CPU) attend over the cache slots the active rows can reach in this cycle, rounded up to
        64, rather than all of them: there attention and its masks cost in proportion to the slots they cover
        (docs/benchmarks.md section 20). Captured cycles keep every slot."""
        if self.graphs or not self._lens:
            self.span, self.d_span = self.seq_len, (self.sd if self.d is not None else 0)
            return
        reach = max(self._lens) + self.margin  # the furthest slot a cycle writes, plus one

        def up(x: int) -> int:
            return -(-x // 64) * 64

        self.span = min(self.seq_len, up(reach))
        if self.d is not None:
            self.d_span = min(self.sd, up(reach + self.sd - self.seq_len))  # the drafter's scratch rows too

    def _feed(self, nb: int) -> None:
        self._feed_runner(nb)()
        self.feeds += 1
        self._held = [0] * self.n

    def cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() * 2 for c in ([self.k, self.dk] if self.d is not None else [self.k]))

    def shape_of(self, n: int) -> DraftShape | None:
        return self.shapes[self.bucket(max(1, n))]

    def _caches(self, nb: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The target's K and V of the first nb rows over the slots this cycle attends (`span`), and their arange."""
        s = self.span
        return self.k[:, :nb, :, :s], self.v[:, :nb, :, :s], self.ar_s[:s]

    def _d_caches(self, nb: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The drafter's K and V of the first nb rows over `d_span` slots, and their arange."""
        s = self.d_span
        return self.dk[:nb, :, :s], self.dv[:nb, :, :s], self.ar_sd[:s]
