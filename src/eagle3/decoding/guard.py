"""`SpeculationGuard`: keeps a request from decoding slower than plain decoding.

Speculation pays only where the tokens a cycle emits outweigh what drafting and a many-token verification cost
on this device. The guard times the request's own cycles: while drafting, the tokens per second of its recent
speculative cycles; now and then, a plain step (the root verified alone). When speculation loses it switches to
plain steps and probes again after a backoff that doubles with each failed probe, so a drafter that does not fit
the traffic costs a few cycles, and one that fits again (the text changed) is picked up. Either way every token
is the target's own: the guard only decides whether a cycle drafts.
"""

from __future__ import annotations

from collections import deque


class SpeculationGuard:
    """Per request: `drafting()` says whether the next cycle drafts; `record(drafted, seconds, emitted)` reports
    how it went. `plain_s`: a plain step's seconds when known (a tuned device), else measured on the way."""

    def __init__(self, plain_s: float | None = None, window: int = 6, probe: int = 2, first_probe: int = 8,
                 max_backoff: int = 256, remeasure_every: int = 64):
        self.window = window  # speculative cycles compared at once
        self.probe = probe  # speculative cycles a probe runs before it is judged
        self.first_probe = first_probe  # plain steps before the first probe once speculation lost
        self.max_backoff = max_backoff
        self.remeasure_every = remeasure_every  # speculative cycles between plain steps that refresh `plain_s`
        self.plain_s = plain_s
        self.spec: deque[tuple[float, int]] = deque(maxlen=window)  # (seconds, tokens) of recent drafting cycles
        self.on = True
        self.backoff = first_probe
        self.wait = 0  # plain steps left before the next probe (off) / before the next plain step (on)
        self.since_plain = 0  # speculative cycles since the last plain step
        self.probing = 0  # speculative cycles of the current probe so far
        self.switches = 0  # times speculation was switched off (for stats)
        self.plain_steps = 0

    def drafting(self) -> bool:
        if self.on:
            # a plain step now and then keeps the comparison current (the context grows, the step slows)
            stale = self.plain_s is None and len(self.spec) >= self.window
            return not (stale or self.since_plain >= self.remeasure_every)
        return self.wait <= 0

    def record(self, drafted: bool, seconds: float, emitted: int) -> None:
        if not drafted:
            self.plain_steps += 1
            self.plain_s = seconds if self.plain_s is None else 0.5 * (self.plain_s + seconds)
            self.since_plain = 0
            if not self.on:
                self.wait -= 1
            else:
                self._judge()
            return
        self.spec.append((seconds, emitted))
        self.since_plain += 1
        if not self.on:  # a probe: back on when it beats plain steps, else wait twice as long
            self.probing += 1
            if self.probing < self.probe:
                return
            self.probing = 0
            if self._spec_rate(last=self.probe) > self._plain_rate():
                self.on, self.backoff = True, self.first_probe
            else:
                self.backoff = min(2 * self.backoff, self.max_backoff)
                self.wait = self.backoff
            return
        self._judge()

    def _judge(self) -> None:
        if self.plain_s is None or len(self.spec) < self.window:
            return
        if self._spec_rate() < self._plain_rate():
            self.on = False
            self.switches += 1
            self.wait = self.backoff
            self.spec.clear()

    def _spec_rate(self, last: int | None = None) -> float:
        cycles = list(self.spec)[-last:] if last else self.spec  # a probe is judged on its own cycles
        seconds = sum(s for s, _ in cycles)
        return sum(t for _, t in cycles) / seconds if seconds > 0 else float("inf")

    def _plain_rate(self) -> float:
        return 1.0 / self.plain_s if self.plain_s else 0.0
