"""One training step and one validation pass (`StepMixin`, methods of the trainer): micro-batches on the device,
the TTT objective through the drafter, the optimizer step, and the metrics their sums give."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import numpy as np
import torch
from torch import nn

from eagle3.attention import varying_shape_attention
from eagle3.training.dataset import Batch, shard_rows
from eagle3.training.features import Features
from eagle3.training.setup import _say
from eagle3.training.ttt import EARLY_TOKENS, ScoredRows

# per-step sums a training step returns (TTTModel.forward after the loss): loss, correct, count, kept, and
# correct/count over labels among their answer's first EARLY_TOKENS tokens
METRIC_ROWS = 6

VAL_LOG_FILE = "val_log.jsonl"


class StepMixin:
    """Trainer methods for one optimizer step and one pass over the held-out samples."""

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
