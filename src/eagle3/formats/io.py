"""Read and write drafter checkpoint directories: `config.json` plus `model.safetensors`.

Reading also accepts sharded safetensors (`model.safetensors.index.json`) and `pytorch_model.bin`. Weight names
are canonicalised to eagle3's, which are speculators' (`layers.0.*`): native EAGLE-3's `midlayer.*` becomes
`layers.0.*`, a `model.` prefix is dropped, and speculators' frozen verifier tensors are skipped. Saving writes
the chosen format's names (`midlayer.*` for native) and replaces the directory atomically.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eagle3.config import ConfigError, DrafterConfig
from eagle3.drafter import Eagle3Drafter
from eagle3.formats.configs import (
    FORMATS,
    _dtype_name,
    _torch_dtype,
    config_from_dict,
    detect_format,
    native_config_dict,
    speculators_config_dict,
)
from eagle3.formats.validate import check_vocab_mapping, validate_against_target

log = logging.getLogger("eagle3.formats")

WEIGHTS_NAME = "model.safetensors"
# files save_drafter may replace when it overwrites an earlier checkpoint directory
_CHECKPOINT_FILES = {
    "config.json",
    "config.py",
    WEIGHTS_NAME,
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "generation_config.json",
}
# speculators keeps frozen verifier tensors that are not part of the drafter (`core.py` _keys_to_ignore_on_save)
_IGNORED_WEIGHTS = ("verifier_lm_head.weight", "verifier_norm.weight")


# ---------------------------------------------------------------------------------------------
# reading and loading
# ---------------------------------------------------------------------------------------------
def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if (path / WEIGHTS_NAME).exists():
        return load_file(str(path / WEIGHTS_NAME))
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for f in files for k, v in load_file(str(path / f)).items()}
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ConfigError(f"{path} has no {WEIGHTS_NAME}, model.safetensors.index.json or pytorch_model.bin")


def read_vocab_mapping(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) of a saved drafter (either format), e.g. to prepare new data with the
    vocabulary of a drafter that training will continue from."""
    path = Path(path)
    sd = _canonical_names(_read_weights(path))
    missing = [k for k in ("d2t", "t2d") if k not in sd]
    if missing:
        raise ConfigError(f"{path} has no {' / '.join(missing)}: it is not an EAGLE-3 drafter with a draft vocabulary")
    return sd["d2t"].to(torch.int64), sd["t2d"].to(torch.bool)


def _canonical_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Native/vLLM names to eagle3's (`midlayer.` -> `layers.0.`, optional `model.` prefix dropped)."""
    out = {}
    for name, t in sd.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        out[name] = t
    return out


