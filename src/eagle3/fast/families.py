"""The target families the fast path takes (`fast_support`) and one decoder layer's weights read from its HF
layer (`_Layer`: fused q/k/v and gate/up copies, the other matrices shared; routed experts as `RoutedExperts`)."""

from __future__ import annotations

import torch
from torch import nn

from eagle3.fast.moe import RoutedExperts, experts_of, moe_support
from eagle3.fast.norm_fold import fold_columns

FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
_DYNAMIC_ROPE = ("dynamic", "longrope")  # cos/sin depend on the sequence length: not a fixed table


def _text_config(model: nn.Module):
    return getattr(model.config, "text_config", None) or model.config


def attention_window(cfg) -> int | None:
    """The sliding window every layer attends within (a token at position p sees positions above p - window, as
    transformers' `sliding_window_overlay`), or None for full attention. Mistral sets `sliding_window` alone;
    Qwen2/Qwen3 also `use_sliding_window` and, per layer, `layer_types`."""
    window = getattr(cfg, "sliding_window", None)
    types = set(getattr(cfg, "layer_types", None) or [])
    if not window or getattr(cfg, "use_sliding_window", True) is False or (types and types != {"sliding_attention"}):
        return None
    return int(window)


def fast_support(model: nn.Module) -> str | None:
    """None when `model` can run on the fast path, else the reason it cannot (for the fallback notice)."""
    cfg = _text_config(model)
    mt = getattr(cfg, "model_type", None)
    if mt not in FAST_MODEL_TYPES:
        return f"model_type {mt!r} is not one of the fast-path families {FAST_MODEL_TYPES}"
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or getattr(base, "rotary_emb", None) is None or getattr(base, "norm", None) is None:
        return f"{type(model).__name__} has no model.layers / model.rotary_emb / model.norm"
    rope_type = getattr(base.rotary_emb, "rope_type", "default")
    if rope_type in _DYNAMIC_ROPE:
        return f"rope_type {rope_type!r} changes with the sequence length; the fast path uses a fixed table"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}: the fast path implements SwiGLU (silu) only"
    types = set(getattr(cfg, "layer_types", None) or [])
    if getattr(cfg, "use_sliding_window", True) is not False and "sliding_attention" in types and len(types) > 1:
        return "sliding-window and full-attention layers mixed: the fast path takes one window for every layer"
    if getattr(model, "hf_quantizer", None) is not None:
        return "quantized weights (the fast path reads plain float matrices)"
    attn = layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        lin = getattr(attn, name, None)
        if not isinstance(lin, nn.Linear) or not lin.weight.is_floating_point():
            return f"decoder layer self_attn has no float nn.Linear {name}"
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if experts_of(mlp) is not None:
            reason = moe_support(mlp)
            if reason is not None:
                return f"layer {i}'s experts cannot run on the fast path: {reason}"
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Linear):
                return f"layer {i}'s mlp has no nn.Linear {name} and no routed experts the fast path runs"
    return None


def _cat_bias(parts: list[nn.Linear]) -> torch.Tensor | None:
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([
        p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in parts
    ])


class _Layer(nn.Module):
    """One decoder layer's weights, as buffers (fused q/k/v and gate/up are copies; the others are shared). A layer
    with routed experts has `moe` (`RoutedExperts`) and no gate/up or down matrices."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        self._hf = [layer]  # a list, so it is not registered as a submodule: `fuse` reads its weights again
        self.moe = RoutedExperts(m) if experts_of(m) is not None else None
        self.register_buffer("ln1", layer.input_layernorm.weight.detach(), persistent=False)
        self.register_buffer("ln2", layer.post_attention_layernorm.weight.detach(), persistent=False)
        self.register_buffer("wqkv", None, persistent=False)
        self.register_buffer("w13", None, persistent=False)
        self.fuse(folded=False)
        self.register_buffer("bqkv", _cat_bias(self._qkv()), persistent=False)
        self.register_buffer("wo", a.o_proj.weight.detach(), persistent=False)
        self.register_buffer("bo", None if a.o_proj.bias is None else a.o_proj.bias.detach(), persistent=False)
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)  # Qwen3: RMSNorm over head_dim
        self.register_buffer("q_norm", None if qn is None else qn.weight.detach(), persistent=False)
        self.register_buffer("k_norm", None if kn is None else kn.weight.detach(), persistent=False)
        dense = self.moe is None
        self.register_buffer("b13", _cat_bias(self._gate_up()) if dense else None, persistent=False)
        self.register_buffer("w2", m.down_proj.weight.detach() if dense else None, persistent=False)
        self.register_buffer("b2", None if not dense or m.down_proj.bias is None else m.down_proj.bias.detach(),
                             persistent=False)

    def _qkv(self) -> list[nn.Linear]:
        a = self._hf[0].self_attn
        return [a.q_proj, a.k_proj, a.v_proj]

    def _gate_up(self) -> list[nn.Linear]:
        m = self._hf[0].mlp
        return [] if self.moe is not None else [m.gate_proj, m.up_proj]

    def _fused(self, folded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The HF layer's q/k/v and gate/up weights concatenated (None for experts), norms folded in or not."""
        wqkv = torch.cat([p.weight.detach() for p in self._qkv()])
        gate_up = self._gate_up()
        w13 = torch.cat([p.weight.detach() for p in gate_up]) if gate_up else None
        if folded:
            wqkv, w13 = fold_columns(wqkv, self.ln1), fold_columns(w13, self.ln2)
        return wqkv, w13

    @torch.no_grad()
    def refresh(self, folded: bool) -> None:
        """Copy the HF layer's current weights into the fused matrices and biases in place (the same tensors, so
        graphs captured on them replay the new weights); the other buffers, experts included, are the layer's own
        tensors."""
        wqkv, w13 = self._fused(folded)
        self.wqkv.copy_(wqkv)
        if w13 is not None:
            self.w13.copy_(w13)
        for fused, parts in ((self.bqkv, self._qkv()), (self.b13, self._gate_up())):
            if fused is not None:
                fused.copy_(_cat_bias(parts))

    @torch.no_grad()
    def fuse(self, folded: bool) -> None:
        """(Re)build the fused q/k/v and gate/up matrices from the HF layer, with the input and post-attention norm
        weights folded into their columns (`eagle3.fast.norm_fold`) or not; never folded with experts."""
        self.wqkv = self.w13 = None  # the old copies go before the new ones are made
        self.wqkv, self.w13 = self._fused(folded)
