"""`config.json` <-> `DrafterConfig` for the speculators and native EAGLE-3 formats, and format detection.

The two formats are described in the package docstring (`eagle3.formats`). Both config writers add an `"eagle3"`
key (`EXTRAS_KEY`; other loaders ignore it) holding what the formats lack: the target's layer count and the aux
layer ids in vLLM convention. `config_from_dict` reads either format, including configs written by speculators,
SpecForge and SafeAILab/EAGLE, and rejects flags eagle3's drafter cannot honour.

Aux layer ids. eagle3 uses the vLLM convention everywhere: id k is HF `hidden_states[k]`, the residual stream
entering decoder layer k. speculators configs store ids that way. A native config's `eagle_config` list may come
from SGLang/SpecForge, which write "output of decoder layer X" (= HF `hidden_states[X+1]`, SpecForge default
`[1, L//2-1, L-4]`). The rule used here is SGLang's own since its PR #25454: a native list whose first id is 1 is
SGLang-style and gets +1; any other list is taken verbatim (vLLM reads it verbatim too). A missing list means the
EAGLE-3 default `default_aux_layer_ids(L)`. eagle3 writes native lists in vLLM convention and warns when that list
starts with 1 (ambiguous to SGLang); its own `"eagle3"` key always settles the ids for eagle3.

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
    return {
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
    return d


# ---------------------------------------------------------------------------------------------
# reading config.json
# ---------------------------------------------------------------------------------------------
def native_aux_ids_to_vllm(ids: list[int]) -> list[int]:
    """Convert a native `eagle_config` aux list to vLLM convention: +1 when it starts with 1 (SGLang style).

    SpecForge writes `[1, L//2-1, L-4]` for "outputs of layers 1, L//2-1, L-4" = HF `hidden_states[2, L//2, L-3]`
    (sgl-project/SpecForge `specforge/algorithms/model_providers.py`); SGLang adds 1 to such lists (PR #25454).
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


def _infer_num_layers(ids: list[int]) -> int:
    """The smallest target depth whose EAGLE-3 default is `ids`, else the least depth the ids allow."""
    top = max(ids)
    for num_layers in range(max(top, 3), top + 5):
        try:
            if default_aux_layer_ids(num_layers) == list(ids):
                return num_layers
        except ConfigError:
            continue
    return max(top, 3)


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
    return fields, config.get("eagle_aux_hidden_state_layer_ids")


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
        raw = list(eagle_config["eagle_aux_hidden_state_layer_ids"])
        ids = native_aux_ids_to_vllm(raw)
        if ids != raw:
            log.info(
                "native aux layer ids %s are SGLang-style (start with 1); using %s (vLLM convention)",
                raw,
                ids,
            )
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
    config: dict[str, Any], fmt: str | None = None, target_config: Any = None, lm_head_rows: int | None = None
) -> DrafterConfig:
    """A DrafterConfig from a checkpoint's `config.json` in either format (see the module docstring for rules).

    `target_config` supplies the target's layer count when the checkpoint does not store it; `lm_head_rows`
    supplies `draft_vocab_size` when the config omits it.
    """
    fmt = fmt or detect_format(config)
    if fmt not in FORMATS:
        raise ConfigError(f"format={fmt!r}: expected one of {FORMATS}")
    extras = config.get(EXTRAS_KEY) or {}
    reader = _speculators_fields if fmt == "speculators" else _native_fields
    fields, ids = reader(config, extras)

    num_layers = extras.get("target_num_layers")
    if num_layers is None and target_config is not None:
        num_layers = _text_config(target_config).num_hidden_layers
    if ids is None:
        if num_layers is None:
            raise ConfigError(
                "the checkpoint names no aux layer ids and no target layer count; pass target_config so the "
                "EAGLE-3 default [2, L//2, L-3] can be used"
            )
        ids = default_aux_layer_ids(int(num_layers))
    ids = [int(i) for i in ids]
    if num_layers is None:
        num_layers = _infer_num_layers(ids)
        log.info("target layer count not stored; assuming %d from aux layer ids %s", num_layers, ids)
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
    )
