"""`config.json` <-> `DrafterConfig` for the speculators and native EAGLE-3 formats, and format detection.

The two formats are described in the package docstring (`eagle3.formats`). Both config writers add an `"eagle3"`
key (`EXTRAS_KEY`; other loaders ignore it) holding what the formats lack: the target's layer count and the aux
layer ids in vLLM convention. `config_from_dict` reads either format, including configs written by speculators,
SpecForge and SafeAILab/EAGLE, and rejects flags eagle3's drafter cannot honour.

Aux layer ids. eagle3 uses the vLLM convention everywhere: id k is HF `hidden_states[k]`, the residual stream
entering decoder layer k. Lists written by others may instead number "output of decoder layer X" (= HF
`hidden_states[X+1]`): NVIDIA ModelOpt (default `[1, L//2-1, L-4]`) and SGLang/SpecForge do, and RedHat's
speculators copy of NVIDIA's Maverick drafter kept ModelOpt's `[1, 23, 44]`. The rule, SGLang's own since its
PR #25454, is applied to native and speculators lists alike: a list whose first id is 1 gets +1, any other list is
taken verbatim. So both files of that drafter read as [2, 24, 45]. A missing list means the EAGLE-3 default
`default_aux_layer_ids(L)` of the target's depth. eagle3 writes lists in vLLM convention and warns when a native
list starts with 1 (ambiguous to SGLang); its own `"eagle3"` key always settles the ids for eagle3.

Keys eagle3 does not interpret (`auto_map`, ModelOpt's `eagle_config` flags, ...) are kept in
`DrafterConfig.kept_keys` and written back where each format keeps them (also under `"eagle3"."kept"`, so a
second conversion restores keys the intermediate format interprets); those that might change the computation are
named in one warning.

Flags whose default differs between loaders are always written: vLLM's speculators path defaults a missing
`norm_before_residual` to True (`vllm/transformers_utils/configs/speculators/algos.py`), its native path to False.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch

from eagle3.config import ConfigError, DrafterConfig, default_aux_layer_ids

log = logging.getLogger("eagle3.formats")

FORMATS = ("speculators", "eagle")
SPECULATORS_FORMAT_VERSION = "0.9.0"  # the speculators release whose loader tests/oracle checks
NATIVE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")
EXTRAS_KEY = "eagle3"


def _dtype_name(dtype: torch.dtype | str | None) -> str | None:
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def _torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ConfigError(f"dtype={dtype!r} is not a torch dtype; use float32, float16 or bfloat16")
    return resolved


def _text_config(target_config: Any) -> Any:
    """The text part of a target config (a config object or dict; multimodal configs nest it)."""
    if isinstance(target_config, dict):
        target_config = SimpleNamespace(**target_config)
    tc = getattr(target_config, "text_config", None) or target_config
    return SimpleNamespace(**tc) if isinstance(tc, dict) else tc


# ---------------------------------------------------------------------------------------------
# keys eagle3 does not interpret: kept verbatim (`DrafterConfig.kept_keys`) and written back on export
# ---------------------------------------------------------------------------------------------
# keys eagle3 reads or writes itself, per place; every other key is kept
_LAYER_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings", "torch_dtype",
    "dtype", "bos_token_id", "eos_token_id", "pad_token_id", "use_sliding_window", "layer_types", "logit_scale",
})  # fmt: skip
_SPECULATORS_KEYS = frozenset({
    "architectures", "speculators_model_type", "speculators_version", "draft_vocab_size", "norm_before_residual",
    "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad", "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids", "transformer_layer_config", "speculators_config", "torch_dtype", "dtype",
    EXTRAS_KEY,
})  # fmt: skip
_NATIVE_KEYS = _LAYER_KEYS | {
    "architectures", "draft_vocab_size", "use_cache", "eagle_config", "norm_before_residual", "norm_before_fc",
    "fc_norm", "norm_output", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", EXTRAS_KEY,
}  # fmt: skip
_EAGLE_CONFIG_KEYS = frozenset({"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"})
# kept keys that cannot change what the drafter computes (metadata, training-only settings): not warned about
_METADATA_KEYS = frozenset({
    "auto_map", "transformers_version", "_name_or_path", "initializer_range", "pretraining_tp", "attention_dropout",
    "use_cache", "has_no_defaults_at_init", "base_model_ep_plan",
})  # fmt: skip
_WARNED: set[tuple[str, ...]] = set()  # key sets already warned about in this process


def _pretrained_config_keys() -> set[str]:
    from transformers import LlamaConfig

    return set(LlamaConfig().to_dict())


def _kept_keys(config: dict[str, Any], fmt: str) -> dict[str, Any]:
    """The keys of `config` eagle3 does not interpret, as {"top": {...}, "layer": {...}} (empty buckets dropped).

    speculators: unknown top-level keys and unknown `transformer_layer_config` keys. Native (flat): unknown keys
    that are Llama config attributes go to "layer", the rest to "top"; unknown `eagle_config` flags (ModelOpt's
    `use_last_layernorm`, ...) to top["eagle_config"], so each format's writer puts them back where they were.
    """
    top: dict[str, Any] = {}
    layer: dict[str, Any] = {}
    if fmt == "speculators":
        top = {k: v for k, v in config.items() if k not in _SPECULATORS_KEYS}
        inner = config.get("transformer_layer_config") or {}
        layer = {k: v for k, v in inner.items() if k not in _LAYER_KEYS}
    else:
        llama = _pretrained_config_keys()
        for k, v in config.items():
            if k not in _NATIVE_KEYS:
                (layer if k in llama else top)[k] = v
        eagle_config = config.get("eagle_config")
        flags = {k: v for k, v in (eagle_config or {}).items() if k not in _EAGLE_CONFIG_KEYS}
        if flags:
            top["eagle_config"] = flags
    return {name: bucket for name, bucket in (("top", top), ("layer", layer)) if bucket}


def _merge_kept(earlier: dict[str, Any] | None, found: dict[str, Any]) -> dict[str, Any] | None:
    """Keys kept by an earlier export (`"eagle3"."kept"`) overlaid with those found in this file now."""
    out: dict[str, Any] = {}
    for name in ("top", "layer"):
        bucket = {**((earlier or {}).get(name) or {}), **found.get(name, {})}
        flags = {**(((earlier or {}).get(name) or {}).get("eagle_config") or {}),
                 **(found.get(name, {}).get("eagle_config") or {})}  # fmt: skip
        if flags:
            bucket["eagle_config"] = flags
        if bucket:
            out[name] = bucket
    return out or None


def _warn_ignored(kept: dict[str, Any] | None) -> None:
    """Warn once per process about kept keys that may change the drafter's computation (eagle3 ignores them)."""
    if not kept:
        return
    metadata = _METADATA_KEYS | _pretrained_config_keys() - _LAYER_KEYS
    names = []
    for name in ("top", "layer"):
        for k, v in (kept.get(name) or {}).items():
            if k == "eagle_config" and name == "top" and isinstance(v, dict):
                names += [f"eagle_config.{f}" for f in v]
            elif k not in metadata:
                names.append(k if name == "top" else f"transformer_layer_config.{k}")
    key = tuple(sorted(set(names)))
    if key and key not in _WARNED:
        _WARNED.add(key)
        log.warning(
            "config.json keys %s are not interpreted by eagle3 (nor by vLLM's or SGLang's EAGLE-3 Llama drafter): "
            "the drafter runs without them, and export writes them back unchanged",
            list(key),
        )


