"""Batched decoding on the fast path: B rows, each with its own static KV cache, plain or speculative.

`FastCore` generalised to rows, for the server's batch (`eagle3.serving.scheduler`). Row b's token at position p
lives in slot p of row b's cache (`[L, B, n_kv, S, hd]`), so rows of any lengths decode together without padding
or cross-row masks. Where the split-KV kernel runs (CUDA), every decoding forward attends by position
(`eagle3.fast.split_attention.Paths` with a row axis). One cycle of the first `nb` rows (a batch-size bucket) is a
fixed-shape function of device buffers, replayed as a CUDA graph:

    spec cycle   draft a tree per row (EAGLE-2 expansion as `FastCore.draft`), verify [nb, N+1], accept per row,
                 move each row's accepted K/V next to its prefix, feed the drafter, advance.
    plain cycle  one token per row; with a drafter, each row's features and new token are held back (up to
                 `feed_window`) and fed to the drafter in one batched step before the next speculative cycle.

State per row: length [B] (committed tokens), root [B] (last emitted token, not yet cached), last_out [B, H]
(drafter output of the newest committed row), held_n [B] (tokens held back for the drafter, their features
held_aux [B, W, 3·Ht] and next tokens held_tok [B, W]). The host reads packet [nb, D+3] = [n_acc, drafted depth,
emitted...] once per cycle.

Admission (`add_many`) prefills R prompts right-padded to T tokens in a staging cache rounded up to a prefill
bucket (R to a batch bucket, T to a power of two), each bucket a captured graph, and copies the result into the
rows' caches. Rows [n, nb) of a captured bucket are idle (their lengths clamped inside the cache); eager cycles (a
CPU) run the active rows only, over the cache slots they can reach. A row that leaves is replaced by the last one. Sampled rows carry their own settings (`add_many(..., sampling=)`): their tokens are the
position-keyed draws of `eagle3.decoding.sampling` (the same text as anywhere else), drafted coupled to those draws
(`eagle3.decoding.expand.coupled_top_k`), in cycles captured per sampling mode.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from eagle3.config import FEED_WINDOW, ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.expand import coupled_top_k, expand_tree
from eagle3.decoding.sampling import FILTERED, GREEDY, MODES, SamplingRows, sampling_mode
from eagle3.decoding.tree import ancestry, parents_with_root, path_slots, scratch_path_slots
from eagle3.decoding.verify import accept_rows
from eagle3.drafter import Eagle3Drafter
from eagle3.fast import split_attention as split
from eagle3.fast.drafter import FastDrafter, draft_top_k_op_for, ranked_top_k
from eagle3.fast.graphs import CompiledPieces, StepRunner, graph_pool
from eagle3.fast.rows_prefill import MIN_PREFILL_WIDTH, Prefill
from eagle3.fast.target import FastTarget, argmax_ids

__all__ = ["FastRows"]

# The speculative cycle's pieces that never run the target's weights (`FastRows.compile_drafting`)
DRAFTING_PIECES = ("_draft", "_tree_inputs", "_accept", "_feed_rows")


class FastRows:
    """Up to `capacity` greedy rows over per-row static caches of `seq_len` slots; see the module docstring.

    `shapes(bucket)` is the draft shape of that bucket's speculative cycle (None: plain only).
    `add` prefills a row and returns its first token; `cycle(spec)` runs one cycle of all active rows and
    returns each row's new tokens; `remove(i)` frees row i (the last row takes its place).
    """

    def __init__(self, target: FastTarget, drafter: Eagle3Drafter | None, capacity: int, seq_len: int,
                 shapes: Callable[[int], DraftShape | None] | None = None, graphs: bool = True,
                 prefill_tokens: int = 8192, sampling: bool = True, feed_window: int = FEED_WINDOW,
                 fused_sampling: bool | None = None, compile_drafting: bool = False,
                 chain_stop: float | None = None):
        if capacity < 1 or seq_len < 8:
            raise ConfigError(f"FastRows needs capacity >= 1 and seq_len >= 8 (got {capacity}, {seq_len})")
        if feed_window < 0:
            raise ConfigError(f"feed_window={feed_window} must be >= 0 (0: feed the drafter in every plain cycle)")
        if drafter is not None and target.aux_layer_ids != sorted(drafter.config.aux_layer_ids):
            raise ConfigError(f"the FastTarget taps layers {target.aux_layer_ids}; the drafter needs "
                              f"{sorted(drafter.config.aux_layer_ids)}")
        self.t, self.capacity, self.seq_len = target, capacity, seq_len
        self.d = FastDrafter(drafter) if drafter is not None else None
        self.buckets = [1 << i for i in range((capacity - 1).bit_length())] + [capacity]  # one graph each
        self.shapes = {b: (shapes(b) if self.d is not None and shapes is not None else None) for b in self.buckets}
        d_max = max([s.depth for s in self.shapes.values() if s] + [0])
        n_max = max([s.total for s in self.shapes.values() if s] + [0])
        scratch = max([s.scratch for s in self.shapes.values() if s] + [0])
        self.margin = n_max + d_max + 2  # slots a cycle may write beyond a row's length
        dev, dt, t = target.device, target.dtype, target
        self.device = dev
        self.rope = t.rope_table(seq_len)
        shape = (t.num_layers, capacity, t.nkv, seq_len, t.hd)
        self.k = torch.zeros(shape, dtype=dt, device=dev)
        self.v = torch.zeros(shape, dtype=dt, device=dev)
        self.ar_s = torch.arange(seq_len, device=dev)
        self.ar = torch.arange(max(n_max, d_max, 1) + 2, device=dev)
        self.length = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.root = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.packet = torch.zeros(capacity, d_max + 3, dtype=torch.long, device=dev)
        self.sampling = sampling  # sampled rows allowed: their cycles are captured too
        # sampled draws compiled into one kernel (None: on CUDA, where the cycles are graphs; the noise is ~30 eager
        # passes over [rows, positions, V] otherwise; eagle3.decoding.sampling)
        self.fused_sampling = dev.type == "cuda" if fused_sampling is None else fused_sampling
        self.row_sampling = SamplingRows(capacity, target.vocab_size, dev)
        self._modes: list[int] = []  # host mirror: how active row i chooses its tokens
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
        # per row, of the last cycle: depth and draft tokens drafted (0: did not draft)
        self.depths: list[int] = []
        self._nodes = 0  # draft nodes of the last speculative cycle
        self.drafted: list[int] = []
        self.n = 0  # active rows: [0, n)
        self._lens: list[int] = []  # host mirror of length for the active rows
        self.cycles = self.spec_cycles = self.feeds = 0  # cycles run (all, speculative), feed steps run
        self.graphs = graphs and dev.type == "cuda"
        # Chains stop drafting once every row's joint draft probability is below this (`FastCore.chain_stop`):
        # the host reads each draft step's scores, so only where cycles run eagerly
        if chain_stop is not None and (self.graphs or compile_drafting):
            raise ConfigError("chain_stop needs cycles that run eagerly (a CPU, or graphs and compilation off)")
        self.chain_stop = chain_stop
        self._set_span()  # span, d_span: the cache slots the next cycle attends over
        self._pool = graph_pool(dev)
        self._runners: dict[tuple[int, bool, int], StepRunner] = {}
        self._feeds: dict[int, StepRunner] = {}  # bucket -> its feed step
        # prefill buckets (R, T) of at most `prefill_tokens` padded tokens share flat staging buffers
        self.prefill_tokens = prefill_tokens
        self.flat_staging: dict[str, torch.Tensor] = {}
        self._prefills: dict[tuple[int, int], Prefill] = {}
        self.pieces = CompiledPieces(self)
        self.ranked = False  # top-k by ranking inside compiled drafting (`ranked_top_k`)
        # greedy drafting's log-softmax and top-k as the batch-1 engine's Triton kernels where they run (CUDA)
        self._top_k_ops = {s.top_k: draft_top_k_op_for(self.d, s.top_k) for s in self.shapes.values() if s}
        if self.d is not None and target.attention == "split" and split.supports(self.d.hd, 1):
            self.d.use_paths_attention()  # drafting attends by position, as the target's forwards do
        if self.d is not None and compile_drafting:
            self.compile_drafting()

    def compile_drafting(self, backend: str | Callable = "inductor") -> None:
        """Compile the cycle's pieces that do not run the target (`DRAFTING_PIECES`), as `FastCore.compile_drafting`
        does: one variant per bucket and sampling mode, so `prepare` takes longer. Call before cycles are captured.
        Emitted tokens are unchanged: the drafter decides only what is proposed."""
        if self._runners:
            raise RuntimeError("compile_drafting() must come before cycles are captured")
        self.pieces.compile(list(DRAFTING_PIECES), backend)
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
    def prepare(self) -> float:
        """Capture every bucket's cycles (plain, and speculative where a shape is set) and every prefill bucket
        before rows exist: warm-up runs real cycles on the buffers. Returns the seconds it took."""
        if self.n:
            raise RuntimeError("prepare() runs real cycles: call it before adding rows")
        t0 = time.perf_counter()
        for mode in MODES if self.sampling else (GREEDY,):
            for b in self.buckets:
                for spec in (False, True):
                    if not spec or self.shapes[b] is not None:
                        self._runner(b, spec, mode)
        if self.feed_window:
            for b in self.buckets:
                self._feed_runner(b)
        for key in self.prefill_buckets():
            self._prefill_slot(*key)
        self._reset_rows(0, self.capacity)
        return time.perf_counter() - t0

    @property
    def cycles_prepared(self) -> int:
        return len(self._runners) + len(self._feeds)

    # -- prefill ------------------------------------------------------------------------------------
    def prefill_buckets(self) -> list[tuple[int, int]]:
        """(rows, width) shapes captured for admission: batch buckets x powers of two up to the cache length,
        at most `prefill_tokens` padded tokens each."""
        widths, w = [], MIN_PREFILL_WIDTH
        while w < self.seq_len:
            widths.append(w)
            w *= 2
        widths.append(self.seq_len)
        return [(r, t) for r in self.buckets for t in widths if r * t <= self.prefill_tokens]

    def _prefill_key(self, r: int, width: int) -> tuple[int, int] | None:
        t = max(MIN_PREFILL_WIDTH, 1 << (width - 1).bit_length())
        key = (self.bucket(r), min(t, self.seq_len))
        return key if key[0] * key[1] <= self.prefill_tokens else None

    def _prefill_slot(self, r: int, t: int) -> Prefill:
        p = self._prefills.get((r, t))
        if p is None:
            p = Prefill(self, r, t)
            p.runner = StepRunner(lambda: self._prefill_step(p), self.device, graphs=self.graphs, pool=self._pool,
                                  name=f"rows_prefill_r{r}_t{t}")
            p.runner.prepare()
            self._prefills[(r, t)] = p
        return p

    def _prefill_step(self, p: Prefill) -> None:
        """Prefill p.ids into p's staging caches (causal, positions from 0); first tokens and, with a drafter,
        its output at each prompt's last token."""
        r, t = p.r, p.t
        pos = self.ar_s[:t][None].expand(r, -1)  # [R, T]
        mask = self.ar_s[None, None, :t] <= pos[:, :, None]  # [R, T, T] causal
        logits, aux = self.t.forward_rows(p.ids, pos, pos, mask, p.k, p.v, self.rope, logits_at=p.lens - 1,
                                          want_aux=self.d is not None)  # [R, 1, V], [R, T, 3·Ht]
        mode = FILTERED if self.sampling else GREEDY  # the first new token sits at position lens
        tok = self._choose(p.sampling, logits, p.lens[:, None], mode)[:, 0]  # [R]
        p.first.copy_(torch.where(p.has_root, p.root, tok))
        if self.d is not None:
            nxt = torch.cat([p.ids[:, 1:], p.ids[:, :1]], dim=1).scatter(1, (p.lens - 1)[:, None], p.first[:, None])
            out = self.d.forward_rows(self.d.combine(aux), nxt, pos, pos, mask, p.dk, p.dv,
                                      self.d_rope)  # [R, T, H]; row t pairs g_t with x_{t+1}
            p.last_out.copy_(out[torch.arange(r, device=self.device), p.lens - 1])

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
    def add(self, prompt: list[int], root: int | None = None, sampling: SamplingConfig | None = None) -> int:
        """Prefill `prompt` into a new row (index `n` before the call); returns the row's first new token
        (`root` when given: a request moving in from elsewhere, whose next token is already known). `sampling`
        with a temperature > 0 (and a seed) makes the row sample; None is greedy."""
        return self.add_many([prompt], [root], [sampling])[0]

    @torch.no_grad()
    def add_many(self, prompts: list[list[int]], roots: list[int | None] | None = None,
                 sampling: list[SamplingConfig | None] | None = None) -> list[int]:
        """Prefill several prompts into new rows n, n+1, ... in one right-padded forward (and one drafter
        forward); returns their first new tokens (see `add`). Padding writes K/V past each prompt, into slots a
        row's length never covers before they are overwritten, and the causal mask keeps real tokens from it."""
        r, i = len(prompts), self.n
        roots = roots or [None] * r
        sampling = sampling or [None] * r
        modes = [GREEDY if s is None else sampling_mode(s.temperature, s.top_p, s.top_k) for s in sampling]
        if any(modes) and not self.sampling:
            raise ConfigError("these FastRows were built with sampling=False; sampled requests need sampling=True")
        for s, mode in zip(sampling, modes, strict=True):
            if mode != GREEDY and s.seed is None:
                raise ConfigError("a sampled row needs a seed (its draws are keyed by seed and position)")
        if i + r > self.capacity:
            raise RuntimeError(f"{r} more rows do not fit: {i} of {self.capacity} are in use")
        for p in prompts:
            if not p or not self.fits(len(p), 1):
                raise ConfigError(f"a {len(p)}-token context does not fit {self.seq_len} cache slots")
        width = max(len(p) for p in prompts)
        key = self._prefill_key(r, width)
        p = self._prefill_slot(*key) if key is not None else Prefill(self, r, width, shared=False)  # too big: eager
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
        if p.runner is not None:
            p.runner()
        else:
            self._prefill_step(p)
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
        return p.first[:r].tolist()

    @torch.no_grad()
    def remove(self, i: int) -> None:
        """Free row i; the last active row moves into it (callers mirror that move in their own row lists)."""
        last = self.n - 1
        if not 0 <= i <= last:
            raise IndexError(f"row {i} is not active (rows 0..{last})")
        if i != last:
            self.k[:, i].copy_(self.k[:, last])
            self.v[:, i].copy_(self.v[:, last])
            for state in self._row_state():
                state[i].copy_(state[last])
            self.row_sampling.move(i, last)
            self._modes[i] = self._modes[last]
            self._held[i] = self._held[last]
            self._lens[i] = self._lens[last]
        self._modes.pop()
        self._held.pop()
        self._lens.pop()
        self._reset_rows(last, last + 1)
        self.n -= 1

    def clear(self) -> None:
        """Free every row."""
        self._reset_rows(0, self.capacity)
        self._modes, self._held, self._lens, self.n = [], [], [], 0

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
        if self.n == 0:
            return []
        nb = self.bucket(self.n) if self.graphs else self.n  # eager cycles run the active rows only
        if spec and self.shape_of(nb) is None:
            raise ValueError(f"bucket {self.bucket(nb)} has no draft shape")
        self._set_span()
        if spec and max(self._held):  # the drafter catches up before it drafts
            self._feed(nb)
        self._runner(nb, spec, self.mode)()
        self.cycles += 1
        self.spec_cycles += spec
        if not spec and self.feed_window:
            self._held = [h + 1 for h in self._held]
            if max(self._held) >= self.feed_window:  # a full window: feed before the next plain cycle
                self._feed(nb)
        pkt = self.packet[: self.n].tolist()  # the one host sync per cycle
        self._lens = [n + p[0] + 1 for n, p in zip(self._lens, pkt, strict=True)]
        self.depths = [p[1] for p in pkt]
        self.drafted = [self._nodes if spec else 0] * self.n
        return [p[2 : 3 + p[0]] for p in pkt]

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

    # -- device steps (fixed shapes for a bucket of nb rows) ------------------------------------------
    def _choose(self, rows: SamplingRows, logits: torch.Tensor, positions: torch.Tensor, mode: int) -> torch.Tensor:
        """The token after each of logits [nb, M, V], predicting `positions` [nb, M]: argmax in greedy buckets,
        else each row's own choice (`SamplingRows.draw`). [nb, M]."""
        if mode == GREEDY:
            return argmax_ids(logits)
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
        tokens, parents1 = self.pieces.run("_draft", nb, mode)  # [nb, N], [nb, N+1]
        anc, top, aux = self._verify(nb, tokens, parents1, mode)
        keep, n_acc, emitted = self.pieces.run("_accept", nb, tokens, parents1, anc, top)
        self._commit(nb, keep, n_acc, emitted, aux)

    def _draft(self, nb: int, mode: int = GREEDY) -> tuple[torch.Tensor, torch.Tensor]:
        """The EAGLE-2 tree of every row (`eagle3.decoding.expand`): tokens [nb, N] and parents [nb, N+1] (N+1
        indexing; the root is its own parent). Row r drafts its token at length[r] + 1 + step (`FastCore.draft`
        with a row axis)."""
        shape = self.shape_of(nb)
        d, k = self.d, shape.top_k
        length = self.length[:nb]
        dk, dv, ar_sd = self._d_caches(nb)

        def children(out: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:  # out [nb, T, H]
            if mode == GREEDY:
                return d.top_k(out, k, self._top_k_ops.get(k), self.ranked)
            return coupled_top_k(d.logits(out), length + 1 + step, self.row_sampling, mode, d.draft_h, k,
                                 self.ranked)

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
        if self.chain_stop is not None and shape.is_chain:  # every row unsure: stop (`FastCore.draft_chain_until`)
            stop = self.chain_stop
            until = lambda scores: float(scores.exp().max()) < stop  # noqa: E731
        tokens, parents = expand_tree(self.last_out[:nb], shape, children, run, d.feedback, d.to_target_ids,
                                      self.ranked, until)
        self._nodes = tokens.shape[1]
        return tokens, parents_with_root(parents)  # [nb, N], [nb, N+1]

    def _tree_inputs(self, nb: int, tokens: torch.Tensor, parents1: torch.Tensor, by_paths: bool):
        """What the verification forward reads per row: ancestry [nb, N+1, N+1], ids, RoPE positions and cache
        slots [nb, N+1], and how the target sees each row's cache: with `by_paths`, each node's path by depth,
        tail [nb, N+1, D+1] (`eagle3.decoding.tree.path_slots`), else the mask [nb, N+1, S]; the other is
        None (as `FastCore.tree_inputs`)."""
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
        [nb, N+1] (argmax, or the row's position-keyed draw), aux."""
        by_paths = self.t.by_splits(tokens.shape[1] + 1)
        anc, ids, pos, slots, mask, tail = self.pieces.run("_tree_inputs", nb, tokens, parents1, by_paths)
        k, v, _ = self._caches(nb)
        logits, aux = self.t.forward_rows(ids, pos, slots, mask, k, v, self.rope, want_aux=True,
                                          path=(self.length[:nb], tail) if by_paths else None)
        # logits [nb, N+1, V], aux [nb, N+1, 3·Ht]
        # node j predicts the token at pos[j] + 1
        top = self._choose(self.row_sampling, logits, pos + 1, mode)  # [nb, N+1]
        return anc, top, aux

    def _accept(self, nb: int, tokens, parents1, anc, top):
        """Acceptance per row (`eagle3.decoding.verify.accept_rows`): keep [nb, D+1], n_acc [nb], emitted
        [nb, D+1]."""
        acc = accept_rows(tokens, parents1, anc, top, self.packet.shape[1] - 3, root=self.root[:nb])
        self.packet[:nb].copy_(torch.cat([acc.n_acc[:, None], acc.drafted[:, None], acc.emitted], dim=1))
        return acc.keep, acc.n_acc, acc.emitted

    def _commit(self, nb: int, keep, n_acc, emitted, aux) -> None:
        """Accepted K/V next to each row's prefix, then `_feed_rows`."""
        rows = torch.arange(nb, device=self.device)[:, None]  # [nb, 1]
        length = self.length[:nb]
        dst = length[:, None] + self.ar[: keep.shape[1]][None]  # [nb, D+1]
        src = length[:, None] + keep  # src >= dst elementwise: gather first, then write
        k, v, _ = self._caches(nb)
        k[:, rows, :, dst] = k[:, rows, :, src]  # [nb, D+1, L, nkv, hd] moved per row
        v[:, rows, :, dst] = v[:, rows, :, src]
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