def read_checkpoint(
    path: str | os.PathLike, target_config: Any = None, require_layer_count: bool = False
) -> tuple[DrafterConfig, dict, str]:
    """(DrafterConfig, state dict with eagle3 names, format) of a checkpoint directory; nothing is built.

    `target_config` supplies what the config may lack (layer count, default aux ids); `require_layer_count` is
    `config_from_dict`'s (export sets it so a guessed layer count is never written out)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ConfigError(f"{path} has no config.json; expected a drafter checkpoint directory")
    config = json.loads(cfg_file.read_text())
    raw = _read_weights(path)
    fmt = detect_format(config, list(raw))
    sd = {k: v for k, v in _canonical_names(raw).items() if k not in _IGNORED_WEIGHTS}
    head = sd.get("lm_head.weight")
    cfg = config_from_dict(config, fmt, target_config, None if head is None else head.shape[0], require_layer_count)
    return cfg, sd, fmt


def _fill_state(drafter: Eagle3Drafter, sd: dict[str, torch.Tensor]) -> None:
    """Copy `sd` into `drafter`, naming any missing, unknown or misshapen tensor."""
    own = drafter.state_dict()
    unknown = sorted(set(sd) - set(own))
    if unknown:
        raise ConfigError(f"checkpoint has weights this drafter config does not use: {unknown[:8]}")
    optional = {"embed_tokens.weight", "d2t", "t2d"}
    missing = sorted(set(own) - set(sd) - optional)
    if missing:
        raise ConfigError(f"checkpoint lacks weights the config needs: {missing[:8]}")
    for name, t in sd.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise ConfigError(
                f"weight {name} has shape {tuple(t.shape)}, the config implies {tuple(own[name].shape)}"
            )
    drafter.load_state_dict(sd, strict=False)


def load_drafter(
    path: str | os.PathLike,
    target_config: Any = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    target_embedding: torch.Tensor | nn.Module | None = None,
    require_embedding: bool = True,
) -> Eagle3Drafter:
    """Load a drafter saved in either format (auto-detected), optionally checking it against `target_config`.

    Embedding rule: the checkpoint's `embed_tokens.weight` is used when present. Otherwise `target_embedding`
    (the target's input embedding, a `[V, H]` tensor or a module / model with `get_input_embeddings`) is copied
    in. Without either, decoding is impossible, so a ConfigError is raised unless `require_embedding=False`, in
    which case the embedding is filled with NaN (any use shows) and only conversion (e.g. `export_drafter`) is safe.
    `dtype=None` keeps the checkpoint's floating dtype.
    """
    cfg, sd, fmt = read_checkpoint(path, target_config)
    drafter = _build(cfg, sd, path, target_config, target_embedding, require_embedding)
    cast_drafter(drafter, dtype if dtype is not None else sd["fc.weight"].dtype, device)
    log.info("loaded %s-format drafter from %s", fmt, path)
    return drafter.eval()


def cast_drafter(
    drafter: Eagle3Drafter, dtype: torch.dtype | str, device: torch.device | str | None = None
) -> Eagle3Drafter:
    """Move `drafter` to `device` and its weights to `dtype`, keeping the RoPE frequencies in fp32.

    `module.to(bfloat16)` would also round the rotary `inv_freq` buffer to bf16, which shifts rotation angles
    by several percent at long positions; vLLM and HF compute RoPE from fp32 frequencies.
    """
    dtype = _torch_dtype(dtype)
    drafter.to(device=device)
    for name, child in drafter.named_children():
        if name != "rotary_emb":
            child.to(dtype=dtype)
    drafter.config.torch_dtype = _dtype_name(dtype)
    return drafter


def _build(
    cfg: DrafterConfig,
    sd: dict[str, torch.Tensor],
    path: Any,
    target_config: Any,
    target_embedding: torch.Tensor | nn.Module | None,
    require_embedding: bool,
) -> Eagle3Drafter:
    """An fp32 CPU drafter holding checkpoint tensors `sd` (see `load_drafter` for the embedding rule)."""
    if target_config is not None:
        validate_against_target(cfg, target_config, sd.get("d2t"), sd.get("t2d"))
    else:
        check_vocab_mapping(cfg, sd.get("d2t"), sd.get("t2d"))
    if cfg.uses_draft_vocab and "t2d" not in sd:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + sd["d2t"].long()] = True  # derived: t2d is fixed by d2t
        sd["t2d"] = t2d
    drafter = Eagle3Drafter(cfg)
    _fill_state(drafter, sd)
    if "embed_tokens.weight" not in sd:
        weight = _embedding_weight(target_embedding)
        if weight is not None:
            drafter.load_target_embedding(weight.detach().to("cpu", drafter.embed_tokens.weight.dtype))
        elif require_embedding:
            raise ConfigError(
                f"{path} has no embed_tokens.weight (official EAGLE-3 checkpoints leave it out); pass "
                "target_embedding=<target>.get_input_embeddings().weight so the drafter can embed tokens"
            )
        else:
            log.info(
                "%s has no embed_tokens.weight; the drafter's embedding is NaN until one is loaded", path
            )
            with torch.no_grad():
                drafter.embed_tokens.weight.fill_(float("nan"))
    return drafter


def _embedding_weight(target_embedding: torch.Tensor | nn.Module | None) -> torch.Tensor | None:
    if target_embedding is None or isinstance(target_embedding, torch.Tensor):
        return target_embedding
    if hasattr(target_embedding, "get_input_embeddings"):
        target_embedding = target_embedding.get_input_embeddings()
    weight = getattr(target_embedding, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ConfigError(
            f"target_embedding of type {type(target_embedding).__name__} has no embedding weight"
        )
    return weight


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------
def drafter_state_dict(
    drafter: Eagle3Drafter, fmt: str, include_embedding: bool = True, dtype: torch.dtype | str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of format `fmt` holds, with that format's names; d2t/t2d only for a draft vocab."""
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt!r}: expected one of {FORMATS}")
    dtype = _torch_dtype(dtype)
    out = {}
    for name, t in drafter.state_dict().items():
        if name in ("d2t", "t2d"):
            if not drafter.config.uses_draft_vocab:
                continue
            t = t.to(torch.int64 if name == "d2t" else torch.bool)
        elif name == "embed_tokens.weight" and not include_embedding:
            continue
        elif dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if fmt == "eagle" and name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        out[name] = t.detach().to("cpu").contiguous().clone()
    return out


def _replaceable(out_dir: Path) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ConfigError(f"{out_dir} exists and is not a directory; choose a new checkpoint directory")
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in _CHECKPOINT_FILES)
    if others:
        raise ConfigError(
            f"{out_dir} holds files that are not part of a drafter checkpoint ({others[:5]}); refusing to replace "
            "it. Choose an empty or new directory"
        )