def _write_kept(d: dict[str, Any], cfg: DrafterConfig, fmt: str) -> dict[str, Any]:
    """`d` (a writer's config dict) with `cfg.kept_keys` put back where `fmt` keeps them; eagle3's own keys win."""
    kept = cfg.kept_keys or {}
    if not kept:
        return d
    extras = d.pop(EXTRAS_KEY)
    top = dict(kept.get("top") or {})
    flags = top.pop("eagle_config", None)
    layer = kept.get("layer") or {}
    if fmt == "speculators":
        for k, v in layer.items():
            d["transformer_layer_config"].setdefault(k, v)
        for k, v in top.items():
            d.setdefault(k, v)
        if flags:
            d.setdefault("eagle_config", flags)  # ModelOpt flags: no speculators equivalent; vLLM ignores the key
    else:
        for k, v in {**layer, **top}.items():
            d.setdefault(k, v)
        for k, v in (flags or {}).items():
            d["eagle_config"].setdefault(k, v)
    extras["kept"] = kept  # restores keys the other format interprets after a second conversion
    d[EXTRAS_KEY] = extras
    return d


# ---------------------------------------------------------------------------------------------
# writing config.json
# ---------------------------------------------------------------------------------------------
def _token_ids(cfg: DrafterConfig) -> dict[str, Any]:
    ids = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }
    return {k: v for k, v in ids.items() if v is not None}


