"""Resuming a training run (`ResumeMixin`, methods of the trainer): the state a checkpoint keeps, and its
restore, which refuses a checkpoint whose data order or objective differs from this run's."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from eagle3.config import ConfigError
from eagle3.training.checkpoints import CHECKPOINT_DIR, STATE_FILE, latest_checkpoint, set_rng_state
from eagle3.training.config import TrainConfig
from eagle3.training.dataset import LEGACY_SORT_WINDOW_ROWS
from eagle3.training.schedule import _Budget
from eagle3.training.ttt import DEFAULT_STEP_DECAY

log = logging.getLogger("eagle3")

# fields that fix the data order and the objective; a resumed run must keep them
_RESUME_FIXED = ("data", "seed", "batch_size", "batch_tokens", "packing", "sort_window", "max_length", "ttt_steps",
                 "align_top_k", "label_temperature", "step_decay", "epochs", "val_fraction")
# what runs used before a field of _RESUME_FIXED existed (their checkpoints do not name it)
_RESUME_LEGACY = {"sort_window": LEGACY_SORT_WINDOW_ROWS, "align_top_k": 0, "label_temperature": 1.0,
                  "step_decay": DEFAULT_STEP_DECAY}


class ResumeMixin:
    """Trainer methods that restore a run from its newest checkpoint and collect the state a checkpoint keeps."""

    def _restore(self) -> tuple[int, int, int]:
        """(step, epoch, batch index) to start from: from the newest checkpoint when resuming, else zeros."""
        if not self.cfg.resume:
            return 0, 0, 0
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            if self.ctx.main:
                log.warning("resume: no checkpoint in %s; starting from scratch", self.out / CHECKPOINT_DIR)
            return 0, 0, 0
        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)
        saved = state["config"]
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}  # for fields newer than `saved`
        was = {k: saved.get(k, _RESUME_LEGACY.get(k, defaults[k])) for k in _RESUME_FIXED}
        now = self.cfg.to_dict()
        # epochs=None counts as what it resolves to: a checkpoint of --epochs 1 resumes without the flag, and one
        # written without it resumes with --epochs N only where N is what it ran to
        was["epochs"] = self._epochs_for(was["epochs"], saved.get("max_steps"))
        now["epochs"] = len(self.plan_sizes)
        changed = [k for k in _RESUME_FIXED if was[k] != now.get(k)]
        if changed:
            raise ConfigError(
                f"cannot resume from {ckpt}: {', '.join(f'{k}={was[k]!r}' for k in changed)} differ in this "
                "run; use the same values or a new output directory"
            )
        params = dict(self.drafter.named_parameters())
        missing = [n for n in state["drafter"] if n not in params]
        if missing:
            raise ConfigError(f"checkpoint {ckpt} holds tensors this drafter lacks: {missing[:5]}")
        shapes = [f"{n} {tuple(t.shape)} != {tuple(params[n].shape)}" for n, t in state["drafter"].items()
                  if t.shape != params[n].shape]
        if shapes:
            raise ConfigError(
                f"cannot resume from {ckpt}: its tensors have other shapes than this run's drafter ({shapes[:3]}; "
                f"checkpoint != now); use the same intermediate_size (the checkpoint's run had "
                f"{saved.get('intermediate_size')!r}) or a new output directory"
            )
        with torch.no_grad():
            for n, t in state["drafter"].items():
                params[n].copy_(t)
        if self.budget is not None and state.get("budget_sized"):
            # the length and step times the last invocation had; sizing goes on from there
            self._set_total(int(state["total_steps"]))
            self.budget = _Budget(self.cfg.time_budget, state.get("budget_clock"))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng_file = ckpt / f"rng_rank{self.ctx.rank}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
        if self.ctx.main:
            log.warning("resumed from %s (step %d)", ckpt, state["step"])
        return state["step"], state["epoch"], state["batch_in_epoch"]

    def _state(self, step: int, epoch: int, batch_in_epoch: int) -> dict[str, Any]:
        return {
            "step": step,
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "total_steps": self.total,
            "budget_sized": self.budget is not None,
            "budget_clock": self.budget.state() if self.budget is not None else None,
            "train_seconds": self.train_seconds,
            "drafter": {n: p.detach().cpu().clone() for n, p in self.drafter.named_parameters() if p.requires_grad},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": self.cfg.to_dict(),
        }