def save_drafter(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike,
    format: str = "speculators",
    include_embedding: bool = True,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Write `drafter` to `out_dir` as `config.json` + `model.safetensors`, atomically; returns the directory.

    `format` is 'speculators' (for `vllm serve`) or 'eagle' (native EAGLE-3, for SGLang). The checkpoint is
    written to a temporary sibling directory and renamed into place, so a crash never leaves half a checkpoint.
    An existing `out_dir` is replaced only if it is empty or holds only checkpoint files.
    """
    cfg = drafter.config
    dtype = _torch_dtype(dtype) or next(drafter.fc.parameters()).dtype
    writers = {"speculators": speculators_config_dict, "eagle": native_config_dict}
    if format not in writers:
        raise ConfigError(f"format={format!r}: expected one of {FORMATS}")
    config = writers[format](cfg, dtype)
    if format == "speculators" and not cfg.verifier_name_or_path:
        log.warning(
            "drafter config has no verifier_name_or_path: `vllm serve %s` needs it to find the target, and "
            "speculators 0.9's from_pretrained fails without it. Set DrafterConfig.verifier_name_or_path",
            out_dir,
        )
    if include_embedding and bool(drafter.embed_tokens.weight.isnan().any()):
        raise ConfigError(
            "the drafter's embedding is unset (NaN: it was loaded without one); save with include_embedding=False "
            "or load the target's embedding first (Eagle3Drafter.load_target_embedding)"
        )
    tensors = drafter_state_dict(drafter, format, include_embedding, dtype)
    out_dir = Path(out_dir)
    _replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is read by servers running as other users
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS_NAME, 0o644)  # safetensors creates files 0600
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
        old = None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "ckpt")
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if old is not None:
                os.replace(old / "ckpt", out_dir)  # put the previous checkpoint back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("saved %s-format drafter to %s", format, out_dir)
    return out_dir


# a folder of eagle3's GGUF cache: `<cache>/gguf/<stem>-<16 hex>-<dtype>` (models._gguf_cache_folder)
_GGUF_CACHE_NAME = re.compile(r"[\\/]gguf[\\/][^\\/]+-[0-9a-f]{16}-(?:float32|bfloat16|float16)[\\/]?$")


def _set_verifier_name(cfg: DrafterConfig, name: str | None) -> None:
    """Record the verifier as `name`, or replace a private GGUF cache path with the public name (see export)."""
    if name is not None:
        if not name.strip():
            raise ConfigError("--verifier-name is empty; give the target's hub id or path, as `vllm serve` takes it")
        cfg.verifier_name_or_path = name.strip()
        return
    recorded = cfg.verifier_name_or_path
    if not recorded or not _GGUF_CACHE_NAME.search(recorded):
        return
    from eagle3.models import public_name_of_cache

    public = public_name_of_cache(recorded)
    if public:
        log.warning("the drafter names eagle3's converted GGUF copy %s as its verifier; exporting %s instead",
                    recorded, public)
        cfg.verifier_name_or_path = public
    else:
        log.warning(
            "the drafter names %s as its verifier, eagle3's private converted copy of a GGUF whose source is not "
            "known here; `vllm serve` would load that folder. Export with --verifier-name HUB_ID_OR_PATH", recorded
        )


def export_drafter(
    src: str | os.PathLike | Eagle3Drafter,
    fmt: str,
    out_dir: str | os.PathLike,
    include_embedding: bool | None = None,
    dtype: torch.dtype | str | None = None,
    verifier_name: str | None = None,
    target_config: Any = None,
    speculative_tokens: int | None = None,
) -> Path:
    """Convert a checkpoint directory (either format) or an in-memory drafter to format `fmt` in `out_dir`.

    `include_embedding=None` keeps the source's choice (a directory without an embedding stays without one).
    `verifier_name` replaces the recorded target name (`verifier.name_or_path`, what `vllm serve` loads); without
    it, a name that is eagle3's private GGUF cache (drafters made before names were public) becomes the GGUF's.
    `target_config` (the target's HF config; `load_target_config`) gives the layer count, and the default aux
    ids when the source names none, and the drafter is checked against it; without it the source must store
    the count or name ids that are the EAGLE-3 default of some depth. Unknown config keys are written back.
    `speculative_tokens` replaces the draft length the config proposes to engines (a tuned choice).
    """
    if isinstance(src, Eagle3Drafter):
        if target_config is not None:
            validate_against_target(src.config, target_config, getattr(src, "d2t", None), getattr(src, "t2d", None))
        _set_verifier_name(src.config, verifier_name)
        return save_drafter(
            src, out_dir, fmt, include_embedding if include_embedding is not None else True, dtype
        )
    cfg, sd, _ = read_checkpoint(src, target_config, require_layer_count=True)
    _set_verifier_name(cfg, verifier_name)
    if speculative_tokens is not None:
        cfg.speculative_tokens = speculative_tokens
    has_embedding = "embed_tokens.weight" in sd
    if include_embedding and not has_embedding:
        raise ConfigError(f"{src} has no embed_tokens.weight to export; export with include_embedding=False")
    drafter = _build(cfg, sd, src, target_config, None, require_embedding=False)
    keep = has_embedding if include_embedding is None else include_embedding
    return save_drafter(drafter, out_dir, fmt, keep, dtype if dtype is not None else sd["fc.weight"].dtype)


def load_target_config(spec: str | os.PathLike) -> Any:
    """The HF config of target `spec` (folder, hub id, .gguf or bundled name), read without any weights.

    Enough for `export_drafter(target_config=...)`: the layer count, hidden size and vocabulary to check against.
    """
    from transformers import AutoConfig

    from eagle3.models import _from_hub, _resolve

    source = _resolve(spec)
    if source.kind == "gguf":
        gguf = Path(source.where).expanduser().resolve()
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    kwargs = {"local_files_only": True} if source.local_only else {}
    return _from_hub(source, lambda: AutoConfig.from_pretrained(str(source.where), **kwargs))
