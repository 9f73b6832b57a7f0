"""`SpeculationGuard`: keeps a request from decoding slower than plain decoding.

Speculation pays only where the tokens a cycle emits outweigh what drafting and a many-token verification cost
on this device. The guard times the request's own cycles: a plain step (the root verified alone) first and now
and then, and the tokens per second of the drafting cycles, weighted towards the recent ones. When drafting
loses it switches to plain steps and probes again later. Acceptance comes in bursts, so a switch needs the
loss to hold beyond the noise of the cycles seen: the mean tokens per cycle plus `z` standard errors must still
lose (a good drafter in a hard stretch keeps drafting). A variance floor covers a few cycles that agree by chance
and shrinks as more agree, so a drafter that is never right stops within a few cycles even where it costs little
more than a plain step; each failed probe doubles the wait, and the wait is at
least what keeps the probes' cost near `probe_budget` of the time, so an expensive tree on a slow device is
probed rarely. A drafter that does not fit the traffic costs a few cycles, and one that fits again (the text
changed) is picked up. Every token is the target's own either way: the guard only decides whether a cycle drafts.

An engine keeps one guard for its greedy requests and one for its sampled ones (`EngineGuards`), so what a guard
learned (a plain step's cost, whether drafting pays, when to probe next) carries from one request to the next: a
drafter that does not fit the traffic costs its few cycles once, not in every request.
"""

from __future__ import annotations

import math


class SpeculationGuard:
    """Per request: `drafting()` says whether the next cycle drafts; `record(drafted, seconds, emitted)` reports
    how it went. `plain_s`: a plain step's seconds when known (a tuned device), else measured first."""

    def __init__(self, plain_s: float | None = None, decay: float = 0.9, min_cycles: int = 4, probe: int = 2,
                 first_wait: int = 8, max_wait: int = 512, probe_budget: float = 0.03, remeasure_every: int = 64,
                 clear_win: float = 1.5, remeasure_when_clear: int = 256, z: float = 1.5, min_var: float = 0.25):
        self.decay = decay  # weight of the older drafting cycles at each new one (about 1 / (1 - decay) counted)
        self.min_cycles = min_cycles  # drafting cycles before a close comparison is trusted
        self.probe = probe  # drafting cycles a probe runs before it is judged
        self.first_wait = first_wait
        self.max_wait = max_wait
        self.probe_budget = probe_budget  # share of the time failed probes may cost
        self.remeasure_every = remeasure_every  # drafting cycles between plain steps that refresh `plain_s`
        self.clear_win = clear_win  # drafting at this many times plain speed or more: refresh `plain_s` less often
        self.remeasure_when_clear = remeasure_when_clear
        self.ratio = 0.0  # drafting's speed over plain decoding's, as last judged
        self.z = z  # standard errors of the mean tokens per cycle that a loss must hold beyond
        self.min_var = min_var  # the least variance of tokens per cycle assumed over `min_cycles` (a few can agree)
        self.weight = self.tokens2 = 0.0  # decayed count and sum of squared tokens over drafting cycles
        self.plain_s = plain_s
        self.tokens = self.seconds = 0.0  # decayed sums over drafting cycles
        self.cycles = 0  # drafting cycles since the guard last changed its mind
        self.on = True
        self.backoff = first_wait
        self.wait = 0  # plain steps left before the next probe
        self.since_plain = 0  # drafting cycles since the last plain step
        self.switches = 0  # times drafting was switched off

    def drafting(self) -> bool:
        if self.on:
            every = self.remeasure_when_clear if self.ratio >= self.clear_win else self.remeasure_every
            return self.plain_s is not None and self.since_plain < every
        return self.wait <= 0

    def record(self, drafted: bool, seconds: float, emitted: int) -> None:
        if not drafted:
            self.plain_s = seconds if self.plain_s is None else 0.5 * (self.plain_s + seconds)
            self.since_plain = 0
            self.wait -= not self.on
            return
        self.tokens = self.decay * self.tokens + emitted
        self.tokens2 = self.decay * self.tokens2 + emitted * emitted
        self.weight = self.decay * self.weight + 1.0
        self.seconds = self.decay * self.seconds + seconds
        self.cycles += 1
        self.since_plain += 1
        if self.plain_s is None or self.seconds <= 0:
            return
        ratio = self.ratio = (self.tokens / self.seconds) * self.plain_s  # tokens per plain step's time
        if self.on:
            mean = self.tokens / self.weight
            # the variance floor covers a few cycles that agree by chance; the more agree, the less it assumes
            var = max(self.tokens2 / self.weight - mean * mean, self.min_var * min(1.0, self.min_cycles / self.cycles))
            high = ratio * (1.0 + self.z * math.sqrt(var / min(self.cycles, self.weight)) / mean)
            if ratio < 0.5 or (self.cycles >= self.min_cycles and high < 1.0):  # a clear loss, or a settled one
                self.switches += 1
                self._off(self.first_wait)
        elif self.cycles >= self.probe:  # a probe, judged on its own cycles
            if ratio > 1.0:
                self.on, self.backoff = True, self.first_wait
            else:
                lost = self.seconds - self.tokens * self.plain_s  # what the probe cost over plain steps
                self.backoff = min(max(2 * self.backoff, math.ceil(lost / (self.probe_budget * self.plain_s))),
                                   self.max_wait)
                self._off(self.backoff)

    def _off(self, wait: int) -> None:
        self.on, self.wait = False, wait
        self.tokens = self.tokens2 = self.weight = self.seconds = 0.0
        self.cycles = 0


class EngineGuards:
    """The guards of one engine: one for greedy requests and one for sampled ones (their acceptance differs).
    `factory` makes a guard (the class, by default); `for_request(sampled)` returns that kind's guard."""

    def __init__(self, factory=SpeculationGuard):
        self.factory = factory
        self._guards: dict[bool, SpeculationGuard] = {}

    def for_request(self, sampled: bool) -> SpeculationGuard:
        guard = self._guards.get(sampled)
        if guard is None:
            guard = self._guards[sampled] = self.factory()
        return guard

    def __len__(self) -> int:
        return len(self._guards)

    def reset(self) -> None:
        """Forget what was learned (the drafter changed): the next request of each kind starts a new guard."""
        self._guards.clear()
