"""`eagle3 train`: train an EAGLE-3 drafter for a target on a prepared folder, with TTT, checkpoints and DDP.

    cfg = TrainConfig(target="stories260k", data="runs/data", out="runs/drafter", max_steps=1000)
    result = train(cfg)            # result.drafter_dir is a speculators-format checkpoint vLLM can serve

One optimizer step consumes one *global* batch from a deterministic plan (`dataset.TrainData.plan_epoch`);
under `torchrun` each rank takes rows `rank::world` of it, splits them into `grad_accum` micro-batches, and the
per-step loss denominators are counted over the whole global batch, so 1 process and N processes (and any
`grad_accum`) compute the same gradient up to float rounding (see `ttt` for the reduction).

Output directory:
    drafter/                     the final drafter (speculators format, `eagle3.formats.save_drafter`)
    checkpoints/step_XXXXXXXX/   drafter/ (same format), training_state.pt (exact fp32 drafter weights,
                                 optimizer, scheduler, data position, config), rng_rank{r}.pt
    train_log.jsonl              one JSON object per log interval
    val_log.jsonl                with --val-fraction: loss and accuracy on the held-out samples at each checkpoint
    train_config.json            the TrainConfig and package versions of the run

Checkpoints are written atomically (`eagle3.training.checkpoints`), so a crash at any point leaves the previous
complete one. `resume=True` continues from the newest one and reaches the same weights as a run that was never
interrupted. Process groups and target sharding live in `eagle3.training.distributed`.

Large targets: the target is frozen and runs forward only. By default every rank holds all of it; with
`shard_target=True` (`--shard-target`, online features under torchrun) each rank holds 1/world of its weights
(FSDP2 `fully_shard` per decoder layer, see `eagle3.training.distributed`) and every target forward
all-gathers them layer by layer. Without it, a target that does not fit one device stops with a ConfigError
that says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from eagle3.attention import varying_shape_attention
from eagle3.config import ConfigError, DrafterConfig
from eagle3.drafter import Eagle3Drafter
from eagle3.target import Target, decoder_parts
from eagle3.training import distributed
from eagle3.training.checkpoints import (
    CHECKPOINT_DIR,
    STATE_FILE,
    latest_checkpoint,
    save_checkpoint,
    set_rng_state,
    truncate_log,
)
from eagle3.training.compiled import compile_drafter_pieces, compile_target_layers
from eagle3.training.dataset import LEGACY_SORT_WINDOW_ROWS, SORT_WINDOW_ROWS, Batch, TrainData, shard_rows
from eagle3.training.distributed import Dist, init_dist
from eagle3.training.features import FeatureCache, Features, OnlineFeatures, human_bytes
from eagle3.training.ttt import DEFAULT_STEP_DECAY, DEFAULT_TTT_STEPS, EARLY_TOKENS, ScoredRows, ttt_loss
from eagle3.training.vocab import draft_ids_to_target

# per-step sums a training step returns (TTTModel.forward after the loss): loss, correct, count, kept, and
# correct/count over labels among their answer's first EARLY_TOKENS tokens
METRIC_ROWS = 6

log = logging.getLogger("eagle3")

LOG_FILE = "train_log.jsonl"
VAL_LOG_FILE = "val_log.jsonl"
CONFIG_FILE = "train_config.json"
# fields that fix the data order and the objective; a resumed run must keep them
_RESUME_FIXED = ("data", "seed", "batch_size", "batch_tokens", "packing", "sort_window", "max_length", "ttt_steps",
                 "align_top_k", "label_temperature", "step_decay", "epochs", "val_fraction")
# what runs used before a field of _RESUME_FIXED existed (their checkpoints do not name it)
_RESUME_LEGACY = {"sort_window": LEGACY_SORT_WINDOW_ROWS, "align_top_k": 0, "label_temperature": 1.0,
                  "step_decay": DEFAULT_STEP_DECAY}
# A time-budgeted run (`_Budget`) sizes its schedule again after every step: the steps that fit into the time
# left, at the mean time of its last BUDGET_WINDOW steps (each invocation's first BUDGET_SKIP_STEPS steps, which
# pay allocator warm-up and compilation, only until later ones exist), so the cosine ends when the budget does,
# also where the speed changes under way (a shared machine). It stops at the first step after which the next
# one and the closing writes would not fit.
BUDGET_SKIP_STEPS = 3
BUDGET_WINDOW = 20


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


# ---------------------------------------------------------------------------------------------
# Model pieces
# ---------------------------------------------------------------------------------------------
class TTTModel(nn.Module):
    """The drafter plus its TTT objective in one `forward`, so DistributedDataParallel can wrap it."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, align_top_k: int,
                 label_temperature: float = 1.0):
        super().__init__()
        self.drafter = drafter
        self.steps, self.decay, self.align_top_k = steps, decay, align_top_k
        self.label_temperature = label_temperature

    def forward(self, aux, input_ids, position_ids, doc_ids, loss_mask, target_logits, target_argmax,
                denominators, scale: float, scored: ScoredRows | None = None):
        out = ttt_loss(self.drafter, aux, input_ids, position_ids, doc_ids, loss_mask, target_logits,
                       target_argmax, self.steps, self.decay, denominators, scale, scored, self.align_top_k,
                       self.label_temperature)
        return (out.loss, out.step_loss_sum, out.step_correct, out.step_count, out.step_kept, out.step_early_correct,
                out.step_early_count)


