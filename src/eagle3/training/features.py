"""Target features for training: computed online per batch, or written once to a sharded on-disk cache.

A training step needs, per token, the target's aux hidden states [3·Ht] and its next-token distribution.
`OnlineFeatures` runs the frozen target on each batch (official EAGLE-3, SpecForge online mode).
`FeatureCache` writes them once (speculators/SpecForge offline mode) and serves batches from disk:

    DIR/meta.json                    what the cache was made from (target, data, draft vocab, dtype) + shard layout
    DIR/shard_000000.safetensors     per sample s of the shard: "{s}.aux" [L, 3·Ht], "{s}.logits" [L, Vd]
                                     (target logits restricted to the draft vocabulary), "{s}.argmax" [L] int32
                                     (argmax over the *full* target vocabulary, for the t2d filter and accuracy)

Full-vocabulary logits are never stored: with Vd = 32000 and Ht = 4096 a token costs (3·4096 + 32000)·2 bytes
= 88 KB in bf16 instead of 280 KB for V = 128k. Each shard is written to a temporary name, fsync'ed and
renamed, so an interrupted build resumes by skipping the shards that exist. `FeatureCache.estimate` gives the
bytes still to write; `check_disk` refuses to start when the free space cannot hold them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.config import ConfigError
from eagle3.target import Target
from eagle3.training.checkpoints import fsync_dir
from eagle3.training.dataset import Batch, TrainData
from eagle3.training.ttt import base_mask

CACHE_FORMAT = "eagle3-feature-cache"
CACHE_VERSION = 1
META_FILE = "meta.json"
DEFAULT_SHARD_BYTES = 1 << 30
_HEADER_BYTES_PER_SAMPLE = 300  # safetensors JSON header entries for three tensors
_OPEN_SHARDS = 8


@dataclass
class Features:
    """aux [B, T, 3·Ht]; target_logits [B, T, Vd] (draft vocabulary only); target_argmax [B, T] long (target ids)."""

    aux: torch.Tensor
    target_logits: torch.Tensor
    target_argmax: torch.Tensor


def target_attention_mask(batch: Batch, target: Target) -> torch.Tensor | None:
    """What the target's `attention_mask` takes for `batch`: None (causal) for rows of one document each, or
    for packed rows a block-diagonal causal 4-D mask [B, 1, T, T] (bool for sdpa, additive for eager attention).

    Rows are right-padded, so under plain causal attention a document's tokens see exactly their own prefix
    (padding comes after them) and SDPA can use its causal flash kernel; a padding mask would force a masked
    kernel that computes every query-key pair. Features at padding positions differ but are never used."""
    if not batch.packed:
        return None
    m = base_mask(batch.doc_ids)[:, None]  # [B, 1, T, T]; padding rows see themselves (no NaN rows)
    if getattr(target.model.config, "_attn_implementation", "sdpa") == "eager":
        zeros = torch.zeros(m.shape, dtype=target.dtype, device=m.device)
        return zeros.masked_fill(~m, torch.finfo(target.dtype).min)
    return m


class OnlineFeatures:
    """Run the frozen target on every batch (positions of packed documents are the row's, not restarted:
    RoPE scores depend only on relative positions, so this equals running each document alone)."""

    def __init__(self, target: Target, t2d: torch.Tensor):
        self.target = target
        self.t2d = t2d.to(target.device)
        self.draft_ids = self.t2d.nonzero().squeeze(-1)  # [Vd] ascending target ids (no mask->index per batch)

    def __call__(self, batch: Batch) -> Features:
        aux, logits = self.target.features(batch.input_ids, target_attention_mask(batch, self.target))
        # `Target.features` runs under inference_mode: clone aux into an ordinary tensor autograd may save
        # (ops on inference tensors outside inference mode already return ordinary ones)
        return Features(
            aux=aux.clone(),  # [B, T, 3Ht]
            target_logits=logits.index_select(-1, self.draft_ids),  # [B, T, Vd]
            target_argmax=logits.argmax(-1),  # [B, T]
        )


# ---------------------------------------------------------------------------------------------
# Offline cache
# ---------------------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def target_fingerprint(target: Target) -> dict[str, Any]:
    """Name, config hash and a cheap weight hash (the first 256 values of every parameter)."""
    cfg = {k: v for k, v in target.config.to_dict().items()
           if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
    h = hashlib.sha256()
    for name, p in target.model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return {
        "name_or_path": str(getattr(target.config, "_name_or_path", "") or ""),
        "config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest(),
        "weights_sha256": h.hexdigest(),
    }


def data_fingerprint(data: TrainData) -> dict[str, Any]:
    return {
        "dir": str(data.dataset.dir),
        "rows": len(data),
        "max_length": data.max_length,
        "offsets_sha256": hashlib.sha256(np.ascontiguousarray(data.offsets).tobytes()).hexdigest(),
        "tokenizer_sha256": data.dataset.report.tokenizer.get("vocab_sha256"),
    }


class FeatureCache:
    """A feature cache directory (see the module docstring). Create with `open`, fill with `build`."""

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any]):
        self.path = Path(path)
        self.meta = meta
        self.shards: list[tuple[int, int]] = [tuple(s) for s in meta["shards"]]
        self.dtype = getattr(torch, meta["dtype"])
        self._starts = np.array([a for a, _ in self.shards], dtype=np.int64)
        self._open: OrderedDict[int, Any] = OrderedDict()

    # -- creation -----------------------------------------------------------------------------------
    @staticmethod
    def describe(target: Target, data: TrainData, t2d: torch.Tensor, dtype: torch.dtype,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, Any]:
        """The meta.json a cache of `data` under `target` gets: identity plus the shard layout."""
        ht, vd = target.hidden_size, int(t2d.sum())
        per_token = (3 * ht + vd) * torch.empty((), dtype=dtype).element_size() + 4
        shards: list[list[int]] = []
        start, acc = 0, 0
        for s in range(len(data)):
            if data.trainable[s]:
                acc += int(data.lengths[s]) * per_token + _HEADER_BYTES_PER_SAMPLE
            if acc >= shard_bytes:
                shards.append([start, s + 1])
                start, acc = s + 1, 0
        if start < len(data):
            shards.append([start, len(data)])
        return {
            "format": CACHE_FORMAT,
            "version": CACHE_VERSION,
            "target": target_fingerprint(target),
            "aux_layer_ids": list(target.aux_layer_ids),
            "hidden_size": ht,
            "draft_vocab_size": vd,
            "t2d_sha256": hashlib.sha256(t2d.cpu().numpy().tobytes()).hexdigest(),
            "data": data_fingerprint(data),
            "dtype": str(dtype).removeprefix("torch."),
            "bytes_per_token": per_token,
            "shards": shards,
        }

    @classmethod
    def open(cls, path: str | os.PathLike[str], expected: dict[str, Any], create: bool = True) -> FeatureCache:
        """Open the cache at `path`, creating meta.json if absent (only where `create`), and check that it
        was made from the same target, data, aux layers, draft vocabulary and dtype as `expected`."""
        path = Path(path)
        meta_path = path / META_FILE
        if not meta_path.exists():
            if not create:
                raise ConfigError(f"feature cache {path} has no {META_FILE} (was it created by another rank?)")
            path.mkdir(parents=True, exist_ok=True)
            if any(path.iterdir()):
                raise ConfigError(
                    f"feature cache {path} is not empty and has no {META_FILE}; pass an empty or new directory"
                )
            tmp = path / f".{META_FILE}.tmp"
            tmp.write_text(json.dumps(expected, indent=2) + "\n")
            os.replace(tmp, meta_path)
            return cls(path, expected)
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != CACHE_FORMAT or meta.get("version") != CACHE_VERSION:
            raise ConfigError(f"{path} is not an eagle3 feature cache v{CACHE_VERSION}; pass another directory")
        diff = [k for k in ("target", "aux_layer_ids", "draft_vocab_size", "t2d_sha256", "data", "dtype", "shards")
                if meta.get(k) != expected.get(k)]
        if diff:
            detail = ", ".join(f"{k}: cache {meta.get(k)!r} vs now {expected.get(k)!r}" for k in diff)
            raise ConfigError(
                f"feature cache {path} was written for different inputs ({detail[:600]}); pass a new "
                "--feature-cache directory or delete this one"
            )
        return cls(path, meta)

    # -- building -----------------------------------------------------------------------------------
    def shard_path(self, i: int) -> Path:
        return self.path / f"shard_{i:06d}.safetensors"

    def missing(self) -> list[int]:
        return [i for i in range(len(self.shards)) if not self.shard_path(i).exists()]

    def estimate(self, data: TrainData, shards: list[int] | None = None) -> int:
        """Bytes the shards `shards` (default: all missing ones) will take."""
        total = 0
        for i in self.missing() if shards is None else shards:
            a, b = self.shards[i]
            ok = data.trainable[a:b]
            total += int(data.lengths[a:b][ok].sum()) * self.meta["bytes_per_token"]
            total += int(ok.sum()) * _HEADER_BYTES_PER_SAMPLE
        return total

    def check_disk(self, need: int) -> int:
        """Raise ConfigError when the cache's file system has less than `need` bytes free; return the free bytes."""
        free = shutil.disk_usage(self.path).free
        if need > free:
            raise ConfigError(
                f"feature cache {self.path} needs about {human_bytes(need)} ({need} bytes) more, but only "
                f"{human_bytes(free)} is free; free space, pass another --feature-cache directory, or train "
                "with --features online"
            )
        return free

    @torch.no_grad()
    def build(self, target: Target, data: TrainData, t2d: torch.Tensor, shards: list[int],
              batch_tokens: int = 16384, progress: Any = None) -> None:
        """Write the shards `shards` (skipping any that exist). `progress(n_tokens)` is called per batch."""
        t2d = t2d.to(target.device)
        for i in shards:
            path = self.shard_path(i)
            if path.exists():
                continue
            a, b = self.shards[i]
            ids = [s for s in range(a, b) if data.trainable[s]]
            ids.sort(key=lambda s: -int(data.lengths[s]))
            tensors: dict[str, torch.Tensor] = {}
            for group in _token_groups(ids, data.lengths, batch_tokens):
                batch = data.collate([[s] for s in group]).to(target.device)
                aux, logits = target.features(batch.input_ids, target_attention_mask(batch, target))
                sliced = logits[..., t2d]  # [B, T, Vd]
                argmax = logits.argmax(-1).to(torch.int32)  # [B, T]
                for row, s in enumerate(group):
                    n = int(data.lengths[s])
                    tensors[f"{s}.aux"] = aux[row, :n].to(self.dtype).cpu().contiguous()
                    tensors[f"{s}.logits"] = sliced[row, :n].to(self.dtype).cpu().contiguous()
                    tensors[f"{s}.argmax"] = argmax[row, :n].cpu().contiguous()
                if progress is not None:
                    progress(batch.num_tokens)
            tmp = path.with_name(f".{path.name}.tmp")
            save_file(tensors, str(tmp), metadata={"format": CACHE_FORMAT, "first": str(a), "end": str(b)})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(self.path)

    # -- reading ------------------------------------------------------------------------------------
    def _handle(self, i: int) -> Any:
        if i in self._open:
            self._open.move_to_end(i)
            return self._open[i]
        path = self.shard_path(i)
        if not path.exists():
            raise ConfigError(f"feature cache {self.path} lacks {path.name}; run the build again (it resumes)")
        h = safe_open(str(path), framework="pt", device="cpu")
        self._open[i] = h
        if len(self._open) > _OPEN_SHARDS:
            self._open.popitem(last=False)
        return h

    def load(self, batch: Batch, device: torch.device | str) -> Features:
        """Features for `batch`, zero on padding, placed like its tokens."""
        b, t = batch.input_ids.shape
        ht3, vd = 3 * self.meta["hidden_size"], self.meta["draft_vocab_size"]
        aux = torch.zeros(b, t, ht3, dtype=self.dtype)
        logits = torch.zeros(b, t, vd, dtype=self.dtype)
        argmax = torch.zeros(b, t, dtype=torch.long)
        for row, segs in enumerate(batch.segments):
            for s, start, n in segs:
                h = self._handle(int(np.searchsorted(self._starts, s, side="right")) - 1)
                aux[row, start : start + n] = h.get_tensor(f"{s}.aux")[:n]
                logits[row, start : start + n] = h.get_tensor(f"{s}.logits")[:n]
                argmax[row, start : start + n] = h.get_tensor(f"{s}.argmax")[:n].long()
        return Features(aux.to(device), logits.to(device), argmax.to(device))


def _token_groups(ids: list[int], lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Consecutive groups of `ids` (sorted longest first) whose padded size stays within `batch_tokens`."""
    groups: list[list[int]] = []
    cur: list[int] = []
    for s in ids:
        if cur and (len(cur) + 1) * int(lengths[cur[0]]) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(s)
    if cur:
        groups.append(cur)
    return groups
