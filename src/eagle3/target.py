"""The target model adapter: any HF causal LM, plus the three aux hidden states EAGLE-3 reads.

Taps use forward pre-hooks, so no modeling file is copied: aux id k (vLLM convention, HF `hidden_states[k]`)
is the un-normalised residual stream *entering* decoder layer k; k = L is the input of the final norm.
The adapter runs causal forwards on an HF `DynamicCache` and the training feature pass; rows of token trees
(4-D masks, positions = prefix + depth) are verified through it by `eagle3.decoding.hf_batch.batched_forward`, whose
`BatchKV.compact` shrinks the cache to each row's accepted path. `attention_mask` builds those masks per layer
type (sliding windows, chunks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from eagle3.config import ConfigError

try:  # transformers' conv + recurrent state cache of linear-attention layers (Qwen3-Next), `cache_utils.py`
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # a 5.x release without it: `Target` refuses hybrid targets
    LinearAttentionLayer = None

SUPPORTED = ("Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen3-Next (chains), Gemma-3 (text) and other decoders with "
             "`model.layers`")
# layer types whose cache is a conv + recurrent state instead of keys/values (hybrid targets: Qwen3-Next)
RECURRENT_LAYER_TYPES = ("linear_attention",)


def verifies_chains_only(model: nn.Module) -> bool:
    """Whether `model` has layers with a recurrent state (hybrid linear attention, Qwen3-Next), which a chain's
    verification can roll back but a tree cannot fork (`Target.tree_refusal`)."""
    config = getattr(model.config, "text_config", None) or model.config
    return any(t in RECURRENT_LAYER_TYPES for t in getattr(config, "layer_types", None) or [])


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder-layer list and the final norm of an HF causal LM, or a ConfigError naming what is missing."""
    base = getattr(model, "model", None)
    for cand in (base, getattr(base, "language_model", None), getattr(model, "language_model", None)):
        layers = getattr(cand, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            norm = getattr(cand, "norm", None)
            if norm is None:
                raise ConfigError(
                    f"{type(model).__name__}: found `layers` but no final `norm`; eagle3 needs the final norm "
                    f"to tap the last layer. Supported: {SUPPORTED}"
                )
            return layers, norm
    raise ConfigError(
        f"{type(model).__name__} has no `model.layers` ModuleList of decoder layers; eagle3 taps the residual "
        f"stream entering decoder layers. Supported: {SUPPORTED}"
    )


class Target:
    """Wraps a causal LM; every forward also returns aux features [B, T, 3·Ht] in ascending layer order."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int]):
        self.model = model.eval()
        self.config = getattr(model.config, "text_config", None) or model.config
        self.layers, self.final_norm = decoder_parts(model)
        self.num_layers = len(self.layers)
        self.aux_layer_ids = list(aux_layer_ids)
        for k in self.aux_layer_ids:
            if not 0 <= k <= self.num_layers:
                raise ConfigError(
                    f"aux layer id {k} is out of range for this target ({self.num_layers} decoder layers; "
                    f"valid ids 0..{self.num_layers})"
                )
        attn = getattr(model.config, "_attn_implementation", "sdpa")
        if attn not in ("sdpa", "eager"):
            raise ConfigError(
                f"attention implementation {attn!r} cannot take a tree mask; load the target with "
                "attn_implementation='sdpa', or 'eager' where sdpa is unsupported (eagle3.models.load_target does)"
            )
        self._additive_mask = attn == "eager"
        # transformers >= 5.2x renames `past_key_values` to `cache`; 5.17 only knows the old name
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = []
        for k in self.aux_layer_ids:
            module = self.final_norm if k == self.num_layers else self.layers[k]
            self._hooks.append(module.register_forward_pre_hook(self._capture(k), with_kwargs=True))
        self.layer_types = list(getattr(self.config, "layer_types", None) or [])
        # Llama-4 `chunked_attention` layers: a query sees only keys of its own chunk of this many positions
        self.chunk_size = getattr(self.config, "attention_chunk_size", None)
        self._query_scale = _slot_order_query_scale(self.config, self.layers)  # Llama-4 NoPE temperature
        self._query_ratio: torch.Tensor | None = None  # [B, N], set by `_set_query_ratio`, read by q_proj hooks
        if self._query_scale is not None:
            for layer in self.layers:
                if not getattr(getattr(layer, "self_attn", None), "use_rope", True):
                    self._hooks.append(layer.self_attn.q_proj.register_forward_hook(self._rescale_queries))
        self.sliding_window = getattr(self.config, "sliding_window", None)
        if getattr(self.config, "use_sliding_window", True) is False:
            self.sliding_window = None
        # Gemma-4 KV-shared layers (`num_kv_shared_layers`) run only the last `logits_to_keep` rows when that is a
        # positive int (transformers `models/gemma4/modeling_gemma4.py`, `_maybe_slice_kv_shared_inputs`), so taps
        # there would see one row: such targets compute every row and the logits are sliced here instead.
        self._all_rows = bool(getattr(self.config, "num_kv_shared_layers", 0))
        # Hybrid targets (Qwen3-Next): linear-attention layers carry a recurrent state that cannot be compacted like
        # keys/values, only rolled back along a chain (`RecurrentCache`); trees are refused.
        self.recurrent_layers = [i for i, t in enumerate(self.layer_types) if t in RECURRENT_LAYER_TYPES]
        self.family = type(model).__name__.removesuffix("ForCausalLM")
        if self.recurrent_layers and LinearAttentionLayer is None:
            raise ConfigError(f"{self.family} has linear-attention layers; this transformers version has no "
                              "linear-attention cache (transformers.cache_utils.LinearAttentionLayer): upgrade it")
        if self.recurrent_layers and len(self.recurrent_layers) == self.num_layers:
            raise ConfigError(f"{self.family}: every layer is linear attention; eagle3 needs at least one "
                              "full-attention layer to measure the cache")

    def _capture(self, k: int):
        def hook(_module, args, kwargs):
            self._captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _rescale_queries(self, _module, _args, out: torch.Tensor) -> torch.Tensor | None:
        """q_proj output [B, N, H·d] of a Llama-4 NoPE layer, times scale(position) / scale(slot) per token."""
        if self._query_ratio is None:
            return None
        return (out.float() * self._query_ratio[..., None]).to(out.dtype)

    def _set_query_ratio(self, positions: torch.Tensor, first_slot: int) -> None:
        """Before a forward writing new tokens at positions [B, N] into cache slots first_slot + 0..N-1: the
        NoPE query correction of `_slot_order_query_scale` (None where every ratio is exactly 1). Callers reset
        `_query_ratio` to None after the forward."""
        if self._query_scale is None:
            return
        slots = torch.arange(first_slot, first_slot + positions.shape[-1], device=positions.device)
        ratio = self._query_scale(positions) / self._query_scale(slots)
        self._query_ratio = None if bool((ratio == 1).all()) else ratio

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- properties ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    # -- masks ---------------------------------------------------------------------------------
    def attention_mask(self, visible: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor):
        """What the model's `attention_mask` takes, from a boolean visibility matrix.

        visible: bool [B, N, K] (query i may see key j, before any sliding window); q_pos: [B, N] and
        kv_pos: [B, K] absolute positions. Sliding-window layers also hide keys `sliding_window` or more
        positions back; chunked layers (Llama-4) hide keys outside the query's chunk of `attention_chunk_size`
        positions; a target mixing kinds (Gemma-3, gpt-oss, Llama-4) gets a dict keyed by layer type. Returns
        [B, 1, N, K] masks, boolean for sdpa and additive for eager attention.
        """
        dev = visible.device

        def windowed(window: int) -> torch.Tensor:
            return visible & (q_pos[:, :, None] - kv_pos[:, None, :] < window)

        def chunked(size: int) -> torch.Tensor:
            # transformers `masking_utils.py` `chunked_overlay` (used by `models/llama4/modeling_llama4.py`):
            # key k is seen from query q iff k // size == q // size, on top of causality
            return visible & (q_pos[:, :, None] // size == kv_pos[:, None, :] // size)

        def local(layer_type: str) -> torch.Tensor:
            if layer_type == "sliding_attention" and self.sliding_window:
                return windowed(self.sliding_window)
            if layer_type == "chunked_attention" and self.chunk_size:
                return chunked(self.chunk_size)
            return visible

        def finish(m: torch.Tensor) -> torch.Tensor:
            m = m[:, None]  # [B, 1, N, K]
            if self._additive_mask:
                return torch.zeros(m.shape, dtype=self.dtype, device=dev).masked_fill(~m, torch.finfo(self.dtype).min)
            return m

        types = set(self.layer_types)
        if ("sliding_attention" in types and self.sliding_window) or ("chunked_attention" in types and self.chunk_size):
            return {t: finish(local(t)) for t in types}
        if not self.layer_types and (self.sliding_window or self.chunk_size):  # one kind for every layer
            return finish(local("sliding_attention" if self.sliding_window else "chunked_attention"))
        return finish(visible)

    # -- forward -------------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        # A plain DynamicCache (no config) keeps every position of every layer, sliding ones too, so that
        # compaction is uniform; sliding windows are enforced by the masks.
        if self.recurrent_layers:
            return RecurrentCache(self.num_layers, self.recurrent_layers)
        return DynamicCache()

    @property
    def tree_refusal(self) -> str:
        """Why a hybrid target verifies chains only (the ConfigError text)."""
        return (f"{self.family} keeps a recurrent state per linear-attention layer that a token tree cannot fork; "
                "use --chain K")

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, N]
        cache: DynamicCache,
        logits_to_keep: int = 0,  # 0 = logits for every new token
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A causal forward of one sequence's new tokens (prefill, plain steps, a draft model's chain; trees are
        verified by `eagle3.decoding.hf_batch.batched_forward`). Returns logits [1, N', V] (fp32) and aux features
        [1, N, 3·Ht] (None without aux layers)."""
        past = cache.get_seq_length()
        n = input_ids.shape[1]
        dev = input_ids.device
        positions = torch.arange(past, past + n, device=dev)  # [N]
        kwargs = {self._cache_kw: cache}
        if isinstance(cache, RecurrentCache) and past:
            cache.record(n)  # after prefill every forward may be rolled back
        self._set_query_ratio(positions[None], past)
        self._captured.clear()
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=positions[None],
                cache_position=torch.arange(past, past + n, device=dev),
                use_cache=True,
                logits_to_keep=0 if self._all_rows else logits_to_keep,
                **kwargs,
            )
        finally:
            self._query_ratio = None
        logits = out.logits[:, -logits_to_keep:] if self._all_rows and logits_to_keep else out.logits
        return logits.float(), self._aux()

    def _aux(self) -> torch.Tensor | None:
        if not self.aux_layer_ids:
            return None
        missing = [k for k in self.aux_layer_ids if k not in self._captured]
        if missing:
            raise ConfigError(f"aux layers {missing} were not reached in the forward pass of {type(self.model).__name__}")
        return torch.cat([self._captured[k] for k in self.aux_layer_ids], dim=-1)  # [B, N, 3·Ht]

    @torch.inference_mode()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, with_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training pass without a cache: aux [B, T, 3·Ht] and logits [B, T, V] (target dtype)."""
        self._captured.clear()
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                         logits_to_keep=0 if with_logits or self._all_rows else 1)
        return self._aux(), (out.logits if with_logits else None)

    # -- cache maintenance ---------------------------------------------------------------------
    @staticmethod
    def crop(cache: DynamicCache, length: int) -> None:
        """Keep the first `length` positions (DynamicCache.crop's meaning changed across 5.x releases)."""
        if isinstance(cache, RecurrentCache):
            cache.rewind(cache.get_seq_length() - length)
        for layer in cache_layers(cache):
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]


