"""When and how much to speculate in a batch: the adaptive policy, in one dataclass with its defaults.

A batched verification forward is padded to B·(N+1) tokens (B rows, N draft nodes per drafting row). While
that product is small the forward costs about as much as plain decoding (it is bound by reading weights),
so drafts are nearly free; past that point every draft token costs compute. The policy therefore:

1. keeps B·(N+1) <= `token_budget`: N = min(largest tree, budget // B - 1), so the tree shrinks as the
   batch grows (256 tokens on a GPU: B=1..4 -> 60 nodes, B=8 -> 31, B=16 -> 15, B=32 -> 7, B=64 -> 3);
2. switches speculation off for the cycle when N < `min_draft_tokens` or B > `max_batch`;
3. shapes N nodes as a chain while N <= the maximum depth, else as an EAGLE-2 tree of full depth and
   top-k = ceil(N / depth) (capped at the configured top-k): depth pays first, width later.

On top of these static rules, `SpeedGate` measures what speculation actually buys: per batch-size bucket it
keeps moving averages of emitted tokens per row-second for speculative cycles and for plain ones, runs the faster
mode, and re-times the slower one every `probe_every` cycles, less often while the probes confirm the choice.
Plain cycles keep every drafting row's features for the drafter (held back and fed in one batched step before the
next speculative cycle, or once `FEED_WINDOW` are held), so speculation can resume whenever it pays again. This is what keeps serving at or above plain decoding where the
static budget guesses wrong (a slow drafter, an overhead-bound device, a low-acceptance workload).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from eagle3.config import ConfigError, DraftShape

__all__ = ["SpecPolicy", "SpeedGate", "default_token_budget"]

GPU_TOKEN_BUDGET = 256
CPU_TOKEN_BUDGET = 32


# FastRows (the static-cache batch) verifies a wider tree for the same cost: 512 tokens per cycle beat 256 at 32
# and 64 rows, tied at 1-16, and 2,048 lost (`scripts/bench_rows.py`, docs/benchmarks.md).
FAST_ROWS_TOKEN_BUDGET = 512


def default_token_budget(device: str, fast_rows: bool = False) -> int:
    """Verified tokens per batched forward: 256 on a GPU (512 on the fast rows), 32 on a CPU, where compute grows
    with tokens (fast rows on a CPU with 512: a speculative cycle of 8 SmolLM2 rows cost 30 plain ones)."""
    if not str(device).startswith("cuda"):
        return CPU_TOKEN_BUDGET
    return FAST_ROWS_TOKEN_BUDGET if fast_rows else GPU_TOKEN_BUDGET


@dataclass
class SpecPolicy:
    """Adaptive speculation for batched serving; see the module docstring for the rules."""

    largest: DraftShape | None = field(default_factory=DraftShape)  # --tree / --chain (None: no speculation)
    token_budget: int = GPU_TOKEN_BUDGET  # B·(N+1) per verification forward
    max_batch: int | None = None  # no speculation with more rows than this (None: the budget decides)
    min_draft_tokens: int = 1
    measure: bool = True  # SpeedGate: speculate only where measured faster than plain cycles
    probe_every: int = 16  # cycles between re-timings of the mode the gate is not using (doubles while confirmed)
    max_probe_every: int = 512
    gate_settle: int = 1  # cycles after a change of mode that the gate does not measure (see SpeedGate)
    gate_ema: float = 1 / 32  # weight of a cycle's newest sample in the gate's decayed token and time sums
    probe_cycles: int = 4  # measured cycles per probe of the slower mode
    gate_margin: float = 0.03  # speculation must beat plain cycles by this fraction
    probe_share: float = 0.02  # the most of the time the gate's probes may cost

    def __post_init__(self) -> None:
        if self.token_budget < 2:
            raise ConfigError(f"--spec-budget {self.token_budget} must be >= 2 (one root and one draft token)")
        if self.min_draft_tokens < 1:
            raise ConfigError(f"min_draft_tokens={self.min_draft_tokens} must be >= 1")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"--spec-max-batch {self.max_batch} must be >= 1")
        if self.probe_every < 2:
            raise ConfigError(f"probe_every={self.probe_every} must be >= 2")
        if self.gate_settle < 0 or self.gate_margin < 0 or not 0 < self.probe_share <= 1:
            raise ConfigError(f"gate_settle={self.gate_settle} and gate_margin={self.gate_margin} must be >= 0 and "
                              f"probe_share={self.probe_share} in (0, 1]")
        if not 0.0 < self.gate_ema <= 1.0 or self.probe_cycles < 1:
            raise ConfigError(f"gate_ema={self.gate_ema} must be in (0, 1] and probe_cycles={self.probe_cycles} >= 1")
        if self.max_probe_every < self.probe_every:
            raise ConfigError(f"max_probe_every={self.max_probe_every} must be >= probe_every={self.probe_every}")

    @property
    def enabled(self) -> bool:
        return self.largest is not None

    def draft_tokens(self, batch_size: int) -> int:
        """N for a batch of `batch_size` rows (0: no speculation this cycle)."""
        if not self.enabled or batch_size < 1:
            return 0
        if self.max_batch is not None and batch_size > self.max_batch:
            return 0
        n = min(self.largest.total, self.token_budget // batch_size - 1)
        return n if n >= self.min_draft_tokens else 0

    def shape(self, batch_size: int) -> DraftShape | None:
        """The draft shape for this cycle, or None when speculation does not pay: a chain while N fits the
        largest shape's depth, else its depth with the least branching that records N nodes."""
        n = self.draft_tokens(batch_size)
        if n == 0:
            return None
        big = self.largest
        if n <= big.depth or big.top_k == 1:
            return DraftShape.chain(min(n, big.depth))
        return DraftShape(big.depth, min(big.top_k, math.ceil(n / big.depth)), n)  # total capped at the records

    def speed_gate(self) -> SpeedGate:
        """A `SpeedGate` for serving cycles with this policy's settings."""
        return SpeedGate(self.probe_every, self.gate_ema, self.max_probe_every, settle=self.gate_settle,
                         margin=self.gate_margin, probe_share=self.probe_share, probe_cycles=self.probe_cycles)


