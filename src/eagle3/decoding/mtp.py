"""`--draft mtp`: the target's own multi-token-prediction (MTP) layer as the drafter, with no training.

DeepSeek-V3 (and R1, Kimi-K2, GLM-4.5) checkpoints append `num_nextn_predict_layers` MTP modules after the
decoder stack, stored as `model.layers.{num_hidden_layers + i}.*`. One module predicts token t+2 from the target's
final hidden state h_t and the embedding of token t+1:

    u   = eh_proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])     # [T, 2H] -> [T, H], embeddings first
    out = shared_head.norm(decoder_layer(u))                  # one decoder layer of the target's own kind
    logits = lm_head(out)                                     # `shared_head.head` is a copy of the target's lm_head

(vllm-project/vllm `vllm/model_executor/models/deepseek_mtp.py` `DeepSeekMultiTokenPredictorLayer`; sgl-project/sglang
`python/sglang/srt/models/deepseek_nextn.py` `DeepseekModelNextN`; transformers `modeling_layers.py` `MtpLayer`.)
The checkpoint keys are `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head`, `embed_tokens` and the
decoder layer's own names (`self_attn.*`, `mlp.*`, `input_layernorm`, `post_attention_layernorm`) under that prefix.

h_t is the *post*-final-norm hidden state (what the target's lm_head reads): transformers' `MTPCandidateGenerator`
(`generation/candidate_generator.py`) feeds `hidden_states[-1]`, which `utils/output_capturing.py` ties to the
normed `last_hidden_state`; vLLM's and SGLang's DeepSeek models return the final-normed state as their hidden output.
eagle3 taps the input of the final norm (aux id L, `eagle3.target`) and applies the target's final norm to it.

The module itself is transformers' `MtpModel` / `MtpLayer` (`modeling_layers.py`), which composes the target
family's own decoder-layer class; its weights are read here from the target's safetensors through transformers'
weight conversions (fused experts etc.), since `MtpModel.from_pretrained` finds the MTP keys by a pattern with the
published layer count hard-coded (`DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected = [r"model\\.layers\\.61.*"]`,
which is also why `from_pretrained` of the target drops them). Qwen3-Next stores its MTP as `mtp.*`
(`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.0.*`, `norm`), which the same conversions rename,
and declares it as `mtp_num_hidden_layers` (`declare_qwen_mtp`); on that hybrid target it drafts chains.

Drafting is EAGLE-3's (`eagle3.decoding.drafters.Eagle3BatchDrafter`, chain or EAGLE-2 tree): row t pairs h_t
with x_{t+1}, at position t+1 (the input token's position, as vLLM and transformers place it: `position_offset`); later draft steps feed the module's output back as h, as vLLM
does for steps beyond `num_nextn_predict_layers`. Only the first MTP module is used: a second one would need its own
context rows, computed from the first one's outputs. Its output is post-norm (transformers' `MtpLayer.post_norm`, as
SGLang); vLLM feeds the pre-norm output back, which differs from the second draft on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from eagle3.config import ConfigError, DraftShape
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.drafter import DrafterKV
from eagle3.target import cache_layers, decoder_parts

INDEX_FILE = "model.safetensors.index.json"
# an MTP key: `model.layers.{N}.*` (optionally under a multimodal wrapper's prefix), or Qwen3-Next's `mtp.*`
_LAYER_KEY = re.compile(r"^(?:model\.language_model\.|language_model\.)?(?:model\.)?layers\.(\d+)\.(.+)$")
_MTP_KEY = re.compile(r"^(?:model\.language_model\.|language_model\.|model\.)?mtp\.(.+)$")


def mtp_layer_count(config) -> int:
    """`num_nextn_predict_layers` (DeepSeek, GLM-4.5, Kimi-K2), `num_mtp_layers` (transformers' own name) or
    `mtp_num_hidden_layers` (Qwen3-Next, Qwen3.5) of a text config; 0 if none."""
    for name in ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers"):
        n = getattr(config, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return 0


def checkpoint_folder(name: str | Path) -> Path | None:
    """The local folder holding a target's safetensors: the folder itself, or the hub cache's snapshot of a hub id."""
    path = Path(str(name)).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    for file in (INDEX_FILE, "model.safetensors"):
        hit = try_to_load_from_cache(str(name), file)
        if isinstance(hit, str):
            return Path(hit).parent
    return None


def find_mtp_keys(folder: Path, num_layers: int) -> dict[str, tuple[Path, str]]:
    """The first MTP module's tensors in `folder`: {canonical name: (file, key in that file)}.

    Canonical names are `model.layers.{num_layers}.*` (DeepSeek layout, wrapper prefixes removed) or `mtp.*`
    (Qwen3-Next; its `mtp.layers.{i}` for i > 0 are later modules and left out). Reads only headers.
    """
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        listed = {k: folder / f for k, f in weight_map.items()}
    else:
        listed = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                listed.update({k: file for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    out = {}
    for key, file in listed.items():
        m = _LAYER_KEY.match(key)
        if m and int(m.group(1)) == num_layers:
            out[f"model.layers.{num_layers}.{m.group(2)}"] = (file, key)
            continue
        m = _MTP_KEY.match(key)
        if m:
            later = re.match(r"layers\.(\d+)\.", m.group(1))
            if later is None or int(later.group(1)) == 0:
                out[f"mtp.{m.group(1)}"] = (file, key)
    return out


def load_mtp(model: nn.Module, source: str | Path | None = None) -> nn.Module:
    """transformers' `MtpModel` holding the first MTP module of `model`, its weights read from the checkpoint at
    `source` (default: the folder `model` was loaded from). ConfigError when the checkpoint has none."""
    config = getattr(model.config, "text_config", None) or model.config
    layers, _ = decoder_parts(model)
    num_layers = len(layers)
    source = source if source is not None else getattr(model.config, "_name_or_path", None)
    folder = checkpoint_folder(source) if source else None
    if folder is None:
        raise ConfigError(f"--draft mtp reads the MTP weights from the target's local safetensors, and {source!r} is "
                          "not a local folder or a hub id in the local cache")
    found = find_mtp_keys(folder, num_layers)
    declared = mtp_layer_count(config)
    if not found:
        raise ConfigError(
            f"target {source} has no multi-token-prediction (MTP) weights: its safetensors hold no "
            f"`model.layers.{num_layers}.*` (DeepSeek-V3/Kimi-K2/GLM-4.5 layout, num_nextn_predict_layers="
            f"{getattr(config, 'num_nextn_predict_layers', None)}) and no `mtp.*` (Qwen3-Next) tensors. --draft mtp needs "
            "a checkpoint that ships its MTP layers; use --draft eagle3 (with --drafter) or --draft ngram instead")
    if not declared:
        qwen = any(k.startswith("mtp.") for k in found)
        raise ConfigError(
            f"target {source} stores MTP tensors ({'Qwen3-Next layout, `mtp.*`' if qwen else f'`model.layers.{num_layers}.*`'}) "
            f"but its {type(config).__name__} declares no MTP layers (num_nextn_predict_layers, num_mtp_layers or "
            "mtp_num_hidden_layers), so the number of MTP layers is unknown; add the one its publisher documents to "
            "config.json, or use --draft ngram, or eagle3 with a drafter")
    try:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_layers import MtpModel
        from transformers.modeling_utils import LoadStateDictConfig
    except ImportError as e:
        import transformers

        raise ConfigError(f"--draft mtp builds the MTP layer with transformers' `MtpModel`, which transformers "
                          f"{transformers.__version__} does not have; install a newer transformers 5.x") from e
    if any(k.startswith("mtp.") for k in found):
        declare_qwen_mtp(config, declared)
    try:
        config.get_mtp_config()
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"transformers cannot build the MTP layer of {type(model).__name__} ({e})") from e

    from safetensors import safe_open

    dtype = next(model.parameters()).dtype
    device = next(layers[-1].parameters()).device
    with torch.device("meta"):
        mtp = MtpModel(model, 1)  # only the first module (see the module docstring)
    handles, slices = {}, {}
    try:
        for name, (file, key) in found.items():
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt", device="cpu")
            slices[name] = handles[file].get_slice(key)
        info, _ = convert_and_load_state_dict_in_model(
            model=mtp, state_dict=slices,
            load_config=LoadStateDictConfig(weight_mapping=mtp.get_weight_conversions(model),
                                            device_map={"": device}, dtype=dtype))
    finally:
        handles.clear()
    mtp._adjust_missing_and_unexpected_keys(info)
    missing = sorted(k for k in info.missing_keys if not k.startswith(("embed_tokens.", "shared_head.", "rotary_emb.")))
    meta = sorted(n for n, p in [*mtp.named_parameters(), *mtp.named_buffers()]
                  if p.is_meta and not n.startswith(("embed_tokens.", "shared_head.", "rotary_emb.")))
    if missing or meta:
        raise ConfigError(f"the MTP weights of {source} did not load into transformers' {type(mtp.layers[0].mtp_block).__name__} "
                          f"({len(missing or meta)} missing, e.g. {(missing or meta)[:3]}); found keys such as "
                          f"{sorted(found)[:3]}")
    mtp.tie_with_main_model(model)  # embedding, lm_head and rotary embedding are the target's
    mtp.eval().requires_grad_(False)
    return mtp


def declare_qwen_mtp(config, n: int) -> None:
    """Qwen3-Next configs declare their MTP as `mtp_num_hidden_layers` beside hybrid `layer_types`; transformers'
    `MtpModel` needs `num_mtp_layers` and the MTP layers' own `mtp_layer_types`. Each Qwen3-Next MTP layer is a
    full-attention decoder layer (vllm-project/vllm `vllm/model_executor/models/qwen3_next_mtp.py` builds it with
    `layer_type="full_attention"`), so that is what is set, on the target's config."""
    if getattr(config, "num_mtp_layers", None) is None and getattr(config, "mtp_num_hidden_layers", None):
        config.num_mtp_layers = n
    if getattr(config, "layer_types", None) is not None and getattr(config, "mtp_layer_types", None) is None:
        config.mtp_layer_types = ["full_attention"] * n


class MtpDrafter(nn.Module):
    """transformers' `MtpModel` seen through the drafter interface of `Eagle3BatchDrafter` (`combine`, forward,
    `logits`, `feedback`, `draft_ids_to_target`, `position_offset`), with the target's final norm to turn tapped
    rows into h_t."""

    position_offset = 1  # feature row t sits at the position of its input token x_{t+1}

    def __init__(self, mtp: nn.Module, final_norm: nn.Module):
        super().__init__()
        self.mtp, self.final_norm = mtp, final_norm
        self.layer = mtp.layers[0]
        self.eager = getattr(mtp.config, "_attn_implementation", "sdpa") == "eager"
        self.cache_index: int | None = None  # the HF cache layer the MTP attention writes (seen on first use)

    @property
    def device(self) -> torch.device:
        return self.layer.eh_proj.weight.device

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Tapped input of the final norm [B, m, H] -> the post-norm hidden state the MTP module reads [B, m, H]."""
        return self.final_norm(aux.to(self.layer.eh_proj.weight.dtype))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None = None, cache: DrafterKV | None = None) -> torch.Tensor:
        """hidden [B, m, H], input_ids [B, m] (x_{t+1} for row t), position_ids [B, m]; mask bool [B, 1, m, past+m]
        or None (causal after the cache). Returns the module's output [B, m, H] (post `shared_head.norm`); the
        layer's keys and values are appended to `cache` (through an HF cache holding them for the call)."""
        m = input_ids.shape[1]
        past = cache.length if cache is not None else 0
        if mask is None:  # explicit: SDPA's is_causal would align a shorter query block to the top left
            mask = torch.cat([torch.ones(m, past, dtype=torch.bool, device=hidden.device),
                              torch.ones(m, m, dtype=torch.bool, device=hidden.device).tril()], dim=1)[None, None]
        if self.eager:
            dt = hidden.dtype
            mask = torch.zeros(mask.shape, dtype=dt, device=hidden.device).masked_fill(~mask, torch.finfo(dt).min)
        emb = self.mtp.embed_tokens(input_ids).to(hidden.dtype)  # [1, m, H]
        rope = self.mtp.rotary_emb(emb, position_ids=position_ids) if self.mtp.rotary_emb is not None else None
        hf = None
        if cache is not None:
            hf = DynamicCache()
            if past:
                hf.update(cache.keys, cache.values, self.cache_index)
        out = self.layer(emb, hidden, position_embeddings=rope, attention_mask=mask, position_ids=position_ids,
                         cache=hf, use_cache=hf is not None)
        if hf is not None:
            layers = cache_layers(hf)
            self.cache_index = next(i for i, la in enumerate(layers)
                                    if getattr(la, "keys", None) is not None and la.keys.numel())
            cache.keys, cache.values = layers[self.cache_index].keys, layers[self.cache_index].values
        return out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.mtp._project_to_logits(out)  # [..., V] target ids

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        return out

    @staticmethod
    def draft_ids_to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids


class MtpProposer(Eagle3Proposer):
    """Drafts with the target's MTP layer (chain or EAGLE-2 tree), as EAGLE-3 drafts; needs the aux tap at the
    final norm (id L)."""

    name = "mtp"


def mtp_drafter(model: nn.Module, source: str | Path | None = None) -> MtpDrafter:
    """The MTP layer of `model`, whose checkpoint (at `source`, default where it was loaded from) ships MTP
    weights, as a drafter. Its `Target` must tap aux id `mtp_aux_id(model)` (the final norm's input)."""
    _, final_norm = decoder_parts(model)
    return MtpDrafter(load_mtp(model, source), final_norm)


def mtp_aux_id(model: nn.Module) -> int:
    """The aux id the MTP layer reads: the input of the final norm, `len(decoder layers)` (`eagle3.target`)."""
    return len(decoder_parts(model)[0])


def mtp_proposer(model: nn.Module, spec: DraftShape, source: str | Path | None = None) -> MtpProposer:
    """An `MtpProposer` drafting `spec` with `mtp_drafter(model, source)`."""
    return MtpProposer(mtp_drafter(model, source), spec)
