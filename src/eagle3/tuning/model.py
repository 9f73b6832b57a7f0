"""A cost model for speculative decoding: predicted tokens/s of a draft shape from measured costs.

A cycle drafts, verifies and emits tau tokens (bonus token included), so a shape's tokens/s is
tau / cycle_seconds. `choose` compares every candidate shape with plain decoding (one token per `plain_s`)
and keeps plain decoding unless a shape is clearly faster.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from eagle3.config import ConfigError, DraftShape

GPU_TREES = ("4,4,16", "5,8,32", "6,8,48", "6,10,60", "8,10,80")
CPU_TREES = ("3,2,6", "4,4,16")  # a CPU verifies many rows at several times the cost of one
MIN_SPEEDUP = 1.02  # speculation that gains less than 2 % is not worth its risk


def _interpolate(table: dict[int, float], x: int, what: str) -> float:
    """Piecewise-linear in `table` (row count -> seconds): the smallest point's value below it, linear
    extrapolation from the last two points above the largest (flat with one point)."""
    if not table:
        raise ConfigError(f"no measured {what} costs; measure at least one row count")
    xs = sorted(table)
    if x <= xs[0]:
        return table[xs[0]]
    if len(xs) == 1:
        return table[xs[0]]
    for lo, hi in itertools.pairwise(xs):
        if x <= hi:
            return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
    lo, hi = xs[-2], xs[-1]
    return table[hi] + (table[hi] - table[lo]) * (x - hi) / (hi - lo)


@dataclass(frozen=True)
class Costs:
    """Seconds measured on one device for one target+drafter pair.

    `verify_s[n]`: a speculative cycle's target forward over n rows (n = 1 + drafted tokens).
    `draft_step_s[w]`: one drafting step over w rows (w = 1 for chains, top_k for trees).
    `overhead_s`: the rest of a cycle (acceptance, cache compaction, feeding the drafter).
    """

    plain_s: float  # one step of plain decoding, no drafter
    verify_s: dict[int, float]
    draft_step_s: dict[int, float]
    overhead_s: float = 0.0

    def verify(self, n: int) -> float:
        return _interpolate(self.verify_s, n, "verify")

    def draft_step(self, w: int) -> float:
        return _interpolate(self.draft_step_s, w, "draft step")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: row counts become string keys."""
        return {"plain_s": self.plain_s,
                "verify_s": {str(n): s for n, s in sorted(self.verify_s.items())},
                "draft_step_s": {str(w): s for w, s in sorted(self.draft_step_s.items())},
                "overhead_s": self.overhead_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        return cls(plain_s=float(d["plain_s"]),
                   verify_s={int(n): float(s) for n, s in d["verify_s"].items()},
                   draft_step_s={int(w): float(s) for w, s in d["draft_step_s"].items()},
                   overhead_s=float(d.get("overhead_s", 0.0)))


@dataclass(frozen=True)
class AcceptanceProfile:
    """Acceptance of a target+drafter pair at one temperature.

    `chain[i]`: among cycles that drafted at least i+1 tokens, the fraction that accepted at least i+1
    (the engine's `acceptance_per_position` for a chain). `tree_tau`: tau measured per tree shape, keyed by
    `DraftShape.text`.
    """

    temperature: float
    chain: tuple[float, ...] = ()
    tree_tau: dict[str, float] = field(default_factory=dict)

    def tau(self, shape: DraftShape) -> float | None:
        """Tokens emitted per cycle (bonus included) with `shape`; None when this profile cannot tell."""
        if shape.is_chain:
            k = shape.depth
            return 1.0 + sum(self.chain[:k]) if k <= len(self.chain) else None
        return self.tree_tau.get(shape.text)

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "chain": list(self.chain), "tree_tau": dict(self.tree_tau)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AcceptanceProfile:
        return cls(temperature=float(d.get("temperature", 0.0)),
                   chain=tuple(float(a) for a in d.get("chain", ())),
                   tree_tau={str(k): float(v) for k, v in d.get("tree_tau", {}).items()})


def cycle_seconds(shape: DraftShape, costs: Costs) -> float:
    """Seconds of one speculative cycle with `shape`: drafting, verifying 1 + drafted rows, overhead.

    A chain of k drafts one row per step; a tree drafts its root row, then depth-1 steps of top_k rows."""
    if shape.is_chain:
        drafting = shape.depth * costs.draft_step(1)
    else:
        drafting = costs.draft_step(1) + (shape.depth - 1) * costs.draft_step(shape.top_k)
    return drafting + costs.verify(shape.total + 1) + costs.overhead_s


@dataclass(frozen=True)
class Prediction:
    """Predicted throughput of one shape (None: plain decoding); `speedup` is relative to plain decoding."""

    shape: DraftShape | None
    tau: float
    cycle_s: float
    tokens_per_s: float
    speedup: float

    def to_dict(self) -> dict[str, Any]:
        return {"shape": "plain" if self.shape is None else self.shape.text, "tau": self.tau,
                "cycle_s": self.cycle_s, "tokens_per_s": self.tokens_per_s, "speedup": self.speedup}


def plain_prediction(costs: Costs) -> Prediction:
    """Plain decoding: one token per `plain_s`."""
    return Prediction(None, 1.0, costs.plain_s, 1.0 / costs.plain_s, 1.0)


def predict(shape: DraftShape, costs: Costs, profile: AcceptanceProfile) -> Prediction | None:
    """Predicted throughput of `shape`; None when `profile` has no tau for it."""
    tau = profile.tau(shape)
    if tau is None:
        return None
    cycle_s = cycle_seconds(shape, costs)
    tokens_per_s = tau / cycle_s
    return Prediction(shape, tau, cycle_s, tokens_per_s, tokens_per_s * costs.plain_s)


def predict_all(shapes: Iterable[DraftShape], costs: Costs, profile: AcceptanceProfile) -> list[Prediction]:
    """Plain decoding first, then every shape that `profile` can predict, in the order given."""
    predictions = [plain_prediction(costs)]
    for shape in shapes:
        prediction = predict(shape, costs, profile)
        if prediction is not None:
            predictions.append(prediction)
    return predictions


def choose(costs: Costs, profile: AcceptanceProfile, shapes: Iterable[DraftShape] | None = None,
           min_speedup: float = MIN_SPEEDUP) -> Prediction:
    """The shape with the highest predicted tokens/s (the first on ties), or plain decoding when none is
    predicted at least `min_speedup` times faster than it. `shapes` defaults to `candidate_shapes()`."""
    plain, *predictions = predict_all(candidate_shapes() if shapes is None else shapes, costs, profile)
    if not predictions:
        return plain
    best = max(predictions, key=lambda p: p.tokens_per_s)
    return best if best.speedup >= min_speedup else plain


def candidate_shapes(max_chain: int = 8, trees: Iterable[str] = GPU_TREES, chain_step: int = 1) -> list[DraftShape]:
    """Chains of up to max_chain tokens (every `chain_step`-th length, max_chain always), then the trees given as
    'DEPTH,TOPK,TOTAL'."""
    lengths = sorted({*range(chain_step, max_chain + 1, chain_step), max_chain})
    return [DraftShape.chain(k) for k in lengths] + [DraftShape.parse(t) for t in trees]