def _extras(cfg: DrafterConfig) -> dict[str, Any]:
    from eagle3 import __version__

    extras = {
        "version": __version__,
        "target_num_layers": cfg.target_num_layers,
        "aux_layer_ids": list(cfg.aux_layer_ids),  # vLLM convention, whatever the format writes elsewhere
        "speculative_tokens": cfg.speculative_tokens,
        "verifier_name_or_path": cfg.verifier_name_or_path,
        "verifier_architectures": list(cfg.verifier_architectures),
    }
    if cfg.acceptance_profile is not None:
        extras["acceptance_profile"] = cfg.acceptance_profile
    return extras


def speculators_config_dict(cfg: DrafterConfig, dtype: torch.dtype | str | None = None) -> dict[str, Any]:
    """The speculators-format `config.json` for `cfg` (reference §D.2)."""
    dtype_name = _dtype_name(dtype) or cfg.torch_dtype
    layer = {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.resolved_head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        **_token_ids(cfg),
    }
    d = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": cfg.verifier_name_or_path,
                "architectures": list(cfg.verifier_architectures),
            },
        },
        "torch_dtype": dtype_name,
        EXTRAS_KEY: _extras(cfg),
    }
    return _write_kept(d, cfg, "speculators")


def native_config_dict(cfg: DrafterConfig, dtype: torch.dtype | str | None = None) -> dict[str, Any]:
    """The native EAGLE-3 (SGLang / SafeAILab) `config.json` for `cfg` (reference §D.1)."""
    if cfg.norm_output:
        raise ConfigError(
            "norm_output=True (feed the post-norm hidden state back) has no native EAGLE-3 equivalent: SpecForge "
            "reads a native `norm_output` key as 'apply norm before lm_head'. Save in the speculators format instead"
        )
    if cfg.aux_layer_ids[0] == 1:
        log.warning(
            "aux_layer_ids=%s start with 1: SGLang reads a native list starting with 1 as 'output of layer X' and "
            "adds 1; vLLM reads it as written. Serve this drafter from the speculators format with vLLM, or pass "
            "the layers to SGLang explicitly",
            cfg.aux_layer_ids,
        )
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "num_hidden_layers": 1,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": _dtype_name(dtype) or cfg.torch_dtype,
        **_token_ids(cfg),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        EXTRAS_KEY: _extras(cfg),
    }
    if cfg.target_hidden_size is not None:
        d["target_hidden_size"] = cfg.target_hidden_size
    return _write_kept(d, cfg, "eagle")


# ---------------------------------------------------------------------------------------------
# reading config.json
# ---------------------------------------------------------------------------------------------
def native_aux_ids_to_vllm(ids: list[int]) -> list[int]:
    """Convert an aux list written without eagle3's key to vLLM convention: +1 when it starts with 1.

    A first id of 1 means "output of decoder layer X" (= HF `hidden_states[X+1]`): NVIDIA ModelOpt's default
    `[1, L//2-1, L-4]` (`modelopt/torch/speculative/plugins/transformers.py`, forward hooks on `layers[X]`) and
    SpecForge's; SGLang adds 1 to such lists (PR #25454). No EAGLE-3 trainer taps `hidden_states[1]` by default.
    Applied to native lists and to speculators lists alike (RedHat's speculators copy of NVIDIA's Maverick
    drafter keeps ModelOpt's `[1, 23, 44]`), so both files of one drafter read as the same layers.
    """
    ids = [int(i) for i in ids]
    return [i + 1 for i in ids] if ids and ids[0] == 1 else ids


def detect_format(config: dict[str, Any], weight_names: list[str] | None = None) -> str:
    """'speculators' or 'eagle' for a checkpoint's config dict (and weight names, if known)."""
    archs = set(config.get("architectures") or [])
    if (
        "speculators_config" in config
        or "speculators_model_type" in config
        or archs & set(SPECULATORS_ARCHITECTURES)
    ):
        return "speculators"
    if archs & set(NATIVE_ARCHITECTURES) or any(n.startswith("midlayer.") for n in weight_names or []):
        return "eagle"
    if config.get("draft_vocab_size") is not None or "eagle_config" in config:
        return "eagle"
    raise ConfigError(
        f"config.json has neither `speculators_config` (speculators format) nor architectures "
        f"{list(NATIVE_ARCHITECTURES)} / `midlayer.*` weights (native EAGLE-3); architectures={sorted(archs)}"
    )


