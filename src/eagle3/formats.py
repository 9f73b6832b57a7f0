"""Save and load EAGLE-3 drafter checkpoints in the two formats serving engines read, and check them against a target.

* **speculators** (what `vllm serve <dir>` reads; vllm-project/speculators `src/speculators/models/eagle3/config.py`):
  `config.json` with `speculators_config` and a nested Llama `transformer_layer_config`; weights named `layers.0.*`.
* **eagle** (native EAGLE-3, read by SGLang and SafeAILab/EAGLE; `eagle/traineagle3/config.json`): a flat Llama
  config with `architectures: ["LlamaForCausalLMEagle3"]`; the decoder layer's weights are named `midlayer.*`.

Both formats carry `d2t` (int64 offsets, `target = draft + d2t[draft]`) and `t2d` (bool mask over the target
vocabulary) when the draft vocabulary is reduced. eagle3 also writes an `"eagle3"` key (other loaders ignore it)
holding what the formats lack: the target's layer count and the aux layer ids in vLLM convention.

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

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eagle3.config import ConfigError, DrafterConfig, _rope_theta, default_aux_layer_ids
from eagle3.drafter import Eagle3Drafter

log = logging.getLogger(__name__)

FORMATS = ("speculators", "eagle")
SPECULATORS_FORMAT_VERSION = "0.9.0"  # the speculators release whose loader tests/oracle checks
NATIVE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")
EXTRAS_KEY = "eagle3"
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
# config <-> dict
# ---------------------------------------------------------------------------------------------
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


def _token_ids(cfg: DrafterConfig) -> dict[str, Any]:
    ids = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }
    return {k: v for k, v in ids.items() if v is not None}


def _extras(cfg: DrafterConfig) -> dict[str, Any]:
    from eagle3 import __version__

    return {
        "version": __version__,
        "target_num_layers": cfg.target_num_layers,
        "aux_layer_ids": list(cfg.aux_layer_ids),  # vLLM convention, whatever the format writes elsewhere
        "speculative_tokens": cfg.speculative_tokens,
        "verifier_name_or_path": cfg.verifier_name_or_path,
        "verifier_architectures": list(cfg.verifier_architectures),
    }


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
    )


# ---------------------------------------------------------------------------------------------
# validation against a target
# ---------------------------------------------------------------------------------------------
def _text_config(target_config: Any) -> Any:
    if isinstance(target_config, dict):
        target_config = SimpleNamespace(**target_config)
    tc = getattr(target_config, "text_config", None) or target_config
    return SimpleNamespace(**tc) if isinstance(tc, dict) else tc


def check_vocab_mapping(cfg: DrafterConfig, d2t: torch.Tensor | None, t2d: torch.Tensor | None) -> None:
    """Raise ConfigError unless d2t/t2d describe `cfg`'s draft vocabulary (§A.4: offsets, ascending ids)."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    if not cfg.uses_draft_vocab:
        if d2t is not None and bool(d2t.ne(0).any()):
            raise ConfigError(
                f"d2t has non-zero offsets but draft_vocab_size == vocab_size == {v} (no reduction)"
            )
        return
    if d2t is None:
        raise ConfigError(
            f"draft_vocab_size={vd} < vocab_size={v} but d2t is missing: the draft-to-target id map is needed "
            "to turn draft tokens into target tokens"
        )
    if tuple(d2t.shape) != (vd,):
        raise ConfigError(f"d2t has shape {tuple(d2t.shape)}, expected ({vd},) = (draft_vocab_size,)")
    ids = torch.arange(vd, device=d2t.device) + d2t.long()  # [Vd] target ids
    if int(ids.min()) < 0 or int(ids.max()) >= v:
        raise ConfigError(
            f"d2t maps draft ids to target ids in [{int(ids.min())}, {int(ids.max())}], outside [0, {v})"
        )
    if vd > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ConfigError(
            "d2t target ids are not strictly increasing; the draft vocabulary must be sorted by id"
        )
    if t2d is None:
        return
    if tuple(t2d.shape) != (v,):
        raise ConfigError(f"t2d has shape {tuple(t2d.shape)}, expected ({v},) = (vocab_size,)")
    t2d = t2d.bool()
    if int(t2d.sum()) != vd:
        raise ConfigError(f"t2d marks {int(t2d.sum())} target ids, draft_vocab_size is {vd}")
    if not bool(t2d[ids.to(t2d.device)].all()):
        raise ConfigError("t2d and d2t disagree: some target ids reached through d2t are not marked in t2d")