class SpeedGate:
    """Speculate for a batch size only while speculative cycles emit more tokens per row-second than plain ones.

    Buckets: batch sizes share one per power of two (1, 2-3, 4-7, ...), split by the share of rows that want to
    draft (up to a quarter, a half, three quarters, all): every row pays the wider verification and the drafting
    steps of a speculative cycle, but only the drafting rows gain from it, so a cycle where few rows draft can
    lose where one where all draft wins. Cycles with a sampled row have buckets of their own: sampled requests
    accept fewer drafts and draw more per cycle, so what greedy traffic measured says nothing about them. In each
    bucket: try speculation first, then
    time a plain cycle; afterwards run the faster mode and give the slower one a probe of `probe_cycles` cycles
    every `probe_every` cycles, so a change in acceptance or load is noticed. A probe that confirms the choice by more
    than twice the noise of the two rates doubles the bucket's interval (up to `max_probe_every`); one that
    overturns it resets the interval; one within the noise leaves it. A probe of the
    slower mode can cost several cycles it replaces, so fixed probing every 16 cycles alone kept serving below
    plain decoding.
    Rates are tokens / (rows * seconds) over whole cycles (drafting, verification, bookkeeping and emission
    included), as the ratio of two decayed sums (each cycle's share weighted `ema`, the older ones fading by
    1 - `ema`): a mean of per-cycle rates would be noisier and biased, since a speculative cycle's tokens vary
    from 1 to depth + 1.

    Three guards against mistaking a transition for the mode (the serving gates use all three; defaults 0 keep
    the bare rules above):

    - `settle`: the first `settle` cycles after every change of mode are not measured, and a probe runs that
      many cycles more. The cycle after a switch carries the switch: the first speculative cycle after plain
      ones feeds the drafter what they held back, and a plain cycle right after speculative ones is slower than
      plain cycles after plain ones. With single-cycle probes every plain sample in a speculating bucket would
      be such a cycle, underestimating plain decoding (docs/benchmarks.md).
    - `margin`: speculation must beat plain cycles by this fraction, so noise near parity settles on plain.
    - `probe_share`: probes may cost at most this share of the time: a probe of a mode k times slower per cycle
      waits proportionally longer (on a CPU a speculative probe of a few rows with wide trees can cost tens of
      plain cycles).

    `probe_cycles`: measured cycles per probe. One speculative cycle emits anywhere from 1 to depth + 1 tokens,
    so single-cycle probes with a fast-fading average misjudge speculation (a gate can then choose plain cycles
    although speculation emits more tokens per second).
    """

    def __init__(self, probe_every: int = 16, ema: float = 0.25, max_probe_every: int = 512, settle: int = 0,
                 margin: float = 0.0, probe_share: float | None = None, probe_cycles: int = 1):
        self.probe_every, self.ema = probe_every, ema
        self.max_probe_every = max(probe_every, max_probe_every)
        self.settle, self.margin, self.probe_share = settle, margin, probe_share
        self.probe_cycles = max(1, probe_cycles)
        # buckets are (batch bits, drafting quarter, sampled); (bucket, speculative) -> decayed sums [tokens, row-seconds, seconds, weights, squared weights, rate,
        # rate²] (the last four give the noise of the per-cycle rate)
        self._sums: dict[tuple[tuple[int, int, bool], bool], list[float]] = {}
        self._rate: dict[tuple[tuple[int, int, bool], bool], float] = {}  # (bucket, speculative) -> tokens/row-second
        self._secs: dict[tuple[tuple[int, int, bool], bool], float] = {}  # (bucket, speculative) -> seconds per cycle
        self._since_probe: dict[tuple[int, int, bool], int] = {}
        self._interval: dict[tuple[int, int, bool], int] = {}  # bucket -> cycles between probes
        self._probe: dict[tuple[int, int, bool], bool] = {}  # bucket -> the mode that was faster when a probe launched
        self._probing: dict[tuple[int, int, bool], int] = {}  # bucket -> cycles of the running probe still to come
        self._probe_left: dict[tuple[int, int, bool], int] = {}  # bucket -> measured probe cycles still to come
        self._last: bool | None = None  # mode of the last recorded cycle (any bucket)
        self._run = 0  # cycles of that mode in a row
        self.last_probe = False  # whether the last `speculate` answer was a probe of the slower mode

    @staticmethod
    def bucket(batch_size: int, drafting: int | None = None, sampled: bool = False) -> tuple[int, int, bool]:
        """(power-of-two batch bucket, quarter of rows drafting: 1..4, whether a row samples); `drafting` None
        means all rows."""
        b = max(1, batch_size)
        d = b if drafting is None else min(max(1, drafting), b)
        return b.bit_length(), -(-4 * d // b), bool(sampled)

    def interval(self, batch_size: int, drafting: int | None = None, sampled: bool = False) -> int:
        """Cycles between probes for this bucket now."""
        b = self.bucket(batch_size, drafting, sampled)
        faster = self._faster(b)
        return self._interval.get(b, self.probe_every) if faster is None else self._due(b, faster)

    def _due(self, b: tuple[int, int, bool], faster: bool) -> int:
        """Cycles between probes of bucket `b`: its interval, or more where a probe would cost too much."""
        return max(self._interval.get(b, self.probe_every), self._affordable(b, faster))

    def _faster(self, b: tuple[int, int, bool]) -> bool | None:
        spec, plain = self._rate.get((b, True)), self._rate.get((b, False))
        return None if spec is None or plain is None else spec >= plain * (1.0 + self.margin)

    def _affordable(self, b: tuple[int, int, bool], faster: bool) -> int:
        """The fewest cycles between probes for which a probe costs at most `probe_share` of the time: a probe
        runs `settle` + `probe_cycles` cycles of the slower mode, each losing (1 - its rate / the faster rate)
        of its time."""
        if not self.probe_share:
            return 0
        t_fast, t_slow = self._secs.get((b, faster)), self._secs.get((b, not faster))
        r_fast, r_slow = self._rate[(b, faster)], self._rate[(b, not faster)]
        if not t_fast or t_slow is None or r_fast <= 0:
            return 0
        # seconds of output a probe loses
        lost = (self.settle + self.probe_cycles) * t_slow * max(0.0, 1.0 - r_slow / r_fast)
        return math.ceil(lost / (t_fast * self.probe_share))

    def speculate(self, batch_size: int, drafting: int | None = None, sampled: bool = False) -> bool:
        """The mode for the next cycle at this batch size with `drafting` rows wanting to draft, `sampled` if a
        row samples (True: speculate)."""
        b = self.bucket(batch_size, drafting, sampled)
        self.last_probe = False
        if (b, True) not in self._rate:
            return True
        faster = self._faster(b)
        if faster is None:
            return False
        if self._probing.get(b, 0) > 0 and b in self._probe:  # a probe's later cycles
            self._probing[b] -= 1
            self.last_probe = True
            return not self._probe[b]
        n = self._since_probe.get(b, 0) + 1
        self._since_probe[b] = n
        if n >= self._due(b, faster):
            self._since_probe[b] = 0  # re-time the slower mode: `settle` + `probe_cycles` cycles
            self._probe[b] = faster
            self._probing[b] = self.settle + self.probe_cycles - 1
            self._probe_left[b] = self.probe_cycles
            self.last_probe = True
            return not faster
        return faster

    def record(self, batch_size: int, speculative: bool, seconds: float, tokens: int,
               drafting: int | None = None, sampled: bool = False) -> None:
        """One finished cycle: `tokens` emitted over all `batch_size` rows in `seconds`; `drafting` rows wanted
        to draft when the mode was chosen; `sampled`: a row sampled."""
        if seconds <= 0 or batch_size < 1:
            return
        self._run = self._run + 1 if speculative == self._last else 1
        self._last = speculative
        if self._run <= self.settle:  # the cycle carries the switch of mode, not the mode: not measured
            return
        b = self.bucket(batch_size, drafting, sampled)
        key = (b, speculative)
        keep = 1.0 - self.ema
        x = tokens / (batch_size * seconds)
        old = self._sums.get(key, [0.0] * 7)
        new = (tokens, batch_size * seconds, seconds, 1.0, 1.0, x, x * x)
        s = self._sums[key] = [keep * a + v for a, v in zip(old, new, strict=True)]
        s[4] = keep * keep * old[4] + 1.0  # weights squared decay twice as fast
        self._rate[key], self._secs[key] = s[0] / s[1], s[2] / s[3]
        before = self._probe.get(b)
        if before is not None and speculative != before:  # one of the probe's measured cycles
            self._probe_left[b] = self._probe_left.get(b, 1) - 1
            if self._probe_left[b] > 0:
                return
            del self._probe[b]
            self._probing.pop(b, None)
            now = self._interval.get(b, self.probe_every)
            if self._faster(b) != before:  # overturned: probe often again
                self._interval[b] = self.probe_every
            elif self._clear(b):  # confirmed beyond the noise of the samples: probe half as often
                self._interval[b] = min(2 * now, self.max_probe_every)

    def _noise(self, key: tuple[tuple[int, int, bool], bool]) -> float:
        """Standard error of a mode's per-cycle rate: weighted variance over the effective sample count."""
        _, _, _, w1, w2, s1, s2 = self._sums[key]
        mean = s1 / w1
        var = max(0.0, s2 / w1 - mean * mean)
        return math.sqrt(var * w2) / w1  # sqrt(var / n_eff), n_eff = w1² / w2

    def _clear(self, b: tuple[int, int, bool]) -> bool:
        """Whether the two modes' rates differ by more than twice the noise of their difference."""
        spec, plain = (b, True), (b, False)
        gap = abs(self._rate[spec] - self._rate[plain])
        return gap > 2.0 * math.hypot(self._noise(spec), self._noise(plain))

    def snapshot(self) -> dict[str, dict[str, float | int | None]]:
        """What the gate believes now, per bucket "b<bits>_q<quarter>": the speculative and plain rates (tokens
        per row-second) and the cycles between probes; sampled buckets end in "_sampled". For benchmarks and
        debugging."""
        out = {}
        for b in sorted({k[0] for k in list(self._rate)}):  # a copy: the scheduler thread may add buckets
            spec, plain = self._rate.get((b, True)), self._rate.get((b, False))
            spec_s, plain_s = self._secs.get((b, True)), self._secs.get((b, False))
            out[f"b{b[0]}_q{b[1]}" + ("_sampled" if b[2] else "")] = {"spec": None if spec is None else round(spec, 2),
                                       "plain": None if plain is None else round(plain, 2),
                                       "spec_ms": None if spec_s is None else round(1000 * spec_s, 3),
                                       "plain_ms": None if plain_s is None else round(1000 * plain_s, 3),
                                       "probe_every": self._interval.get(b, self.probe_every)}
        return out

    def rates(self, batch_size: int, drafting: int | None = None,
              sampled: bool = False) -> tuple[float | None, float | None]:
        """(speculative, plain) tokens per row-second measured for this bucket."""
        b = self.bucket(batch_size, drafting, sampled)
        return self._rate.get((b, True)), self._rate.get((b, False))