def _rope_from(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from legacy keys or a transformers-5 `rope_parameters` dict."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "full_attention" in params or "sliding_attention" in params:
            raise ConfigError(
                "rope_parameters per attention type (sliding-window drafters) are not supported"
            )
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        return theta, (scaling if kind != "default" else None)
    theta = float(d.get("rope_theta") or 10000.0)
    scaling = d.get("rope_scaling") or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def _check_unsupported(layer: dict[str, Any], where: str) -> None:
    """Raise ConfigError for flags that change the drafter's computation in a way eagle3 cannot honour."""
    if int(layer.get("num_hidden_layers", 1) or 1) != 1:
        raise ConfigError(
            f"{where}num_hidden_layers={layer['num_hidden_layers']}: only 1-layer EAGLE-3 drafters are supported "
            "(extra layers are named differently by vLLM and SGLang)"
        )
    model_type = layer.get("model_type", "llama")
    if model_type not in ("llama", None):
        raise ConfigError(
            f"{where}model_type={model_type!r}: only the Llama drafter layer is supported (a {model_type} layer "
            "adds parts such as q/k norms that eagle3's drafter lacks)"
        )
    if layer.get("tie_word_embeddings"):
        raise ConfigError(
            f"{where}tie_word_embeddings=true: EAGLE-3 drafters have their own draft-vocab lm_head"
        )
    if layer.get("use_sliding_window") or (
        layer.get("layer_types") and "sliding_attention" in layer["layer_types"]
    ):
        raise ConfigError(
            f"{where}use_sliding_window / layer_types: sliding-window drafter attention is unsupported"
        )
    scale = layer.get("logit_scale")
    if scale is not None and float(scale) != 1.0:
        raise ConfigError(f"{where}logit_scale={scale}: scaled drafter logits are not supported")


def _layer_fields(layer: dict[str, Any]) -> dict[str, Any]:
    theta, scaling = _rope_from(layer)
    nh = int(layer["num_attention_heads"])
    dtype = layer.get("torch_dtype") or layer.get("dtype") or "float32"
    return dict(
        hidden_size=int(layer["hidden_size"]),
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=nh,
        num_key_value_heads=int(layer.get("num_key_value_heads") or nh),
        head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // nh),
        vocab_size=int(layer["vocab_size"]),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings") or 2048),
        hidden_act=layer.get("hidden_act", "silu"),
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)),
        torch_dtype=_dtype_name(dtype),
        bos_token_id=layer.get("bos_token_id"),
        eos_token_id=layer.get("eos_token_id"),
        pad_token_id=layer.get("pad_token_id"),
    )


def _infer_num_layers(ids: list[int]) -> tuple[int, bool]:
    """(depth, exact): the smallest target depth whose EAGLE-3 default is `ids` (exact), else the least depth
    the ids allow (a guess: non-default ids say nothing about the depth)."""
    top = max(ids)
    for num_layers in range(max(top, 3), top + 5):
        try:
            if default_aux_layer_ids(num_layers) == list(ids):
                return num_layers, True
        except ConfigError:
            continue
    return max(top, 3), False


def _published_ids(raw: list | None, where: str) -> list[int] | None:
    """A config's own aux list in vLLM convention (`native_aux_ids_to_vllm`), saying so when it shifts."""
    if raw is None:
        return None
    raw = [int(i) for i in raw]
    ids = native_aux_ids_to_vllm(raw)
    if ids != raw:
        if where == "speculators":
            log.warning(
                "speculators aux layer ids %s start with 1: ModelOpt/SpecForge numbering ('output of layer X', e.g. "
                "RedHat's conversion of NVIDIA's Llama-4-Maverick drafter); eagle3 reads them as HF hidden_states "
                "%s, the layers the drafter was trained on. vLLM serving this file taps %s, one layer early; "
                "`eagle3 export --format speculators` writes %s",
                raw, ids, raw, ids,
            )  # fmt: skip
        else:
            log.info("native aux layer ids %s are SGLang-style (start with 1); using %s (vLLM convention)", raw, ids)
    return ids


def _speculators_fields(config: dict[str, Any], extras: dict[str, Any]) -> tuple[dict[str, Any], list | None]:
    kind = config.get("speculators_model_type", "eagle3")
    if kind != "eagle3":
        raise ConfigError(f"speculators_model_type={kind!r}: only 'eagle3' speculators are supported")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(
            "speculators config has no `transformer_layer_config`; the checkpoint is incomplete"
        )
    _check_unsupported(layer, "transformer_layer_config.")
    fields = _layer_fields(layer)
    if "norm_before_residual" not in config:
        log.warning(
            "speculators config has no `norm_before_residual`; using True as vLLM does for this format "
            "(vllm `transformers_utils/configs/speculators/algos.py`). Re-save the drafter to make it explicit"
        )
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    verifier = spec.get("verifier") or {}
    fields.update(
        norm_before_residual=bool(config.get("norm_before_residual", True)),
        norm_output=bool(config.get("norm_output", False)),
        speculative_tokens=int(methods[0].get("speculative_tokens", extras.get("speculative_tokens", 5))),
        verifier_name_or_path=verifier.get("name_or_path"),
        verifier_architectures=list(verifier.get("architectures") or []),
    )
    if extras.get("aux_layer_ids") is not None:
        return fields, extras["aux_layer_ids"]  # written by eagle3, vLLM convention
    return fields, _published_ids(config.get("eagle_aux_hidden_state_layer_ids"), "speculators")