def _say(msg: str, bar=None) -> None:
    """A line on stderr, above the progress bar (not through it) when there is one."""
    if bar is not None:
        bar.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr, flush=True)


def _load_target(cfg: TrainConfig, device: torch.device, sharded: bool = False):
    """The target and its tokenizer on `device`; `sharded`: in CPU memory, for `distributed.shard_target` to
    place on `device`."""
    from eagle3.models import load_target, resolve_dtype

    try:
        if sharded:  # the dtype `device` would get ("auto": bf16 on CUDA), loaded where the whole model fits
            return load_target(cfg.target, dtype=resolve_dtype(cfg.dtype, device), device="cpu")
        return load_target(cfg.target, dtype=cfg.dtype, device=device)
    except torch.cuda.OutOfMemoryError as e:
        raise ConfigError(
            f"target {cfg.target} does not fit on {device} ({e}); eagle3 train replicates the frozen target on "
            "every GPU unless told to shard it. Under torchrun with several GPUs pass --shard-target (FSDP: each "
            "GPU holds 1/world of the target), or use a device with more memory, a smaller dtype "
            "(--dtype bfloat16), or build an offline feature cache on a larger machine"
        ) from None


def _build_drafter(cfg: TrainConfig, model: nn.Module, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Drafter:
    """A fresh drafter shaped for the target, or the `--init` one, with the data's draft vocabulary."""
    emb = model.get_input_embeddings().weight.detach().float().cpu()
    vd, v = d2t.numel(), t2d.numel()
    if cfg.init:
        from eagle3.formats import load_drafter

        d = load_drafter(cfg.init, target_config=model.config, device="cpu", dtype=torch.float32,
                         target_embedding=emb)
        d.config.acceptance_profile = None  # measured for the starting weights, not for what training makes
        if d.config.draft_vocab_size != vd or not torch.equal(d.draft_ids_to_target(torch.arange(vd)),
                                                               draft_ids_to_target(d2t)):
            raise ConfigError(
                f"--init {cfg.init} has a draft vocabulary of {d.config.draft_vocab_size} ids that differs from the "
                f"data's ({vd} ids in {cfg.data}/vocab.safetensors); prepare the data with the drafter's vocabulary "
                f"(eagle3 prepare --vocab-from {cfg.init}), make the drafter with the data's (eagle3 init-drafter "
                f"--data {cfg.data}), or train from scratch (without --init)"
            )
        if cfg.aux_layer_ids and list(cfg.aux_layer_ids) != list(d.config.aux_layer_ids):
            raise ConfigError(
                f"aux_layer_ids={cfg.aux_layer_ids} differ from --init's {d.config.aux_layer_ids}; drop the option"
            )
        if cfg.intermediate_size is not None and cfg.intermediate_size != d.config.intermediate_size:
            raise ConfigError(
                f"intermediate_size={cfg.intermediate_size} differs from --init's intermediate_size="
                f"{d.config.intermediate_size}; drop --intermediate-size or train from scratch"
            )
        return d.float()
    torch.manual_seed(cfg.seed)
    overrides = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size is not None else {}
    dcfg = DrafterConfig.for_target(model.config, draft_vocab_size=vd, aux_layer_ids=cfg.aux_layer_ids, **overrides)
    if dcfg.vocab_size != v:
        raise ConfigError(
            f"the data's vocab.safetensors covers {v} target ids but the target has vocab_size={dcfg.vocab_size}; "
            "re-run `eagle3 prepare` with this target"
        )
    d = Eagle3Drafter(dcfg)
    d.load_target_embedding(emb)
    if dcfg.uses_draft_vocab:
        d.set_vocab_mapping(draft_ids_to_target(d2t))
    return d


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


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def train(cfg: TrainConfig) -> TrainResult:
    """Train a drafter as `cfg` says (see the module docstring); returns where the result went and final metrics."""
    cfg.validate()
    ctx = init_dist(cfg.device)
    try:
        return _Trainer(cfg, ctx).run()
    finally:
        if ctx.owns_group:
            dist.destroy_process_group()


class _Trainer:
    def __init__(self, cfg: TrainConfig, ctx: Dist):
        self.cfg, self.ctx = cfg, ctx
        if cfg.device:
            self.device = torch.device(cfg.device)
            if self.device.type == "cuda" and self.device.index is None:
                self.device = torch.device("cuda", ctx.local_rank)
        elif torch.cuda.is_available():
            self.device = torch.device("cuda", ctx.local_rank)
        else:
            self.device = torch.device("cpu")
        if self.device.type == "cuda" and (threads := distributed.cuda_host_threads(os.environ,
                                                                                   torch.get_num_threads())):
            log.info("train: %d CPU threads instead of %d (OMP_NUM_THREADS sets another count)", threads,
                     torch.get_num_threads())
            torch.set_num_threads(threads)
        self.out = Path(cfg.out)
        self.use_autocast = cfg.autocast if cfg.autocast is not None else self.device.type == "cuda"
        if self.use_autocast and self.device.type != "cuda":
            raise ConfigError("autocast=True needs a CUDA device; bf16 autocast is off on CPU (fp32 training)")
        self.use_compile = cfg.compile if cfg.compile is not None else self.device.type == "cuda"
        self.tb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("tensorboard=True needs the tensorboard package: pip install tensorboard") from None
            self._summary_writer = SummaryWriter

    # -- setup ----------------------------------------------------------------------------------------
    def _load_data(self) -> None:
        """Read and check the prepared data: before the output folder is made or the target loads."""
        cfg = self.cfg
        if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
            raise ConfigError(f"--out {cfg.out} is a file; give a folder for the drafter and its checkpoints")
        if cfg.init is not None and not Path(cfg.init).exists():
            raise ConfigError(f"--init {cfg.init}: no such drafter folder")
        self.data = TrainData(cfg.data, cfg.max_length)
        if len(self.data.trainable_ids) == 0:
            raise ConfigError(
                f"{cfg.data} has no trainable rows: no sample has a supervised (loss_mask = 1) token at index >= 2 "
                f"within max_length={cfg.max_length}; check the chat template and loss masks (`eagle3 prepare`)"
            )
        self.val_ids = self.data.hold_out(cfg.val_fraction, cfg.seed) if cfg.val_fraction > 0 else None

    def _setup(self) -> None:
        cfg = self.cfg
        self.sharded_target = cfg.shard_target and self.ctx.world > 1
        if cfg.shard_target and not self.sharded_target and self.ctx.main:
            log.warning("shard_target: one process, so --shard-target has no effect (it shards the target over the "
                        "ranks of torchrun --nproc_per_node N > 1); the whole target is loaded")
        model, tokenizer = _load_target(cfg, self.device, sharded=self.sharded_target)
        self.data.dataset.check_tokenizer(tokenizer)
        d2t, t2d = self.data.dataset.vocab_mapping()
        vocab = model.get_output_embeddings().weight.shape[0]
        if d2t.numel() > vocab:
            raise ConfigError(
                f"the data's draft vocabulary has {d2t.numel()} ids, more than the target's vocabulary ({vocab}); "
                "re-run `eagle3 prepare` with --draft-vocab-size <= the target's vocabulary"
            )
        if t2d.numel() != vocab:
            raise ConfigError(
                f"the data was prepared for a vocabulary of {t2d.numel()} ids, the target has {vocab}; "
                "re-run `eagle3 prepare` with this target"
            )
        drafter = _build_drafter(cfg, model, d2t, t2d).to(self.device)
        self.drafter = drafter
        if self.use_compile:
            pieces = compile_drafter_pieces(drafter)
            if self.sharded_target:
                log.warning("compile: the sharded (FSDP) target runs eagerly; only the drafter is compiled")
                layers = 0
            else:
                layers = compile_target_layers(decoder_parts(model)[0])
            if self.ctx.main:
                _say(f"eagle3 train: compiling {layers} target layers and {pieces} drafter pieces with torch.compile "
                     "(the first steps take longer; --eager turns this off)")
        if self.sharded_target:  # after _build_drafter, which reads the target's embedding (and head) in full
            local, full = distributed.shard_target(model, self.device, self.ctx.world)
            if self.ctx.main:
                log.warning("shard_target: the target is sharded over %d ranks (FSDP2); rank 0 holds %d of its %d "
                            "parameters", self.ctx.world, local, full)
        self.target = Target(model, drafter.config.aux_layer_ids)
        if cfg.features == "online":
            if cfg.packing and self.target.sliding_window:
                raise ConfigError(
                    "packing=True with online features needs one block-diagonal mask for every layer, but this "
                    "target has sliding-window layers; train without packing, or with --features offline (the "
                    "cache is built one sample at a time)"
                )
            self.source = OnlineFeatures(self.target, drafter.t2d)
        else:
            self.cache = self._build_cache(drafter.t2d)
            self.source = None
            # the target is needed no more: free its memory (the drafter holds its own embedding copy)
            self.target.close()
            self.target = None
            del model
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.model = TTTModel(drafter, cfg.ttt_steps, cfg.step_decay, cfg.align_top_k, cfg.label_temperature)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        if self.ctx.world > 1:
            self.ddp = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False)
        else:
            self.ddp = self.model
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)
        first = self._plan(0)
        self._epoch_sizes = [len(first)]  # batches per epoch, planned as far as needed so far
        epochs = self._epochs_for(cfg.epochs, cfg.max_steps)
        self._epoch_sizes += [len(self._plan(e)) for e in range(len(self._epoch_sizes), epochs)]
        self.plan_sizes = self._epoch_sizes[:epochs]
        if self.ctx.main:
            _say(f"eagle3 train: {len(first)} batches an epoch; "
                 f"{100 * self.data.real_share(first, self.pad_multiple):.1f} % of their padded tokens are "
                 + ("real (packed rows)" if cfg.packing else
                    f"real (rows length-sorted in windows of --sort-window {cfg.sort_window})"))
        self.val_plan = [] if self.val_ids is None else self.data.plan_epoch(
            0, cfg.seed, batch_rows=cfg.batch_size, batch_tokens=cfg.batch_tokens, packing=cfg.packing,
            ids=self.val_ids, sort_window=cfg.sort_window)
        self.total = sum(self.plan_sizes) if cfg.max_steps is None else min(cfg.max_steps, sum(self.plan_sizes))
        if cfg.max_steps is not None and cfg.max_steps > sum(self.plan_sizes):
            log.warning("max_steps=%d exceeds %d epochs (%d steps); training stops after the epochs",
                        cfg.max_steps, epochs, sum(self.plan_sizes))
        self.upper = self.total  # a time budget can only shorten the run
        self.budget = _Budget(cfg.time_budget) if cfg.time_budget is not None else None
        self.train_seconds = 0.0  # training-loop time over all invocations (a resume adds to it)
        self.schedule_total = [self.total]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg, self.schedule_total))

    def _set_total(self, total: int) -> None:
        self.total = self.schedule_total[0] = total

    @property
    def pad_multiple(self) -> int:
        """Batches are padded to a multiple of this many tokens (`TrainData.collate`)."""
        return 8 if self.device.type == "cuda" else 1

    def _epochs_for(self, epochs: int | None, max_steps: int | None) -> int:
        """`epochs`, or for None one epoch or as many as `max_steps` needs (epochs differ by a batch or two)."""
        if epochs is not None:
            return epochs
        n = 1
        while max_steps and sum(self._epoch_sizes[:n]) < max_steps and self._epoch_sizes[n - 1]:
            n += 1
            if len(self._epoch_sizes) < n:
                self._epoch_sizes.append(len(self._plan(n - 1)))
        return n

    def _plan(self, epoch: int) -> list[list[list[int]]]:
        cfg = self.cfg
        return self.data.plan_epoch(epoch, cfg.seed, batch_rows=cfg.batch_size, batch_tokens=cfg.batch_tokens,
                                    packing=cfg.packing, sort_window=cfg.sort_window)

    def _build_cache(self, t2d: torch.Tensor) -> FeatureCache:
        cfg, ctx = self.cfg, self.ctx
        from eagle3.models import resolve_dtype

        dtype = self.target.dtype if cfg.feature_dtype == "auto" else resolve_dtype(cfg.feature_dtype, self.device)
        expected = FeatureCache.describe(self.target, self.data, t2d.cpu(), dtype)
        ctx.on_main(lambda: FeatureCache.open(cfg.feature_cache, expected), self.device)
        cache = FeatureCache.open(cfg.feature_cache, expected, create=False)
        missing = cache.missing()
        need = cache.estimate(self.data, missing)

        def check_disk() -> None:
            total = cache.estimate(self.data, list(range(len(cache.shards))))
            free = cache.check_disk(need)
            print(f"eagle3 train: feature cache {cache.path}: {len(missing)} of {len(cache.shards)} shards to write, "
                  f"about {human_bytes(need)} ({need} bytes; {human_bytes(total)} in all), "
                  f"{human_bytes(free)} free", file=sys.stderr)

        ctx.on_main(check_disk, self.device)
        mine = [i for i in missing if i % ctx.world == ctx.rank]
        bar = None
        if ctx.main and cfg.progress and mine:
            from tqdm.auto import tqdm

            bar = tqdm(total=sum(int(self.data.lengths[a:b][self.data.trainable[a:b]].sum())
                                 for a, b in (cache.shards[i] for i in mine)),
                       unit="tok", desc="features", unit_scale=True)
        with varying_shape_attention(self.device):
            cache.build(self.target, self.data, t2d, mine, cfg.feature_batch_tokens,
                        progress=bar.update if bar is not None else None)
        if bar is not None:
            bar.close()
        ctx.barrier()
        if cache.missing():
            raise ConfigError(f"feature cache {cache.path} is still incomplete after the build: {cache.missing()[:5]}")
        return cache

    # -- resume ---------------------------------------------------------------------------------------
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

    # -- one step -------------------------------------------------------------------------------------
    def _features(self, batch) -> Features:
        if self.source is not None:
            return self.source(batch)
        return self.cache.load(batch, self.device)

    def _wait(self) -> None:
        """Wait until the device has run every queued step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _to_device(self, x):
        """A host Batch, ScoredRows or tensor on the training device. On CUDA the copy comes from pinned memory
        without waiting, so the host prepares the next batch while the device still runs the previous step (a
        pageable copy, or reading a shape off the device, would make it wait): a training step waits for the
        device only where a log line, checkpoint or validation reads results."""
        if self.device.type != "cuda":
            return x.to(self.device)
        return x.pin_memory().to(self.device, non_blocking=True)

    def _micro_batch(self, rows: list[list[int]], pad: int, zero: bool = False) -> tuple[Batch, ScoredRows]:
        """Collate `rows` and plan their scored rows on the host (`zero`: a zero-weight batch, loss mask all 0),
        then move both to the device."""
        batch = self.data.collate(rows, pad_to_multiple=pad, packed=self.cfg.packing)
        if zero:
            batch.loss_mask.zero_()
        scored = ScoredRows.of(batch.loss_mask, batch.doc_ids, self.cfg.ttt_steps)
        return self._to_device(batch), self._to_device(scored)

    def _denominators(self, rows: list[list[int]]) -> torch.Tensor:
        """N_k [K] of the global batch `rows` on the device."""
        return self._to_device(self.data.step_denominators(rows, self.cfg.ttt_steps).to(torch.float32))

    def _objective(self, batch: Batch, scored: ScoredRows, den: torch.Tensor, module: nn.Module,
                   noise: float = 0.0):
        """The TTT objective on one collated batch through `module` (the DDP wrapper to train, the bare model to
        validate): (loss, metric sums...). `noise`: uniform noise of that half-width on the target's features."""
        feats = self._features(batch)
        aux = feats.aux
        if noise > 0:
            aux = aux + (torch.rand_like(aux, dtype=torch.float32) * 2 - 1).to(aux.dtype) * noise
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if self.use_autocast else contextlib.nullcontext()
        with amp:
            return module(aux, batch.input_ids, batch.position_ids, batch.doc_ids, batch.loss_mask,
                          feats.target_logits, feats.target_argmax, den, float(self.ctx.world), scored)

    def _step(self, rows: list[list[int]]) -> tuple[torch.Tensor, int, torch.Tensor, float]:
        """One optimizer step on a global batch; returns (local metric sums [METRIC_ROWS, K], local tokens, grad
        norm (a device scalar: reading it waits for the step), lr). N_k comes from the global batch `rows`."""
        cfg, ctx = self.cfg, self.ctx
        den = self._denominators(rows)  # [K] global N_k
        mine = shard_rows(rows, ctx.rank, ctx.world)
        dummy = not mine  # fewer rows than ranks: run row 0 with zero weight so the gradient all-reduce happens
        if dummy:
            mine = rows[:1]
        parts = [(list(p), dummy) for p in np.array_split(np.arange(len(mine)), min(cfg.grad_accum, len(mine)))]
        if self.sharded_target:
            # A sharded target's forward all-gathers each layer's weights, which needs every rank, so all ranks
            # run the same number of micro-batches. Ranks differ by at most one row (rows rank::world), so they
            # differ only where grad_accum exceeds a rank's rows: rank 0 has the most, ceil(len(rows) / world).
            # The others append zero-weight micro-batches (their gradient is exactly zero, as for `dummy`) at
            # the end, so the last micro-batch, which runs DDP's gradient all-reduce, is last on every rank.
            most = min(cfg.grad_accum, len(rows[0 :: ctx.world]))
            parts += [([len(mine) - 1], True)] * (most - len(parts))
        metrics = torch.zeros(METRIC_ROWS, cfg.ttt_steps, device=self.device)
        tokens = 0
        self.optimizer.zero_grad(set_to_none=True)
        pad = self.pad_multiple
        with varying_shape_attention(self.device):  # every batch has its own padded length
            for j, (idx, zero) in enumerate(parts):
                batch, scored = self._micro_batch([mine[i] for i in idx], pad, zero)
                if not zero:
                    tokens += batch.num_tokens
                last = j == len(parts) - 1
                sync = contextlib.nullcontext() if (last or ctx.world == 1) else self.ddp.no_sync()
                with sync:
                    loss, *sums = self._objective(batch, scored, den, self.ddp, cfg.noise)
                    loss.backward()
                metrics += torch.stack(sums).detach()  # [METRIC_ROWS, K]
        if cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params]))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return metrics, tokens, grad_norm, lr

    @torch.no_grad()
    def _validate(self, step: int, epoch: float, bar=None, limit: int | None = None) -> dict[str, Any]:
        """The TTT objective's loss and accuracies on the held-out samples (no gradients), summed over every rank
        and appended to val_log.jsonl. Every rank runs every batch (a zero-weight row where it has none), as a
        sharded target needs. `limit`: only the first that many batches (what a time budget leaves room for)."""
        cfg, ctx = self.cfg, self.ctx
        w = torch.zeros(METRIC_ROWS, cfg.ttt_steps, device=self.device)
        pad = self.pad_multiple
        plan = self.val_plan[:limit]
        with varying_shape_attention(self.device):
            for rows in plan:
                den = self._denominators(rows)
                mine = shard_rows(rows, ctx.rank, ctx.world)
                batch, scored = self._micro_batch(mine or rows[:1], pad, zero=not mine)
                _, *sums = self._objective(batch, scored, den, self.model)
                w += torch.stack(sums)
        ctx.all_reduce(w)
        samples = len(self.val_ids) if len(plan) == len(self.val_plan) else sum(len(r) for b in plan for r in b)
        rec = {"step": step, "epoch": round(epoch, 4), "samples": samples, **self._metrics(w.cpu())}
        if ctx.main:
            with open(self.out / VAL_LOG_FILE, "a") as f:
                f.write(json.dumps(rec) + "\n")
            acc = rec["acc_per_step"]
            _say(f"eagle3 train: step {step}, held-out samples: loss {rec['loss']:.4f}, accuracy step 0 "
                 f"{acc[0]:.3f}, step {len(acc) - 1} {acc[-1]:.3f}", bar)
            if self.tb is not None:
                self.tb.add_scalar("val/loss", rec["loss"], step)
                for k, a in enumerate(acc):
                    self.tb.add_scalar(f"val_acc/step{k}", a, step)
        return rec

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        cfg, ctx = self.cfg, self.ctx
        started = time.perf_counter()
        if not cfg.resume and latest_checkpoint(self.out) is not None:
            raise ConfigError(
                f"{self.out} holds checkpoints of an earlier run ({latest_checkpoint(self.out).name}); pass "
                "resume=True (--resume) to continue it, or choose a new output directory"
            )
        self._load_data()
        if ctx.main:
            self.out.mkdir(parents=True, exist_ok=True)
        ctx.barrier()
        self._setup()
        step, epoch, bi = self._restore()
        log_path = self.out / LOG_FILE
        if ctx.main:
            self._write_config()
            truncate_log(log_path, step)
            if self.val_plan:
                truncate_log(self.out / VAL_LOG_FILE, step)
            if cfg.tensorboard:
                self.tb = self._summary_writer(str(self.out / "tensorboard"))
        bar = None
        if ctx.main and cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total, initial=step, desc="train", unit="step", dynamic_ncols=True)
        window = torch.zeros(METRIC_ROWS, cfg.ttt_steps, device=self.device)
        window_tokens, window_start, total_tokens = 0, time.perf_counter(), 0
        last_record: dict[str, Any] | None = None
        last_val: dict[str, Any] | None = None
        last_ckpt = latest_checkpoint(self.out) if cfg.resume else None
        plan = self._plan(epoch) if step < self.total else []
        first = step
        end = self.total if cfg.stop_after is None else min(self.total, first + cfg.stop_after)
        clock_start = time.perf_counter() - self.train_seconds  # the budget's clock (it goes on over a resume)
        mark = time.perf_counter()
        while step < end:
            if bi >= len(plan):
                epoch, bi = epoch + 1, 0
                plan = self._plan(epoch)
                continue
            metrics, tokens, grad_norm, lr = self._step(plan[bi])  # queued: the host does not wait here
            step, bi = step + 1, bi + 1
            if self.budget is not None:
                self.budget.add_step(time.perf_counter() - mark)
                self._size_budget(step, clock_start, bar)
                end = self.total if cfg.stop_after is None else min(self.total, first + cfg.stop_after)
            self.train_seconds = time.perf_counter() - clock_start
            window += metrics
            window_tokens += tokens
            if bar is not None:
                bar.update(1)
            if step % cfg.log_every == 0 or step == end:
                stats = torch.cat([window.flatten(), torch.tensor([float(window_tokens)], device=self.device)])
                ctx.all_reduce(stats)
                w = stats[:-1].view(METRIC_ROWS, cfg.ttt_steps).cpu()
                n_tok = int(stats[-1].item())
                total_tokens += n_tok
                elapsed = time.perf_counter() - window_start
                last_record = self._record(step, epoch + bi / max(1, len(plan)), w, n_tok, elapsed, float(grad_norm),
                                           lr)
                if ctx.main:
                    with open(log_path, "a") as f:
                        f.write(json.dumps(last_record) + "\n")
                    if bar is not None:
                        acc = last_record["acc_per_step"]
                        bar.set_postfix(loss=f"{last_record['loss']:.3f}", acc0=f"{acc[0]:.2f}",
                                        lr=f"{last_record['lr']:.2e}")
                    if self.tb is not None:
                        self._tensorboard(last_record)
                window.zero_()
                window_tokens, window_start = 0, time.perf_counter()
            if (cfg.save_every and step % cfg.save_every == 0) or step == end:
                t_val = time.perf_counter()
                if self.val_plan:
                    limit = self._val_limit(step == end)
                    last_val = self._validate(step, epoch + bi / max(1, len(plan)), bar, limit)
                    if self.budget is not None:
                        self._wait()
                        n = len(self.val_plan[:limit])
                        self.budget.val_batch_s = (time.perf_counter() - t_val) / max(1, n)
                t_save = time.perf_counter()
                self.train_seconds = t_save - clock_start
                last_ckpt = save_checkpoint(ctx, self.out, step, self.drafter, self._state(step, epoch, bi),
                                             cfg.keep_checkpoints)
                if self.budget is not None:
                    self.budget.save_s = time.perf_counter() - t_save
            mark = time.perf_counter()
        if bar is not None:
            bar.close()
        drafter_dir = self.out / "drafter"
        if ctx.main:
            from eagle3.formats import save_drafter

            if step >= self.total:  # a run cut short by stop_after leaves only its checkpoint
                save_drafter(self.drafter, drafter_dir, format="speculators")
            if self.budget is not None:
                spent = time.perf_counter() - clock_start
                _say(f"eagle3 train: time budget {self.cfg.time_budget:g} s: stopped after {step} steps, "
                     f"{spent:.1f} s spent (steps, logs, validation and checkpoints)")
            if self.tb is not None:
                self.tb.close()
        ctx.barrier()
        return TrainResult(
            out_dir=self.out,
            drafter_dir=drafter_dir,
            steps=step,
            epochs_completed=epoch + bi / max(1, len(plan)),
            final_loss=last_record["loss"] if last_record else None,
            step_accuracy=last_record["acc_per_step"] if last_record else [],
            tokens=total_tokens,
            seconds=time.perf_counter() - started,
            last_checkpoint=last_ckpt,
            log_file=log_path,
            val=last_val,
        )

    def _size_budget(self, step: int, clock_start: float, bar=None) -> None:
        """Size a time-budgeted run after `step`: the steps done plus those that fit into the time left, less what
        closing takes (a held-out pass, the last checkpoint and the drafter, as long as they last took). Under
        torchrun the ranks use their mean clock, all-reduced one step late, so the host does not wait for the
        device and every rank stops at the same step."""
        b, ctx = self.budget, self.ctx
        clock = [time.perf_counter() - clock_start, b.step_seconds(), b.save_s, b.val_batch_s]
        if ctx.world > 1:
            t = ctx.all_reduce(self._to_device(torch.tensor(clock, dtype=torch.float64)))
            prev, b.pending = b.pending, t
            if prev is None:
                return
            clock = (prev / ctx.world).tolist()
            clock[0] += clock[1]  # the step queued since
        elif self.device.type == "cuda" and b.agreed is not None and self.total - step <= 2:
            self._wait()  # near the end, time what the device finished, not what the host handed it
            clock[0] = time.perf_counter() - clock_start
        b.agreed = clock
        elapsed, step_s, save_s, _ = clock
        val_s = self._val_seconds(len(self.val_plan))
        per_step = step_s + ((save_s + val_s) / self.cfg.save_every if self.cfg.save_every else 0.0)
        self._set_total(budget_steps(step, b.seconds - elapsed - val_s - 2 * save_s, per_step, self.upper))
        if bar is not None:
            bar.total = self.total
            bar.refresh()
        if self.ctx.main and not b.said and (len(b.window) >= BUDGET_WINDOW or self.total <= step):
            b.said = True
            epochs = self.total / max(1, self.plan_sizes[0])
            _say(f"eagle3 train: time budget {b.seconds:g} s, {elapsed:.0f} s spent: {step_s:.3f} s/step -> "
                 f"{self.total} steps in all (about {epochs:.2f} epochs; {self.upper} without the budget), sized "
                 "again after every step", bar)

    def _val_seconds(self, batches: int) -> float:
        """What `batches` held-out batches take: as long as the last validation's, or at most a training step."""
        b = self.budget
        per = b.agreed[3] if b.agreed and b.agreed[3] > 0 else (b.agreed[1] if b.agreed else 0.0)
        return batches * per

    def _val_limit(self, closing: bool) -> int | None:
        """How many held-out batches fit into the budget's time left (None: all; at least 1)."""
        if self.budget is None or self.budget.agreed is None:
            return None
        elapsed, _, save_s, _ = self.budget.agreed
        left = self.budget.seconds - elapsed - save_s * (2 if closing else 1)
        per = self._val_seconds(1)
        return None if per <= 0 else max(1, min(len(self.val_plan), int(left / per)))

    def _metrics(self, w: torch.Tensor) -> dict[str, Any]:
        """Loss and accuracies from summed metrics w [METRIC_ROWS, K] (on the CPU)."""
        loss_sum, correct, count, kept, early_correct, early_count = w  # each [K]
        count = count.clamp_min(1)
        decay = torch.tensor([self.cfg.step_decay**k for k in range(self.cfg.ttt_steps)])
        return {
            "loss": float((decay * loss_sum / count).sum()),
            "loss_per_step": [round(x, 6) for x in (loss_sum / count).tolist()],
            "acc_per_step": [round(x, 6) for x in (correct / count).tolist()],
            # the same over labels among the first `early_tokens` tokens of their answer (closer to acceptance)
            "acc_early_per_step": [round(x, 6) for x in (early_correct / early_count.clamp_min(1)).tolist()],
            "early_tokens": EARLY_TOKENS,
            "in_draft_vocab": round(float(kept[0] / count[0]), 6),
            # share of each step's rows that add loss (in the draft vocabulary and, with --align-top-k, reachable)
            "scored_per_step": [round(x, 6) for x in (kept / count).tolist()],
            "supervised_tokens": int(w[2, 0].item()),
        }

    def _record(self, step: int, epoch: float, w: torch.Tensor, tokens: int, elapsed: float,
                grad_norm: float, lr: float) -> dict[str, Any]:
        return {
            "step": step,
            "epoch": round(epoch, 4),
            "lr": lr,  # the learning rate of this interval's last step
            **self._metrics(w),
            "tokens": tokens,
            "tokens_per_s": round(tokens / max(elapsed, 1e-9), 2),
            "grad_norm": round(grad_norm, 6),
        }

    def _tensorboard(self, rec: dict[str, Any]) -> None:
        s = rec["step"]
        self.tb.add_scalar("train/loss", rec["loss"], s)
        self.tb.add_scalar("train/lr", rec["lr"], s)
        self.tb.add_scalar("train/tokens_per_s", rec["tokens_per_s"], s)
        for k, (lo, acc) in enumerate(zip(rec["loss_per_step"], rec["acc_per_step"], strict=True)):
            self.tb.add_scalar(f"loss/step{k}", lo, s)
            self.tb.add_scalar(f"acc/step{k}", acc, s)

    def _write_config(self) -> None:
        import transformers

        record = {
            "config": self.cfg.to_dict(),
            "drafter": self.drafter.config.to_dict(),
            "world_size": self.ctx.world,
            "device": str(self.device),
            "compiled": self.use_compile,  # what `compile` (None: by device) resolved to
            "autocast": self.use_autocast,
            "argv": sys.argv,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": sys.version.split()[0]},
        }
        tmp = self.out / f".{CONFIG_FILE}.tmp"
        tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / CONFIG_FILE)
