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
interrupted. Process groups and target sharding live in `eagle3.training.distributed`. The run's other parts:
`config` (TrainConfig), `setup` (data, target, drafter, optimizer), `step` (a step and a validation pass),
`resume` (checkpoint state) and `schedule` (learning rate, time budget), all in `eagle3.training`.

Large targets: the target is frozen and runs forward only. By default every rank holds all of it; with
`shard_target=True` (`--shard-target`, online features under torchrun) each rank holds 1/world of its weights
(FSDP2 `fully_shard` per decoder layer, see `eagle3.training.distributed`) and every target forward
all-gathers them layer by layer. Without it, a target that does not fit one device stops with a ConfigError
that says so.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagle3.config import ConfigError
from eagle3.training import distributed
from eagle3.training.checkpoints import latest_checkpoint, save_checkpoint, truncate_log
from eagle3.training.config import TrainConfig, TrainResult
from eagle3.training.distributed import Dist, init_dist
from eagle3.training.resume import ResumeMixin
from eagle3.training.schedule import BUDGET_SKIP_STEPS, BUDGET_WINDOW, budget_steps
from eagle3.training.setup import SetupMixin, _say
from eagle3.training.step import METRIC_ROWS, VAL_LOG_FILE, StepMixin

log = logging.getLogger("eagle3")

LOG_FILE = "train_log.jsonl"
CONFIG_FILE = "train_config.json"


def train(cfg: TrainConfig) -> TrainResult:
    """Train a drafter as `cfg` says (see the module docstring); returns where the result went and final metrics."""
    cfg.validate()
    ctx = init_dist(cfg.device)
    try:
        return _Trainer(cfg, ctx).run()
    finally:
        if ctx.owns_group:
            dist.destroy_process_group()


class _Trainer(SetupMixin, ResumeMixin, StepMixin):
    """One run: `run` is the loop and the time budget's sizing; setup, resume and the step are its mixins."""

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
            sized = time.perf_counter()
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
            logged = time.perf_counter()
            if (cfg.save_every and step % cfg.save_every == 0) or step == end or self._time_closing(step, first):
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
            mark = time.perf_counter() - (logged - sized)  # the next step's time carries this one's logging
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

    def _time_closing(self, step: int, first: int) -> bool:
        """Whether to checkpoint now only to time it: a budgeted run that has not yet measured a checkpoint does so
        once its early steps are done, so the closing writes are counted when it is sized, not after."""
        b = self.budget
        return b is not None and b.save_s == 0.0 and step == first + BUDGET_SKIP_STEPS and step < self.total

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