def _native_fields(config: dict[str, Any], extras: dict[str, Any]) -> tuple[dict[str, Any], list | None]:
    _check_unsupported(config, "")
    eagle_config = config.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ConfigError(
            "eagle_config.use_aux_hidden_state=false: this is an EAGLE-1-style drafter on the last layer only, "
            "which eagle3 does not run"
        )
    if config.get("norm_output") is False:
        raise ConfigError(
            "norm_output=false in a native config means 'no norm before lm_head' (SpecForge); eagle3's drafter "
            "always applies it"
        )
    if extras.get("aux_layer_ids") is not None:
        ids = extras["aux_layer_ids"]  # written by eagle3, vLLM convention
    elif eagle_config.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids = _published_ids(list(eagle_config["eagle_aux_hidden_state_layer_ids"]), "eagle")
    else:
        ids = config.get("eagle_aux_hidden_state_layer_ids")  # top level: vLLM reads it verbatim
    fields = _layer_fields(config)
    fields.update(
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        speculative_tokens=int(extras.get("speculative_tokens", 5)),
        verifier_name_or_path=extras.get("verifier_name_or_path"),
        verifier_architectures=list(extras.get("verifier_architectures") or []),
    )
    return fields, ids


def config_from_dict(
    config: dict[str, Any],
    fmt: str | None = None,
    target_config: Any = None,
    lm_head_rows: int | None = None,
    require_layer_count: bool = False,
) -> DrafterConfig:
    """A DrafterConfig from a checkpoint's `config.json` in either format (see the module docstring for rules).

    `target_config` supplies the target's layer count when the checkpoint does not store it (and with it the
    default aux ids when the config names none); `lm_head_rows` supplies `draft_vocab_size` when the config omits
    it. `require_layer_count=True` (export) refuses to guess the layer count from the ids (a guess would be
    written into the exported file). Keys eagle3 does not interpret are kept (`kept_keys`).
    """
    fmt = fmt or detect_format(config)
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt!r}: expected one of {FORMATS}")
    extras = config.get(EXTRAS_KEY) or {}
    reader = _speculators_fields if fmt == "speculators" else _native_fields
    fields, ids = reader(config, extras)

    kept = _merge_kept(extras.get("kept"), _kept_keys(config, fmt))
    _warn_ignored(kept)

    num_layers = extras.get("target_num_layers")
    if num_layers is None and target_config is not None:
        num_layers = _text_config(target_config).num_hidden_layers
    if ids is None:
        if num_layers is None:
            raise ConfigError(
                "the drafter's config.json names no aux layer ids and no target layer count (so do SafeAILab's "
                "EAGLE-3 releases and most speculators configs); pass --target MODEL (Python: target_config=) so "
                "the EAGLE-3 default [2, L//2, L-3] is taken from the target's layer count"
            )
        ids = default_aux_layer_ids(int(num_layers))
    ids = [int(i) for i in ids]
    if num_layers is None:
        if require_layer_count:  # ids fit several depths: [2, 18, 34] is 37's default, and gpt-oss-120B's at 36
            raise ConfigError(
                f"the drafter's config.json does not store the target's layer count (aux layer ids {ids} do not "
                "fix it); pass --target MODEL so the exported drafter records the right one"
            )
        num_layers, exact = _infer_num_layers(ids)
        log.log(logging.INFO if exact else logging.WARNING,
                "target layer count not stored; assuming %d from aux layer ids %s%s", num_layers, ids,
                "" if exact else " (a guess: pass the target to check it)")  # fmt: skip
    target_hidden = config.get("target_hidden_size")
    return DrafterConfig(
        **fields,
        draft_vocab_size=int(config.get("draft_vocab_size") or lm_head_rows or fields["vocab_size"]),
        aux_layer_ids=ids,
        target_num_layers=int(num_layers),
        target_hidden_size=int(target_hidden) if target_hidden else None,
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        fc_norm=bool(config.get("fc_norm", False)),
        acceptance_profile=extras.get("acceptance_profile"),
        kept_keys=kept,
    )
