"""The target model adapter: any HF causal LM, plus the three aux hidden states EAGLE-3 reads.

Taps use forward pre-hooks, so no modeling file is copied: aux id k (vLLM convention, HF `hidden_states[k]`)
is the un-normalised residual stream *entering* decoder layer k; k = L is the input of the final norm.
The same adapter runs prefill, verification of a token tree (4-D mask, positions = prefix + depth) and
the training feature pass, on an HF `DynamicCache` that `compact` shrinks to the accepted path.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache

from eagle3.config import ConfigError

SUPPORTED = "Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma-3 (text) and other decoders with `model.layers`"


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
                "attn_implementation='sdpa' (eagle3.models.load_target does)"
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
        self.sliding_window = getattr(self.config, "sliding_window", None)
        if getattr(self.config, "use_sliding_window", True) is False:
            self.sliding_window = None

    def _capture(self, k: int):
        def hook(_module, args, kwargs):
            self._captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

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

    def input_embedding(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    # -- masks ---------------------------------------------------------------------------------
    def _tree_mask(self, past: int, tree_mask: torch.Tensor, positions: torch.Tensor):
        """4-D mask for N new tokens after `past` cached ones: all of the prefix plus the tree's ancestors.

        tree_mask: bool [N, N] (new token i may see new token j); positions: [N] absolute positions.
        Returns what the model's `attention_mask` takes: one [1, 1, N, past+N] mask, or a dict keyed by
        layer type when the target mixes sliding-window and full attention (Gemma-3).
        """
        n = tree_mask.shape[0]
        dev = tree_mask.device
        full = torch.cat([torch.ones(n, past, dtype=torch.bool, device=dev), tree_mask], dim=1)  # [N, past+N]
        kv_pos = torch.cat([torch.arange(past, device=dev), positions])  # [past+N]
        return self.attention_mask(full[None], positions[None], kv_pos[None])

    def attention_mask(self, visible: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor):
        """What the model's `attention_mask` takes, from a boolean visibility matrix.

        visible: bool [B, N, K] (query i may see key j, before any sliding window); q_pos: [B, N] and
        kv_pos: [B, K] absolute positions. Sliding-window layers also hide keys `sliding_window` or more
        positions back; a target mixing both kinds (Gemma-3) gets a dict keyed by layer type. Returns
        [B, 1, N, K] masks, boolean for sdpa and additive for eager attention.
        """
        dev = visible.device

        def windowed(window: int) -> torch.Tensor:
            return visible & (q_pos[:, :, None] - kv_pos[:, None, :] < window)

        def finish(m: torch.Tensor) -> torch.Tensor:
            m = m[:, None]  # [B, 1, N, K]
            if self._additive_mask:
                return torch.zeros(m.shape, dtype=self.dtype, device=dev).masked_fill(~m, torch.finfo(self.dtype).min)
            return m

        types = set(self.layer_types)
        if "sliding_attention" in types and self.sliding_window:
            return {t: finish(windowed(self.sliding_window) if t == "sliding_attention" else visible) for t in types}
        if self.sliding_window and not self.layer_types:
            return finish(windowed(self.sliding_window))
        return finish(visible)

    # -- forward -------------------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        # A plain DynamicCache (no config) keeps every position of every layer, sliding ones too, so that
        # compaction is uniform; sliding windows are enforced by the masks.
        return DynamicCache()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, N]
        cache: DynamicCache,
        tree_mask: torch.Tensor | None = None,  # bool [N, N]; None = causal (prefill / plain decode)
        position_offsets: torch.Tensor | None = None,  # [N] depth of each new token; None = 0..N-1
        logits_to_keep: int = 0,  # 0 = logits for every new token
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns logits [1, N', V] (fp32) and aux features [1, N, 3·Ht] (None without aux layers)."""
        past = cache.get_seq_length()
        n = input_ids.shape[1]
        dev = input_ids.device
        offsets = position_offsets if position_offsets is not None else torch.arange(n, device=dev)
        positions = past + offsets  # [N]
        kwargs = {self._cache_kw: cache}
        if tree_mask is not None:
            kwargs["attention_mask"] = self._tree_mask(past, tree_mask, positions)
        self._captured.clear()
        out = self.model(
            input_ids=input_ids,
            position_ids=positions[None],
            cache_position=torch.arange(past, past + n, device=dev),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        return out.logits.float(), self._aux()

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
                         logits_to_keep=0 if with_logits else 1)
        return self._aux(), (out.logits if with_logits else None)

    # -- cache maintenance ---------------------------------------------------------------------
    @staticmethod
    def compact(cache: DynamicCache, keep_len: int, keep_rel: torch.Tensor) -> None:
        """Keep positions [0, keep_len) plus keep_len + keep_rel (accepted tree nodes, in path order)."""
        dev = keep_rel.device
        keep = torch.cat([torch.arange(keep_len, device=dev), keep_len + keep_rel])
        for layer in _cache_layers(cache):
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            idx = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)

    @staticmethod
    def crop(cache: DynamicCache, length: int) -> None:
        """Keep the first `length` positions (DynamicCache.crop's meaning changed across 5.x releases)."""
        for layer in _cache_layers(cache):
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]


def _cache_layers(cache: DynamicCache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ConfigError("this transformers version's DynamicCache has no `layers`; eagle3 needs transformers >= 5.0")
    return layers
