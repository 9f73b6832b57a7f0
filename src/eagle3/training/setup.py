"""Setting up a training run (`SetupMixin`, methods of the trainer): the prepared data, the target and its
features (online, or an offline cache), the drafter wrapped with its TTT objective, the optimizer and schedule."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from torch import nn

from eagle3.attention import varying_shape_attention
from eagle3.config import ConfigError, DrafterConfig
from eagle3.drafter import Eagle3Drafter
from eagle3.target import Target, decoder_parts
from eagle3.training import distributed
from eagle3.training.compiled import compile_drafter_pieces, compile_target_layers
from eagle3.training.config import TrainConfig
from eagle3.training.dataset import TrainData
from eagle3.training.features import FeatureCache, OnlineFeatures, human_bytes
from eagle3.training.schedule import _Budget, _lr_lambda
from eagle3.training.ttt import ScoredRows, ttt_loss
from eagle3.training.vocab import draft_ids_to_target

log = logging.getLogger("eagle3")


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


class SetupMixin:
    """Trainer methods that load the data, the target and the drafter, and build what training needs."""

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

