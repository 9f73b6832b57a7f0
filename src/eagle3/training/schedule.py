"""The learning-rate schedule (linear warmup, then cosine) and the clock that sizes a time-budgeted run."""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle3.training.config import TrainConfig

# A time-budgeted run (`_Budget`) sizes its schedule again after every step: the steps that fit into the time
# left, at the mean time of its last BUDGET_WINDOW steps (each invocation's first BUDGET_SKIP_STEPS steps, which
# pay allocator warm-up and compilation, only until later ones exist), so the cosine ends when the budget does,
# also where the speed changes under way (a shared machine). It stops at the first step after which the next
# one and the closing writes would not fit.
BUDGET_SKIP_STEPS = 3
BUDGET_WINDOW = 20


def _lr_lambda(cfg: TrainConfig, total: list[int]):
    """Linear warmup, then cosine to lr * min_lr_ratio at step total[0]. `total` is a one-element list read at
    every call, so a time-budgeted run can fix its length after calibration (the warmup length follows it)."""

    def f(step: int) -> float:  # `step` optimizer steps done so far
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * total[0])
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total[0] - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def budget_steps(done: int, seconds_left: float, step_seconds: float, upper: int) -> int:
    """Total optimizer steps of a time-budgeted run: the `done` ones plus `seconds_left` / `step_seconds` rounded
    to the nearest (the run ends within half a step of its budget), at most `upper` (what epochs and max_steps
    allow); `done` (stop now) when none fits, but at least 1."""
    more = int(max(0.0, seconds_left) / max(step_seconds, 1e-9) + 0.5)
    return max(done, 1, min(upper, done + more))


class _Budget:
    """The clock of a time-budgeted run: seconds per step (the mean of the last BUDGET_WINDOW, measured anew by
    each invocation: a resumed run may run on another machine), of the last checkpoint write and per held-out
    batch (these two kept in checkpoints)."""

    def __init__(self, seconds: float, state: dict[str, Any] | None = None):
        state = state or {}
        self.seconds = seconds
        self.window: list[float] = []
        self.early: list[float] = []  # this invocation's first steps (warm-up, compilation)
        self.save_s = float(state.get("save_s", 0.0))
        self.val_batch_s = float(state.get("val_batch_s", 0.0))  # 0: no validation measured yet
        self.agreed: list[float] | None = None  # (elapsed, step, save, val batch) seconds, alike on every rank
        self.pending: torch.Tensor | None = None  # the last step's all-reduced clock (several ranks), unread
        self.said = False

    def add_step(self, seconds: float) -> None:
        if len(self.early) < BUDGET_SKIP_STEPS:
            self.early.append(seconds)
        else:
            self.window = [*self.window, seconds][-BUDGET_WINDOW:]

    def step_seconds(self) -> float:
        times = self.window or self.early
        return sum(times) / len(times) if times else 0.0

    def state(self) -> dict[str, Any]:
        return {"save_s": self.save_s, "val_batch_s": self.val_batch_s}