def _slot_order_query_scale(config, layers: nn.ModuleList) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Llama-4's NoPE query temperature as a function of position, when the model derives it from cache slots.

    transformers `models/llama4/modeling_llama4.py` (`Llama4TextAttention.forward`) multiplies the queries of
    layers without RoPE by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 with p = cache length + row
    index (`cache_position` in older 5.x): the slot, not `position_ids`. A tree node sits at slot past + i but
    at position past + depth, so across a floor_scale multiple it would get another scale than sequential
    decoding gives (vLLM `model_executor/models/llama4.py` uses positions). `Target.forward` multiplies those
    nodes' q_proj rows by scale(position) / scale(slot). None for other targets, or a model reading positions.
    """
    floor_scale = getattr(config, "floor_scale", None)
    if not getattr(config, "attn_temperature_tuning", False) or not floor_scale:
        return None
    nope = [layer.self_attn for layer in layers if not getattr(getattr(layer, "self_attn", None), "use_rope", True)]
    if not nope:
        return None
    try:
        source = inspect.getsource(type(nope[0]).forward)
    except (OSError, TypeError):
        source = ""
    if "position_ids" in source and "get_seq_length" not in source and "cache_position" not in source:
        return None
    attn_scale = float(config.attn_scale)

    def scale(positions: torch.Tensor) -> torch.Tensor:  # the model's own formula, in fp32 as there
        return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0

    return scale


class RecurrentCache(DynamicCache):
    """The cache of a hybrid target: keys/values for attention layers, conv + recurrent state for linear ones.

    Rollback composes transformers' own past recording (`cache_utils.py`, `LinearAttentionLayer.
    activate_past_recording` / `crop`, the mechanism of its assisted generation): while recording, the
    Qwen3-Next linear layers (`models/qwen3_next/modeling_qwen3_next.py`, `Qwen3NextGatedDeltaNet.forward`) run
    the last `recurrent_states_to_keep` tokens of a forward through the one-token recurrence and keep the state
    after each, and keep the raw conv inputs; `crop(-r)` then restores the state from before the last r
    tokens. So a chain is verified in one forward and the state ends exactly after the last accepted token,
    with no second forward; the price is that verified tokens take the token-by-token recurrence instead of
    the chunked kernel, and one state copy per token per linear layer until the cycle's rollback, which costs
    less than the second forward over the accepted tokens that snapshot-and-replay needs. Keys and
    values stay with `BatchKV.compact` / `Target.crop` like every other target's. A tree cannot be verified:
    the recurrence would run its branches one after another, so `HFRows` refuses trees (`Target.tree_refusal`).
    """

    def __init__(self, num_layers: int, recurrent: list[int]):
        # every position of attention layers, as `Target.new_cache`'s plain DynamicCache keeps them
        Cache.__init__(self, layers=[LinearAttentionLayer() if i in recurrent else DynamicLayer()
                                     for i in range(num_layers)])
        self.recurrent = list(recurrent)
        self._attention = next(i for i in range(num_layers) if i not in recurrent)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Cached positions, read from an attention layer (a linear one counts tokens in a device tensor)."""
        return int(self.layers[self._attention if layer_idx in self.recurrent else layer_idx].get_seq_length())

    def record(self, n: int) -> None:
        """Before a forward of n tokens that may be rolled back: keep every state it passes through."""
        for i in self.recurrent:
            layer = self.layers[i]
            if not layer.record_past:  # stays on; each `crop` drops what was kept
                layer.activate_past_recording(recurrent_states_to_keep=n)
            elif n > (layer.recurrent_states_to_keep or 0):
                layer.recurrent_states_to_keep = n  # more tokens than any forward recorded before

    def rewind(self, tokens: int) -> None:
        """Forget the last `tokens` tokens of the linear layers (0: just drop what was kept for a rollback)."""
        for i in self.recurrent:
            layer = self.layers[i]
            if layer.record_past:
                layer.crop(-tokens)
            elif tokens:
                raise RuntimeError(f"linear-attention layer {i} did not record the tokens to roll back")

    def keep_chain(self, keep_len: int, keep_rel: torch.Tensor) -> None:
        """`BatchKV.compact`'s meaning for the linear layers: keep_rel must be the chain prefix 0..m-1."""
        m = keep_rel.numel()
        if not torch.equal(keep_rel, torch.arange(m, device=keep_rel.device)):
            raise ConfigError("a hybrid target's recurrent state can only keep a chain prefix, not tree nodes "
                              f"{keep_rel.tolist()}; use --chain K")
        self.rewind(self.get_seq_length() - keep_len - m)


def cache_layers(cache: DynamicCache) -> list:
    """The per-layer key/value holders of an HF cache (transformers 5's `DynamicCache.layers`)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ConfigError("this transformers version's DynamicCache has no `layers`; eagle3 needs transformers >= 5.0")
    return layers
