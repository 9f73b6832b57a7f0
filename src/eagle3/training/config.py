"""`TrainConfig`, everything `eagle3 train` needs, with its checks; and `TrainResult`, what a run returns."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError
from eagle3.training.dataset import SORT_WINDOW_ROWS
from eagle3.training.ttt import DEFAULT_STEP_DECAY, DEFAULT_TTT_STEPS


@dataclass
class TrainConfig:
    """Everything `train` needs. Defaults follow official EAGLE-3 where it makes sense (reference §B.5).

    lr: 3e-4 with cosine decay (official 5e-5 is for an 8B target over 40 epochs; SpecForge and speculators
    use 1e-4). AdamW is invariant to the scale of the loss, so our per-token reduction changes only how
    `grad_clip` bites, not the step size.
    Batch: `batch_size` rows or `batch_tokens` padded tokens per optimizer step (global, over all ranks);
    default 16384 tokens. `features`: "online" runs the target per batch, "offline" fills `feature_cache`
    once (resumable) and reads it.
    """

    target: str
    data: str
    out: str
    init: str | None = None  # an existing drafter directory to continue from; else a fresh one for the target
    aux_layer_ids: list[int] | None = None  # vLLM convention; default [2, L//2, L-3] (or spread for shallow targets)
    intermediate_size: int | None = None  # MLP width of a fresh drafter; default the target's
    ttt_steps: int = DEFAULT_TTT_STEPS
    step_decay: float = DEFAULT_STEP_DECAY
    align_top_k: int = 0  # > 0: score only the TTT rows drafting can reach with this top-k (training/ttt.py)
    label_temperature: float = 1.0  # soft labels softmax(target logits / this); 0: one-hot (training/ttt.py)
    lr: float = 3e-4
    min_lr_ratio: float = 0.0  # cosine ends at lr * min_lr_ratio
    warmup_steps: int | None = None  # default: warmup_ratio of the total steps
    warmup_ratio: float = 0.015
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 0.5  # 0 disables
    epochs: int | None = None  # None: 1, or as many as max_steps needs (max_steps then decides, as in HF Trainer)
    max_steps: int | None = None  # caps the run (and sets the schedule length) when given
    time_budget: float | None = None  # seconds from the first step to the written drafter (loading and an
    # offline cache build not counted; steps, logs, validation and checkpoints are): the schedule ends then
    stop_after: int | None = None  # end this invocation (with a checkpoint) after this many steps; resume later
    batch_size: int | None = None
    batch_tokens: int | None = None
    grad_accum: int = 1  # micro-batches per rank and step (memory only; the result does not change)
    max_length: int = 2048
    packing: bool = False
    sort_window: int = SORT_WINDOW_ROWS  # rows sorted by length together before batches are cut (dataset.py)
    dtype: str = "auto"  # target dtype: bf16 on CUDA, fp32 on CPU
    autocast: bool | None = None  # bf16 autocast for the drafter; default on for CUDA, off on CPU
    compile: bool | None = None  # inductor-compile the target's layers and the drafter's norms and MLP
    # (eagle3.training.compiled); default on for CUDA, off on CPU (minutes of compiling for little gain there)
    device: str | None = None  # default cuda:LOCAL_RANK if available, else cpu
    shard_target: bool = False  # FSDP-shard the frozen target over the torchrun ranks (online features only)
    seed: int = 0
    save_every: int = 500  # optimizer steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2
    log_every: int = 10
    features: str = "online"
    feature_cache: str | None = None
    feature_dtype: str = "auto"  # dtype of cached features; auto = the target's
    feature_batch_tokens: int = 16384  # padded tokens per target forward while building the cache
    resume: bool = False
    noise: float = 0.0  # half-width of uniform noise added to the aux features (speculators uses 0.05)
    tensorboard: bool = False  # also write TensorBoard events under out/tensorboard (needs `tensorboard`)
    progress: bool = True
    val_fraction: float = 0.0  # hold out this share of the samples; their loss and accuracy at every checkpoint

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # JSON round trips give lists
        if self.batch_size is None and self.batch_tokens is None:
            self.batch_tokens = max(16384, self.max_length)

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.batch_size is None or self.batch_tokens is None,
             f"batch_size={self.batch_size} and batch_tokens={self.batch_tokens}: give only one")
        need(self.ttt_steps >= 1, f"ttt_steps={self.ttt_steps} must be >= 1 (official EAGLE-3 uses 7)")
        need(0 < self.step_decay <= 1, f"step_decay={self.step_decay} must be in (0, 1]")
        need(self.align_top_k >= 0, f"align_top_k={self.align_top_k} must be >= 0 (0 scores every TTT row; K > 0 "
                                    "only the rows a drafting that keeps each step's top K can reach: 1 for chains)")
        need(self.label_temperature >= 0, f"label_temperature={self.label_temperature} must be >= 0 (1, the default: "
                                          "the target's distribution; below 1 sharper; 0: its argmax as a one-hot)")
        need(self.lr > 0, f"lr={self.lr} must be positive")
        need(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        need(0 <= self.warmup_ratio < 1, f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        need(self.warmup_steps is None or self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps} must be >= 0")
        need(self.epochs is None or self.epochs >= 1, f"epochs={self.epochs} must be >= 1")
        need(self.sort_window >= 1, f"sort_window={self.sort_window} must be >= 1 rows")
        need(self.max_steps is None or self.max_steps >= 1, f"max_steps={self.max_steps} must be >= 1")
        need(self.stop_after is None or self.stop_after >= 1, f"stop_after={self.stop_after} must be >= 1")
        need(self.time_budget is None or self.time_budget > 0,
             f"time_budget={self.time_budget} must be a positive number of seconds")
        need(self.grad_accum >= 1, f"grad_accum={self.grad_accum} must be >= 1")
        need(self.grad_clip >= 0, f"grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        need(self.save_every >= 0, f"save_every={self.save_every} must be >= 0 (0 = only at the end)")
        need(self.keep_checkpoints >= 1, f"keep_checkpoints={self.keep_checkpoints} must be >= 1")
        need(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")
        need(self.noise >= 0, f"noise={self.noise} must be >= 0")
        need(self.intermediate_size is None or self.intermediate_size >= 1,
             f"intermediate_size={self.intermediate_size} must be >= 1 (or unset for the target's MLP width)")
        need(self.features in ("online", "offline"), f"features={self.features!r}: expected 'online' or 'offline'")
        need(self.features == "online" or bool(self.feature_cache),
             "features='offline' needs feature_cache (--feature-cache DIR), where the target's features are written")
        need(not (self.shard_target and self.features == "offline"),
             "shard_target=True (--shard-target) works with features='online' only: each rank builds its own shards "
             "of the offline cache, but a sharded target needs every rank in every forward. Build the cache without "
             "--shard-target where the target fits one device (training from it frees the target), or train with "
             "--features online --shard-target")
        need(all(0 <= b < 1 for b in self.betas) and len(self.betas) == 2, f"betas={self.betas} must be two values in [0, 1)")
        need(0 <= self.val_fraction < 0.5,
             f"val_fraction={self.val_fraction} must be in [0, 0.5): the share of samples held out for validation")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainResult:
    out_dir: Path
    drafter_dir: Path
    steps: int
    epochs_completed: float
    final_loss: float | None
    step_accuracy: list[float] = field(default_factory=list)  # last logged interval, per TTT step
    tokens: int = 0
    seconds: float = 0.0
    last_checkpoint: Path | None = None
    log_file: Path | None = None
    val: dict[str, Any] | None = None  # the last validation record (with val_fraction > 0)