def validate_against_target(
    cfg: DrafterConfig, target_config: Any, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None
) -> None:
    """Raise ConfigError (naming the field and both values) if `cfg` cannot run on `target_config`.

    Checks hidden size, vocabulary, layer count and aux layer ids, and the draft vocabulary map. A RoPE or dtype
    difference only warns: official drafters use θ=10000 whatever the target (reference pitfall 8).
    """
    tc = _text_config(target_config)
    t_hidden = int(tc.hidden_size)
    if t_hidden != cfg.resolved_target_hidden_size:
        raise ConfigError(
            f"hidden size mismatch: target hidden_size={t_hidden}, drafter target_hidden_size="
            f"{cfg.resolved_target_hidden_size}; this drafter was made for another model"
        )
    if int(tc.vocab_size) != cfg.vocab_size:
        raise ConfigError(
            f"vocabulary mismatch: target vocab_size={tc.vocab_size}, drafter vocab_size={cfg.vocab_size}"
        )
    num_layers = int(tc.num_hidden_layers)
    bad = [k for k in cfg.aux_layer_ids if not 0 <= k <= num_layers]
    if bad:
        raise ConfigError(
            f"aux_layer_ids={cfg.aux_layer_ids}: ids {bad} are out of range for a target with num_hidden_layers="
            f"{num_layers} (valid 0..{num_layers})"
        )
    if cfg.target_num_layers != num_layers:
        raise ConfigError(
            f"layer count mismatch: target num_hidden_layers={num_layers}, drafter target_num_layers="
            f"{cfg.target_num_layers}; this drafter was made for another model"
        )
    check_vocab_mapping(cfg, d2t, t2d)
    t_theta = _rope_theta(tc)
    if abs(t_theta - cfg.rope_theta) > 1e-6 * max(1.0, t_theta):
        log.warning(
            "drafter rope_theta=%s differs from target rope_theta=%s; fine if the drafter was trained that way "
            "(official EAGLE-3 drafters use 10000 on purpose)",
            cfg.rope_theta,
            t_theta,
        )
    t_dtype = _dtype_name(getattr(tc, "dtype", None) or getattr(tc, "torch_dtype", None))
    if t_dtype and cfg.torch_dtype and t_dtype != cfg.torch_dtype:
        log.warning("drafter torch_dtype=%s differs from target dtype=%s", cfg.torch_dtype, t_dtype)


# ---------------------------------------------------------------------------------------------
# weights
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


def read_checkpoint(path: str | os.PathLike, target_config: Any = None) -> tuple[DrafterConfig, dict, str]:
    """(DrafterConfig, state dict with eagle3 names, format) of a checkpoint directory; nothing is built."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ConfigError(f"{path} has no config.json; expected a drafter checkpoint directory")
    config = json.loads(cfg_file.read_text())
    raw = _read_weights(path)
    fmt = detect_format(config, list(raw))
    sd = {k: v for k, v in _canonical_names(raw).items() if k not in _IGNORED_WEIGHTS}
    head = sd.get("lm_head.weight")
    cfg = config_from_dict(config, fmt, target_config, None if head is None else head.shape[0])
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


def export_drafter(
    src: str | os.PathLike | Eagle3Drafter,
    fmt: str,
    out_dir: str | os.PathLike,
    include_embedding: bool | None = None,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Convert a checkpoint directory (either format) or an in-memory drafter to format `fmt` in `out_dir`.

    `include_embedding=None` keeps the source's choice (a directory without an embedding stays without one).
    """
    if isinstance(src, Eagle3Drafter):
        return save_drafter(
            src, out_dir, fmt, include_embedding if include_embedding is not None else True, dtype
        )
    cfg, sd, _ = read_checkpoint(src)
    has_embedding = "embed_tokens.weight" in sd
    if include_embedding and not has_embedding:
        raise ConfigError(f"{src} has no embed_tokens.weight to export; export with include_embedding=False")
    drafter = _build(cfg, sd, src, None, None, require_embedding=False)
    keep = has_embedding if include_embedding is None else include_embedding
    return save_drafter(drafter, out_dir, fmt, keep, dtype if dtype is not None else sd["fc.weight"].dtype)
