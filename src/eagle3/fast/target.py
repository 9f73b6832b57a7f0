"""A compact functional forward for Llama/Mistral/Qwen2/Qwen3 targets over a preallocated, position-indexed KV cache.

The weights are read from the loaded HF model (no modeling file is copied): q/k/v and gate/up are fused into one
matrix each (a copy; the rest are shared), RoPE cos/sin come from the model's own rotary module evaluated once for
every cache slot (so every static HF rope type is honoured). The KV cache is one tensor per K and V,
`[L, n_kv, S, hd]`, written at slot indices with `index_copy_`; attention always reads all S slots and a
`[T, S]` boolean mask says which are visible, so every shape is static and the forward can be captured in a CUDA
graph (the habit of pytorch-labs/gpt-fast `model.py`: `KVCache.update` writes by `input_pos`).

GQA without copying K/V: the g = n_heads / n_kv query heads that share a KV head are stacked along the query axis,
`q [n_kv, g·T, hd]` against `k [n_kv, S, hd]`, with the `[T, S]` mask tiled g times; or, opt-in, they stay SDPA
heads with `enable_gqa` (`stack_query_heads` says what that gains and costs).

Aux features (EAGLE-3): id k is HF `hidden_states[k]`, the residual stream entering decoder layer k; k = L is the
input of the final norm.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.attention import shapes_vary
from eagle3.config import (
    FUSE_POINTWISE_CHOICES,
    FUSE_POINTWISE_LEVELS,
    TARGET_ATTENTION,
    ConfigError,
    on_for_device,
)
from eagle3.fast import split_attention as split
from eagle3.fast.norm_fold import fold_columns, scale_rows, scaled_gate
from eagle3.fast.rope_cache import rope_into_cache
from eagle3.fast.row_argmax import argmax_rows
from eagle3.fast.row_norm import rms_norm_rows

log = logging.getLogger("eagle3.fast")

FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_DYNAMIC_ROPE = ("dynamic", "longrope")  # cos/sin depend on the sequence length: not a fixed table


def _text_config(model: nn.Module):
    return getattr(model.config, "text_config", None) or model.config


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
    if "sliding_attention" in types and getattr(cfg, "use_sliding_window", True):
        return "sliding-window layers are not implemented on the fast path"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and window < cfg.max_position_embeddings:
        return f"sliding_window={window} < max_position_embeddings: sliding attention is not on the fast path"
    if getattr(model, "hf_quantizer", None) is not None:
        return "quantized weights (the fast path reads plain float matrices)"
    attn = layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        lin = getattr(attn, name, None)
        if not isinstance(lin, nn.Linear) or not lin.weight.is_floating_point():
            return f"decoder layer self_attn has no float nn.Linear {name}"
    mlp = layers[0].mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not isinstance(getattr(mlp, name, None), nn.Linear):
            return f"decoder layer mlp has no nn.Linear {name} (MoE targets use the generic path)"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama/Qwen RMSNorm: normalise in fp32, cast back, then scale (same op order as `LlamaRMSNorm`).

    On CUDA `F.rms_norm` (one fused kernel where torch has it; fp32 accumulation, one rounding at the end) is
    used instead: bf16 results can differ from HF's by one unit in the last place, identically on every path.
    """
    if x.is_cuda and x.dtype == weight.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [S, hd] for `apply_rope`: the first half of sin negated, so that
    rotate_half(x) * sin == roll(x, hd/2) * signed_sin exactly (negation is exact in floating point)."""
    half = sin.shape[-1] // 2
    sign = torch.cat([-torch.ones(half, dtype=sin.dtype, device=sin.device),
                      torch.ones(sin.shape[-1] - half, dtype=sin.dtype, device=sin.device)])
    return cos, sin * sign


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; cos/signed_sin [T, hd] from `rope_tables`. Equals HF `apply_rotary_pos_emb`
    (rotate-half layout, `x * cos + rotate_half(x) * sin`) with one roll instead of slice-negate-concatenate."""
    return apply_rope_heads(x, cos[:, None], signed_sin[:, None])


def apply_rope_heads(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`apply_rope` with the heads in front: x [heads, T, hd], cos/signed_sin [T, hd] (or anything that broadcasts
    against x). The same elementwise operations on the same operands, so the same values bit for bit in either
    layout. `out` (x itself allowed: both products are taken before the sum is written) receives the result."""
    return torch.add(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin, out=out)


def heads_first_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, n_rot: int) -> torch.Tensor:
    """x [N, heads, hd] (a strided view of the fused q/k/v projections) -> [heads, N, hd] contiguous, RoPE on the
    first n_rot heads (q and k) and the rest (v) as they are; cos/signed_sin [n_rot, N, hd] (`FastTarget.
    rope_tables_heads`). Written for inductor (`Pointwise`, piece "qkv_rope"), which makes the copy and RoPE one
    kernel reading the projections where they lie; eagerly `FastTarget.qkv_heads_first` copies, then rotates in
    place."""
    x = x.transpose(0, 1)  # [heads, N, hd], a view
    return torch.cat([apply_rope_heads(x[:n_rot], cos, signed_sin), x[n_rot:]])


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, hd] (a strided view of the fused projections) -> contiguous [heads, T, hd]: one copy for T > 1,
    none for T = 1 (a single row is already laid out that way)."""
    return x.transpose(0, 1).contiguous()


def stack_query_heads() -> bool:
    """The GQA layout a new `FastTarget` / `FastDrafter` starts with: stacked, on every device.

    Stacked: each KV head's g query heads go along the query axis, q [n_kv, g·T, hd] against k [n_kv, S, hd]:
    one plain batched attention, K/V never repeated. The other layout (`FastTarget.use_sdpa_heads`, opt-in) keeps
    the query heads as SDPA heads, q [1, nh, T, hd] (no stacking copy for any T) against k [1, n_kv, S, hd]
    with `enable_gqa`. That makes plain decoding on CUDA faster but the speculative cycles barely, and cuDNN then
    runs one query row with other kernels than several, so bf16 chains are no longer identical to plain decoding
    (docs/benchmarks.md). Stacked it stays by default.
    """
    return True


def gqa_layout(stacked: bool, nh: int, nkv: int) -> tuple[bool, int]:
    """(stacked, bias rows per token) for one forward: the module's layout, but stacked wherever attention shapes
    vary (`eagle3.attention.shapes_vary`: prefills), where masked GQA has no fused kernel without cuDNN."""
    stacked = stacked or shapes_vary()
    return stacked, (nh // nkv if stacked else 1)


def attention_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask [T, S] -> additive bias [1, 1, g·T, S] for `grouped_attention` (built once per forward; g = 1
    when the query heads are not stacked)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return bias.repeat(groups, 1)[None, None]  # row r·T + t belongs to token t


def grouped_attention(
    q: torch.Tensor,  # [nh, T, hd], heads first (contiguous from `FastTarget.qkv_heads_first`: no copy here)
    k_all: torch.Tensor,  # [nkv, S, hd]
    v_all: torch.Tensor,  # [nkv, S, hd]
    bias: torch.Tensor,  # [1, 1, g·T, S] from attention_bias (g = 1 unless stacked)
    scale: float,
    stacked: bool = True,
    exact: bool = False,
) -> torch.Tensor:
    """GQA attention over a static cache without repeating K/V, the query heads stacked or as SDPA heads
    (`stack_query_heads`); `exact` (stacked only): by `rows_exact_attention` (`exact_rows`). Returns [T, nh·hd]."""
    nh, t, hd = q.shape
    if not stacked:
        o = F.scaled_dot_product_attention(q[None], k_all[None], v_all[None], attn_mask=bias,
                                           scale=scale, enable_gqa=True)  # [1, nh, T, hd]
        return o[0].transpose(0, 1).reshape(t, nh * hd)
    nkv = k_all.shape[0]
    g = nh // nkv
    qg = q.reshape(nkv, g * t, hd)  # [nkv, g·T, hd] (a view if q is contiguous); row r·T + t: head kv·g + r, token t
    if exact:
        o = rows_exact_attention(qg, k_all, v_all, bias[0], scale)
    else:
        o = F.scaled_dot_product_attention(qg[None], k_all[None], v_all[None], attn_mask=bias, scale=scale)[0]
    return o.reshape(nh, t, hd).transpose(0, 1).reshape(t, nh * hd)  # [T, nh·hd]


def rows_exact_attention(
    q: torch.Tensor,  # [nkv, R, hd]
    k: torch.Tensor,  # [nkv, S, hd]
    v: torch.Tensor,  # [nkv, S, hd]
    bias: torch.Tensor,  # [1, R, S] additive
    scale: float,
) -> torch.Tensor:
    """Attention in two batched GEMMs (scores scaled and biased in the first, softmax in fp32, the weights back
    in the model dtype for the second), whose rows do not depend on how many come with them when there are at
    least two (`exact_rows`; `FastTarget.forward` runs a single token as two rows). Returns [nkv, R, hd]."""
    scores = torch.baddbmm(bias, q, k.transpose(-1, -2), alpha=scale)  # [nkv, R, S]
    return torch.bmm(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)  # [nkv, R, hd]


def row_attention_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask [B, T, S] -> additive bias [B, 1, g·T, S] for `row_attention` (row r·T + t is token t)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return bias.repeat(1, groups, 1)[:, None]


def row_attention(
    q: torch.Tensor,  # [B, T, nh, hd]
    k_rows: torch.Tensor,  # [B, nkv, S, hd]
    v_rows: torch.Tensor,  # [B, nkv, S, hd]
    bias: torch.Tensor,  # [B, 1, g·T, S] from row_attention_bias (g = 1 unless stacked)
    scale: float,
    stacked: bool = True,
) -> torch.Tensor:
    """`grouped_attention` for B rows, each over its own cache; returns [B·T, nh·hd]."""
    b, t, nh, hd = q.shape
    if not stacked:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k_rows, v_rows, attn_mask=bias, scale=scale,
                                           enable_gqa=True)  # [B, nh, T, hd]
        return o.transpose(1, 2).reshape(b * t, nh * hd)
    nkv = k_rows.shape[1]
    g = nh // nkv
    qg = q.view(b, t, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, g * t, hd)  # head kv·g + r: row r·T + t
    o = F.scaled_dot_product_attention(qg, k_rows, v_rows, attn_mask=bias, scale=scale)  # [B, nkv, g·T, hd]
    return o.view(b, nkv, g, t, hd).permute(0, 3, 1, 2, 4).reshape(b * t, nh * hd)


def _split_unusable(device: torch.device | str, head_dim: int) -> str | None:
    """Why the split attention cannot run for this target, or None."""
    if torch.device(device).type != "cuda":
        return "needs a CUDA device"
    if not split.triton_available():
        return "needs Triton (it comes with PyTorch's CUDA wheels)"
    if not split.supports(head_dim, 1):
        return f"takes head sizes {', '.join(map(str, split.HEAD_DIMS))}, not {head_dim}"
    return None


def target_attention_for(choice: str | None, device: torch.device | str, head_dim: int,
                         sdpa_heads: bool = False) -> str:
    """`FastOptions.target_attention` (`--target-attention`) for a target on `device`: "split", "sdpa" or
    "matmul". None or "auto": split where it can run (CUDA, Triton, a head size `eagle3.fast.split_attention`
    takes), sdpa elsewhere and with `sdpa_heads` (the query heads as SDPA heads were asked for). "split" where it
    cannot run is a configuration error."""
    unusable = _split_unusable(device, head_dim)
    if choice is None or choice == "auto":
        return "split" if unusable is None and not sdpa_heads else "sdpa"
    if choice not in TARGET_ATTENTION:
        raise ConfigError(f"target attention {choice!r}: expected one of {TARGET_ATTENTION}")
    if choice == "split" and unusable is not None:
        raise ConfigError(f"--target-attention split {unusable}; use auto or sdpa")
    return choice


def residual_in_gemm(device: torch.device | str) -> bool:
    """Whether a new `FastTarget` adds each residual in the epilogue of the product before it (`Tensor.addmm_`
    on the residual: h += x·Wᵀ in one cuBLAS kernel, accumulated in fp32 and rounded once, where a product and
    then an add round twice): on CUDA, where it takes away two elementwise kernels per decoder layer. In place,
    because the out-of-place `torch.addmm` first copies h into its result (a copy kernel for each add). CPUs
    keep the separate add, which costs no more there.
    The rows of a product keep their bits whichever way the residual is added (the epilogue is elementwise), so
    bf16 chains and plain decoding round alike either way; against HF's own forward, which rounds twice, bf16
    values can differ by one unit in the last place."""
    return torch.device(device).type == "cuda"


def add_rms_norm(
    h: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: (h + o, rms_norm(h + o)), [N, H] each."""
    h = h + o
    return h, rms_norm(h, weight, eps)


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: [N, 2·I] (gate, up) -> silu(gate) * up [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def exact_rows(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fast path must give a token the same bits in a one-token step as in a many-token verification
    by its own choice of kernels (`FastTarget.forward` runs one token as two equal rows; `rows_exact_attention`),
    rather than by the vendor's.

    CPUs in bf16/fp16 without AMX. torch multiplies a single row with a matrix-vector kernel and several rows with
    oneDNN's GEMM, and its CPU SDPA kernel blocks queries by their count. On a CPU with AMX both agree row for row,
    so the vendor's kernels stay there; on one without (e.g. AMD EPYC with AVX512-BF16) the two products and SDPA
    round some rows differently, so a chain's verification drifts from plain decoding. GEMMs of 2..8 rows agree
    row for row there, a one-row product fed as two rows costs about the same, and attention as two batched GEMMs
    agrees row for row; plain decoding pays a little for it (docs/benchmarks.md). On CUDA the vendor kernels
    already agree, and in fp32 greedy output stays identical without it (tests/test_fast.py)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not cpu_has_amx()


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token ids: argmax over the last dimension of logits [..., V] -> [...].

    On a CPU torch's bf16/fp16 argmax is several times slower than its fp32 one; the upcast is
    exact and both return the first maximum, so the ids are the same. Elsewhere the logits are used as they are."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(dim=-1)


def _cpu_probe(name: str) -> bool:
    """torch's private CPU feature probe `torch.cpu.<name>`; False where this torch lacks it."""
    probe = getattr(torch.cpu, name, None)
    return bool(probe is not None and probe())


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later)."""
    return _cpu_probe("_is_amx_tile_supported")


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: AMX tiles (Intel Sapphire Rapids and later) or AVX512-BF16 (AMD
    Zen 4 and later, some Intel). There a bf16 product of a few rows costs about what one row does, and bf16
    decoding is faster than fp32; elsewhere bf16 is emulated and slow."""
    return cpu_has_amx() or _cpu_probe("_is_avx512_bf16_supported")


def cpu_packs_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a new `FastTarget` / `FastDrafter` multiplies by its matrices packed once into oneDNN's blocked
    layout (`PackedWeights`): in bf16 on CPUs with AVX512-BF16 and no AMX, where `exact_rows` runs every forward
    on two rows or more. There torch's bf16 `F.linear` takes about twice the time of the same product over a
    packed weight, with the same bits, and the packed product's rows agree whether it gets 2, 3, 4 or 8 of them.
    CPUs with AMX keep torch's kernels, whose one-row and many-row products agree there (`exact_rows`); CUDA
    never packs."""
    dev = torch.device(device)
    return (dev.type == "cpu" and dtype == torch.bfloat16 and cpu_has_bf16() and not cpu_has_amx()
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedWeights:
    """Copies of some matrices packed for oneDNN's product (`cpu_packs_weights`), found by the dense weight they
    copy: `linear(x, w, b)` is `F.linear(x, w, b)`, over the packed copy where `w` has one. The packing ops are
    those inductor's CPU weight prepacking emits (torch/_inductor/fx_passes/mkldnn_fusion.py in pytorch/pytorch:
    `mkldnn._reorder_linear_weight`, then `mkldnn._linear_pointwise` with no post-op)."""

    def __init__(self, weights: list[torch.Tensor], rows: int = 2):
        # rows: the product's row count the layout is chosen for (any count works; 2 is a one-token step's)
        self._packed = {self._key(w): torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights}

    @staticmethod
    def _key(w: torch.Tensor) -> tuple[int, tuple[int, ...]]:
        return w.data_ptr(), tuple(w.shape)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        packed = self._packed.get(self._key(w))
        if packed is None:
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def pack_weights(device: torch.device, dtype: torch.dtype, weights: list[torch.Tensor]) -> PackedWeights | None:
    """`PackedWeights` of these matrices where `cpu_packs_weights` says so, else None."""
    return PackedWeights(weights) if cpu_packs_weights(device, dtype) else None


# The pieces `Pointwise` can compile. ELEMENTWISE are those without reductions: a token's values do not depend
# on how many tokens share the forward whichever kernel inductor generates for that count (a specialised one for
# one token, a dynamic one for many), so a one-token step and a many-token verification round alike. The norms
# reduce over the hidden size, and inductor may split a one-row reduction where it does not split 61 rows: with
# them compiled, bf16 chains part from plain decoding (docs/benchmarks.md).
POINTWISE_PIECES = ("norm", "add_norm", "rope", "rope_heads", "gate", "qkv_rope")
ELEMENTWISE_PIECES = ("rope", "rope_heads", "gate", "qkv_rope")
# `--fuse-pointwise` levels (`FastOptions.fuse_pointwise`, read by `fuse_level`): the pieces each compiles.
FUSE_LEVELS = dict(zip(FUSE_POINTWISE_LEVELS, (ELEMENTWISE_PIECES, POINTWISE_PIECES), strict=True))


def fuse_level(value: bool | str | None, device: torch.device | str) -> str | None:
    """`FastOptions.fuse_pointwise` (or `--fuse-pointwise`) for a target on `device`, as a `FUSE_LEVELS` key or
    None (off). None or "auto": "elementwise" on CUDA (faster, and bf16 chains stay identical to plain decoding),
    off elsewhere (the auto of
    every auto/on/off option, `eagle3.config.on_for_device`: on a CPU compiled pieces run outside CUDA graphs and
    their call overhead costs more than they save); False or "off": off; True: "all" (the flag alone); a
    level: itself."""
    if value is None or value == "auto":
        return "elementwise" if on_for_device("auto", device) else None
    if value is False or value == "off":
        return None
    level = "all" if value is True else value
    if level not in FUSE_LEVELS:
        raise ConfigError(f"--fuse-pointwise {value!r}: expected one of {FUSE_POINTWISE_CHOICES}")
    return level


class Pointwise:
    """The elementwise work of a decoder layer (norms, residual adds, RoPE, SwiGLU), eager or compiled.

    Compiled (`backend` given; `pieces`, default all of them), each piece becomes one or two inductor kernels, while
    the matrix products and the attention stay with the vendor libraries (cuBLAS, cuDNN), which beats both eager
    and compiling the whole step (docs/benchmarks.md). The pieces compile for the first shapes they see and,
    once the number of tokens changes, for any number of tokens (dynamo's automatic dynamic shapes), so prefills
    of any length reuse them while the model's own sizes stay constants in the kernels. With `dynamic=True` those
    sizes would be runtime values too, and every index would go through integer divisions by them (visible in
    inductor's CPU code), which makes the kernels slower.
    Inductor may round a one-row step (a specialised kernel) differently from a many-row verification where a
    piece reduces (the norms; `ELEMENTWISE_PIECES` do not); in fp32 greedy output stays identical
    (tests/test_fast.py), and in bf16 the share of identical answers is what `eagle3 bench` reports.
    """

    def __init__(self, backend: str | None = None, pieces: tuple[str, ...] = POINTWISE_PIECES):
        unknown = set(pieces) - set(POINTWISE_PIECES)
        if unknown:
            raise ValueError(f"unknown pointwise pieces {sorted(unknown)}; expected some of {POINTWISE_PIECES}")
        self.fused = frozenset(pieces if backend is not None else ())
        fns = {"norm": rms_norm, "add_norm": add_rms_norm, "rope": apply_rope, "rope_heads": apply_rope_heads,
               "gate": silu_gate, "qkv_rope": heads_first_rope}
        for name, f in fns.items():
            if name in self.fused:
                f = torch.compile(f, dynamic=None, fullgraph=True, backend=backend)
            setattr(self, name, f)

    @property
    def compiled(self) -> bool:
        return bool(self.fused)

    def rope_heads_into(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        out: torch.Tensor | None = None) -> None:
        """`apply_rope_heads` written into `out` (default: x, in place); compiled, the result is copied there."""
        out = x if out is None else out
        if "rope_heads" in self.fused:
            out.copy_(self.rope_heads(x, cos, sin))
        else:
            apply_rope_heads(x, cos, sin, out=out)


EAGER = Pointwise()


def _cat_bias(parts: list[nn.Linear]) -> torch.Tensor | None:
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([
        p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in parts
    ])


class _Layer(nn.Module):
    """One decoder layer's weights, as buffers (fused q/k/v and gate/up are copies; the others are shared)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        self._hf = [layer]  # a list, so it is not registered as a submodule: `fuse` reads its weights again
        self.register_buffer("ln1", layer.input_layernorm.weight.detach(), persistent=False)
        self.register_buffer("ln2", layer.post_attention_layernorm.weight.detach(), persistent=False)
        qkv = [a.q_proj, a.k_proj, a.v_proj]
        self.register_buffer("wqkv", None, persistent=False)
        self.register_buffer("w13", None, persistent=False)
        self.fuse(folded=False)
        self.register_buffer("bqkv", _cat_bias(qkv), persistent=False)
        self.register_buffer("wo", a.o_proj.weight.detach(), persistent=False)
        self.register_buffer("bo", None if a.o_proj.bias is None else a.o_proj.bias.detach(), persistent=False)
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)  # Qwen3: RMSNorm over head_dim
        self.register_buffer("q_norm", None if qn is None else qn.weight.detach(), persistent=False)
        self.register_buffer("k_norm", None if kn is None else kn.weight.detach(), persistent=False)
        gu = [m.gate_proj, m.up_proj]
        self.register_buffer("b13", _cat_bias(gu), persistent=False)
        self.register_buffer("w2", m.down_proj.weight.detach(), persistent=False)
        self.register_buffer("b2", None if m.down_proj.bias is None else m.down_proj.bias.detach(),
                             persistent=False)

    @torch.no_grad()
    def fuse(self, folded: bool) -> None:
        """(Re)build the fused q/k/v and gate/up matrices from the HF layer, with the input and post-attention norm
        weights folded into their columns (`eagle3.fast.norm_fold`) or not."""
        a, m = self._hf[0].self_attn, self._hf[0].mlp
        self.wqkv = self.w13 = None  # the old copies go before the new ones are made
        wqkv = torch.cat([p.weight.detach() for p in (a.q_proj, a.k_proj, a.v_proj)])
        w13 = torch.cat([p.weight.detach() for p in (m.gate_proj, m.up_proj)])
        if folded:
            wqkv, w13 = fold_columns(wqkv, self.ln1), fold_columns(w13, self.ln2)
        self.wqkv, self.w13 = wqkv, w13


class FastTarget(nn.Module):
    """The target's weights plus a static KV cache; `forward` runs T tokens at given positions and cache slots."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None):
        super().__init__()
        reason = fast_support(model)
        if reason is not None:
            raise ConfigError(f"this target cannot use the fast path: {reason}; use the generic engine")
        cfg = _text_config(model)
        base = model.model
        self.num_layers = len(base.layers)
        self.nh = cfg.num_attention_heads
        self.nkv = getattr(cfg, "num_key_value_heads", None) or self.nh
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.hidden_size = cfg.hidden_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = float(getattr(base.layers[0].self_attn, "scaling", self.hd**-0.5))
        self.max_window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.aux_layer_ids = sorted(aux_layer_ids or [])
        for k in self.aux_layer_ids:
            if not 0 <= k <= self.num_layers:
                raise ConfigError(f"aux layer id {k} is out of range (0..{self.num_layers}) for this target")
        self.layers = nn.ModuleList([_Layer(layer) for layer in base.layers])
        self.register_buffer("embed", model.get_input_embeddings().weight.detach(), persistent=False)
        self.register_buffer("norm", base.norm.weight.detach(), persistent=False)
        self.register_buffer("lm_head", model.get_output_embeddings().weight.detach(), persistent=False)
        self._rotary = [base.rotary_emb]  # a list, so it is not registered as a submodule
        self.dtype = self.embed.dtype
        self.vocab_size = self.lm_head.shape[0]
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self.register_buffer("kv_cache", None, persistent=False)  # [L, 2·n_kv, S, hd]: K heads, then V heads
        self.k_cache = self.v_cache = None  # [L, n_kv, S, hd] views of kv_cache (`allocate`)
        self.seq_len = 0
        self.alloc_id = 0  # bumped by every reallocation: graphs captured before it are stale
        self.pointwise = EAGER
        self.stacked = stack_query_heads()  # the GQA layout of attention (`stack_query_heads`)
        self.exact_rows = exact_rows(self.device, self.dtype)
        self.residual_in_gemm = residual_in_gemm(self.device)  # set before capturing graphs
        self.packed = pack_weights(self.device, self.dtype, self.matrices())  # `cpu_packs_weights`
        # How decoding forwards attend (`target_attention_for`, `use_attention`). "matmul" (`rows_exact_attention`
        # in every forward, not only with `exact_rows`) is an experiment; on CUDA it is no faster than cuDNN's
        # SDPA.
        self.attention = target_attention_for("auto", self.device, self.hd)
        # Forwards that attend by splits also rotate q and k and write K and V in one kernel per layer
        # (`eagle3.fast.rope_cache`); False (`scripts/profile_step.py --target-rope torch`) keeps the compiled
        # rotation and the index copy, for comparison.
        self.rope_kernel = True
        # ... and take their greedy ids by `eagle3.fast.row_argmax` (`argmax`); False (`profile_step.py
        # --target-argmax torch`): torch's argmax, for comparison
        self.argmax_kernel = True
        # "auto" | "fold" | "on" | "off": the layers' RMSNorms folded into their products (`eagle3.fast.norm_fold`),
        # or by `eagle3.fast.row_norm`, or torch's (`select_norm`)
        self.norm_kernel = "auto"
        # whether the q/k/v and gate/up matrices hold their norms' weights (`select_norm`); not with biases there
        self.folded = False
        self.foldable = all(lw.bqkv is None and lw.b13 is None for lw in self.layers)
        self.select_norm()

    def matrices(self) -> list[torch.Tensor]:
        """The weight matrices of the products: each layer's four, then the lm_head."""
        return [m for lw in self.layers for m in (lw.wqkv, lw.wo, lw.w13, lw.w2)] + [self.lm_head]

    def use_sdpa_heads(self) -> None:
        """Attend with the query heads as SDPA heads from now on (`stack_query_heads` says what it gains and
        costs); call before capturing graphs."""
        self.stacked = False
        if self.attention == "split":
            self.attention = "sdpa"
            self.select_norm()

    def use_norm_kernel(self) -> None:
        """Run the RMSNorms through `eagle3.fast.row_norm` (one Triton program per row) whatever the attention
        (`scripts/profile_step.py --target-norm triton`); call after `fuse_pointwise` and before capturing graphs
        (CUDA only). By default they do so where the target attends by splits (`select_norm`)."""
        if self.device.type != "cuda":
            raise ConfigError("the Triton RMSNorm runs on CUDA only")
        self.norm_kernel = "on"
        self.select_norm()

    def select_norm(self) -> None:
        """Set the RMSNorms of every forward, as `norm_kernel` says; call before capturing graphs.

        Folded ("fold", or "auto" where the target attends by splits with the RoPE kernel, the Triton decoding
        path): each layer's two norm weights go into its q/k/v and gate/up matrices and the kernels after those
        products apply the rows' scale (`eagle3.fast.norm_fold`); not where those products have biases (Qwen2), nor
        with compiled norms (`fuse_pointwise` "all"). The final norm, and every norm otherwise, is
        `eagle3.fast.row_norm` ("on", or "auto"/"fold" on that path, where it is faster than `F.rms_norm`), else
        `rms_norm`; compiled norms stay."""
        if self.norm_kernel not in ("auto", "fold", "on", "off"):
            raise ConfigError(f"norm_kernel {self.norm_kernel!r}: expected auto, fold, on or off")
        compiled = "norm" in self.pointwise.fused
        if self.norm_kernel == "fold" and (compiled or not self.foldable):
            raise ConfigError("the norms cannot be folded into this target's products: "
                              + ("they are compiled (--fuse-pointwise all)" if compiled else
                                 "its q/k/v or gate/up projections have biases"))
        decoding_path = self.attention == "split"
        fold = self.norm_kernel == "fold" or (self.norm_kernel == "auto" and decoding_path and self.rope_kernel
                                              and self.foldable and not compiled)
        if fold != self.folded:
            for lw in self.layers:
                lw.fuse(folded=fold)
            self.folded = fold
            if self.packed is not None:  # the packed copies are of the matrices just replaced
                self.packed = pack_weights(self.device, self.dtype, self.matrices())
        if compiled:
            return
        on = self.norm_kernel == "on" or (self.norm_kernel in ("auto", "fold") and decoding_path)
        want = rms_norm_rows if on else rms_norm
        if self.pointwise.norm is not want:
            self.pointwise = copy.copy(self.pointwise)  # EAGER is shared by every target
            self.pointwise.norm = want

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy ids [T] of logits [T, V]: by `eagle3.fast.row_argmax` where the target attends by splits and
        `argmax_kernel` is on, else `argmax_ids` (the same ids)."""
        if self.attention == "split" and self.argmax_kernel:
            return argmax_rows(logits)
        return argmax_ids(logits)

    def use_attention(self, choice: str | None) -> str:
        """Attend in decoding forwards as `choice` says (`target_attention_for`; call before capturing graphs),
        with the norms that go with it (`select_norm`); returns what it resolved to."""
        self.attention = target_attention_for(choice, self.device, self.hd, sdpa_heads=not self.stacked)
        self.select_norm()
        return self.attention

    def fuse_pointwise(self, backend: str = "inductor", level: bool | str | None = "all") -> None:
        """Run the elementwise work as compiled kernels from now on (`Pointwise`; `level` as `fuse_level`:
        "elementwise" leaves the norms eager; "off", or "auto" off CUDA, leaves everything as it is); compiles on
        first use, so call it before capturing graphs."""
        level = fuse_level(level, self.device)
        if level is None:
            return
        if self.device.type != "cuda":
            # Without CUDA graphs every compiled call pays its guard checks in Python, about 120 per step, which
            # makes CPU decoding slower (docs/benchmarks.md).
            log.warning("--fuse-pointwise on %s: compiled pieces are not captured in graphs here, and their call "
                        "overhead makes decoding slower; it is meant for CUDA", self.device)
        self.pointwise = Pointwise(backend, FUSE_LEVELS[level])
        self.select_norm()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    # -- static buffers ------------------------------------------------------------------------
    @torch.no_grad()
    def allocate(self, seq_len: int) -> None:
        """(Re)allocate the KV cache and the RoPE table for S = seq_len slots (a no-op when the size is unchanged,
        so engines sharing this target keep their captured graphs). K and V share one tensor [L, 2·n_kv, S, hd]
        (`kv_cache`; `k_cache` and `v_cache` are its [L, n_kv, S, hd] halves, each layer's half contiguous as
        attention reads it), so that a forward writes a layer's new K and V with one index copy and a commit
        moves the accepted path's K and V with one gather and one copy."""
        if seq_len == self.seq_len:
            return
        if self.max_window and seq_len > self.max_window:
            raise ConfigError(
                f"the fast path needs {seq_len} cache slots but this target's sliding_window is "
                f"{self.max_window}; shorten the prompt or max_new_tokens, or use the generic engine"
            )
        dev, dt = self.device, self.dtype
        self.cos, self.sin = self.rope_table(seq_len)
        self.kv_cache = torch.zeros(self.num_layers, 2 * self.nkv, seq_len, self.hd, dtype=dt, device=dev)
        self.k_cache, self.v_cache = self.kv_cache[:, : self.nkv], self.kv_cache[:, self.nkv :]
        self.seq_len = seq_len
        self.alloc_id += 1

    @torch.no_grad()
    def rope_table(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [S, hd] for positions 0..seq_len-1, from the model's own rotary module."""
        dev, dt = self.device, self.dtype
        pos = torch.arange(seq_len, device=dev)[None]  # [1, S]
        cos, sin = self._rotary[0](torch.zeros(1, dtype=dt, device=dev), pos)  # [1, S, hd] each
        return rope_tables(cos[0].to(dt), sin[0].to(dt))

    def rope_qk(self, qkv: torch.Tensor, lw: _Layer, cos: torch.Tensor, sin: torch.Tensor):
        """Fused projections qkv [N, (nh + 2·nkv)·hd] -> RoPE'd q [N, nh, hd] and k [N, nkv, hd] (Qwen3: RMSNorm
        over head_dim first), tokens first; cos/sin [N, hd]."""
        n, nh, nkv, hd = qkv.shape[0], self.nh, self.nkv, self.hd
        pw = self.pointwise
        if lw.q_norm is None:  # RoPE on q and k at once: they are adjacent in the fused output
            qk = pw.rope(qkv[:, : (nh + nkv) * hd].view(n, nh + nkv, hd), cos, sin)
            return qk[:, :nh], qk[:, nh:]
        q = pw.rope(pw.norm(qkv[:, : nh * hd].view(n, nh, hd), lw.q_norm, self.eps), cos, sin)
        k = pw.rope(pw.norm(qkv[:, nh * hd : (nh + nkv) * hd].view(n, nkv, hd), lw.k_norm, self.eps), cos, sin)
        return q, k

    def rope_tables_heads(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) at positions pos [N], laid out as `qkv_heads_first` reads them: [nh + nkv, N, hd]
        contiguous, the rows of each token repeated per head (slice [:heads] for fewer heads).

        Once per forward, so that RoPE's products and sum in every layer run on operands of one shape and layout
        (vectorized kernels) instead of broadcasting [N, hd] over the heads, which the generic elementwise kernel
        does at about twice the time for a verification's tokens."""
        heads = self.nh + self.nkv
        return tuple(t[pos].expand(heads, -1, -1).contiguous() for t in (self.cos, self.sin))

    def qkv_heads_first(
        self, qkv: torch.Tensor, lw: _Layer, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused projections qkv [N, (nh + 2·nkv)·hd] -> RoPE'd q [nh, N, hd] and the layer's new cache entries
        kv [2·nkv, N, hd] (RoPE'd K heads, then V heads; `kv_cache`'s layout), heads first and contiguous (Qwen3:
        RMSNorm over head_dim first); cos/sin [nh + nkv, N, hd] from `rope_tables_heads`. The values are
        `rope_qk`'s bit for bit (the same elementwise operations on the same operands).

        One copy brings all heads of q, k and v in front (none for N = 1: a single row already lies that way), and
        RoPE writes its results back into that copy, so q is a view and K and V sit next to each other for one
        cache write. Stacked attention views q as [nkv, g·N, hd]; the copy replaces the one `torch.roll` makes of a
        strided input and the transposing copy of q per layer."""
        n, nh, nkv, hd = qkv.shape[0], self.nh, self.nkv, self.hd
        pw = self.pointwise
        if lw.q_norm is None and "qkv_rope" in pw.fused:  # the copy and RoPE in one compiled kernel
            x = pw.qkv_rope(qkv.view(n, nh + 2 * nkv, hd), cos, sin, nh + nkv)  # [nh + 2·nkv, N, hd]
            return x[:nh], x[nh:]
        x = heads_first(qkv.view(n, nh + 2 * nkv, hd))  # [nh + 2·nkv, N, hd]: q, k, v heads
        if lw.q_norm is None:  # RoPE on q and k at once: they are adjacent in the fused output
            pw.rope_heads_into(x[: nh + nkv], cos, sin)
        else:
            pw.rope_heads_into(pw.norm(x[:nh], lw.q_norm, self.eps), cos[:nh], sin[:nh], out=x[:nh])
            pw.rope_heads_into(pw.norm(x[nh : nh + nkv], lw.k_norm, self.eps), cos[:nkv], sin[:nkv],
                               out=x[nh : nh + nkv])
        return x[:nh], x[nh:]

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear`, over a packed copy of `w` where this target packs its weights (`cpu_packs_weights`)."""
        return F.linear(x, w, b) if self.packed is None else self.packed.linear(x, w, b)

    def qkv(self, h: torch.Tensor, lw: _Layer) -> torch.Tensor:
        """Layer lw's fused q/k/v projections [N, (nh + 2·nkv)·hd] of its input h [N, H] (normed first, or, with
        folded norms, scaled after: `eagle3.fast.norm_fold`), for the PyTorch paths that norm every layer anew."""
        if self.folded:
            return scale_rows(self.linear(h, lw.wqkv), h, self.eps)
        return self.linear(self.pointwise.norm(h, lw.ln1, self.eps), lw.wqkv, lw.bqkv)

    def gated(self, x: torch.Tensor, lw: _Layer) -> torch.Tensor:
        """silu(gate) * up of the normed x [N, H] -> [N, I]: the MLP's input to its down projection. With folded
        norms x is the residual h itself, whose scale the activation applies (`eagle3.fast.norm_fold`)."""
        if self.folded:
            return scaled_gate(self.linear(x, lw.w13), x, self.eps)
        return self.pointwise.gate(self.linear(x, lw.w13, lw.b13))

    def _adds_in_product(self, b: torch.Tensor | None) -> bool:
        """Whether a residual add goes into the epilogue of a product with bias `b` (`residual_in_gemm`; a bias
        keeps the add after the product)."""
        return self.residual_in_gemm and b is None

    def add_linear(self, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The residual h [N, H] plus the product x [N, K] · wᵀ (+ b): in the product's epilogue where
        `_adds_in_product`, else added after it."""
        if self._adds_in_product(b):
            return h.addmm_(x, w.t())  # in place: out-of-place addmm first copies h into its result
        return h + self.linear(x, w, b)

    def add_linear_norm(
        self, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, norm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_linear` and the RMSNorm (weight `norm`) after it: (h', norm(h')), [N, H] each. Without the add in
        the product the add and the norm are one piece (`Pointwise.add_norm`: one kernel when all are fused)."""
        if self._adds_in_product(b):
            h = h.addmm_(x, w.t())
            return h, self.pointwise.norm(h, norm, self.eps)
        return self.pointwise.add_norm(h, self.linear(x, w, b), norm, self.eps)

    def mlp_block(self, h: torch.Tensor, lw: _Layer) -> torch.Tensor:
        """The post-attention half of a decoder layer: h + the MLP of the normed h, [N, H]."""
        x = h if self.folded else self.pointwise.norm(h, lw.ln2, self.eps)
        return self.add_linear(h, self.gated(x, lw), lw.w2, lw.b2)

    def post_attention(
        self, i: int, h: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i after its attention: the output projection of `o` (attention output [N, nh·hd]) and its
        residual add, the MLP and its residual add, then the next norm (layer i+1's input norm, or the final norm
        after the last layer). Returns h [N, H] and that norm of it [N, H]; with folded norms, None instead of
        layer i+1's input norm (its products read h and scale their outputs, `eagle3.fast.norm_fold`)."""
        lw = self.layers[i]
        last = i + 1 == self.num_layers
        if self.folded:
            h = self.add_linear(h, o, lw.wo, lw.bo)
            if not last:
                return self.add_linear(h, self.gated(h, lw), lw.w2, lw.b2), None
            return self.add_linear_norm(h, self.gated(h, lw), lw.w2, lw.b2, self.norm)
        h, x = self.add_linear_norm(h, o, lw.wo, lw.bo, lw.ln2)
        after = self.norm if last else self.layers[i + 1].ln1
        return self.add_linear_norm(h, self.gated(x, lw), lw.w2, lw.b2, after)

    def weight_bytes(self) -> int:
        """Bytes read per decoding step for weights: layers, final norm and lm_head (the embedding table is
        read one row at a time, so it counts only when it is the lm_head too)."""
        n = sum(b.numel() * b.element_size() for layer in self.layers for b in layer.buffers())
        return n + self.norm.numel() * self.norm.element_size() + self.lm_head.numel() * self.lm_head.element_size()

    def kv_bytes(self, context: int) -> int:
        """K and V bytes of `context` cached positions over all layers."""
        return 2 * self.num_layers * self.nkv * context * self.hd * self.k_cache.element_size()

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        ids: torch.Tensor,  # [T] long
        pos: torch.Tensor,  # [T] long, RoPE positions
        slots: torch.Tensor,  # [T] long, cache slots to write K/V at
        mask: torch.Tensor,  # bool [T, S]: which slots each token sees (its own, none beyond the last of `slots`)
        last_only: bool = False,  # logits for the last token only (prefill)
        want_aux: bool = False,
        logits_at: torch.Tensor | None = None,  # [1] long: logits for this token only (a padded prefill's last)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns logits [T or 1, V] in the model dtype and aux features [T, 3·H] (None unless want_aux)."""
        t = ids.shape[0]
        if t == 1 and self.exact_rows:  # one token as two equal rows: the many-row kernels' bits (`exact_rows`)
            logits, aux = self.forward(ids.repeat(2), pos.repeat(2), slots.repeat(2), mask.expand(2, -1),
                                       want_aux=want_aux)
            return logits[:1], (None if aux is None else aux[:1])
        nh, nkv = self.nh, self.nkv
        h = F.embedding(ids, self.embed)  # [T, H]
        exact = self.exact_rows or self.attention == "matmul"
        stacked, groups = gqa_layout(self.stacked or exact, nh, nkv)
        by_splits = (self.attention == "split" and not shapes_vary() and split.supports(self.hd, t)
                     and not torch.compiler.is_compiling())  # `--compile` traces whole steps: SDPA there
        by_kernel = by_splits and self.rope_kernel  # RoPE and the cache write in one kernel (`rope_cache`)
        cos, sin = (None, None) if by_kernel else self.rope_tables_heads(pos)  # [nh + nkv, T, hd]
        bias = None if by_splits else attention_bias(mask, groups, self.dtype)  # [1, 1, g·T, S]
        aux: list[torch.Tensor] = []
        folded = self.folded  # then x is None between layers: the products read h (`eagle3.fast.norm_fold`)
        x = None if folded else self.pointwise.norm(h, self.layers[0].ln1, self.eps)  # [T, H]: the next input
        for i, lw in enumerate(self.layers):
            if want_aux and i in self.aux_layer_ids:
                aux.append(h.clone() if self.residual_in_gemm else h)  # h changes in place
            qkv = self.linear(h if folded else x, lw.wqkv, lw.bqkv)  # [T, (nh + 2·nkv)·hd]
            if by_kernel:  # q [nh, T, hd]; K and V written at `slots` of [2·nkv, S, hd]
                q = rope_into_cache(qkv, self.cos, self.sin, pos, slots, self.kv_cache[i], nh,
                                    None if lw.q_norm is None else (lw.q_norm, lw.k_norm), self.eps,
                                    rms=h if folded else None)
            else:
                if folded:
                    qkv = scale_rows(qkv, h, self.eps)
                q, kv = self.qkv_heads_first(qkv, lw, cos, sin)  # [nh, T, hd], [2·nkv, T, hd]
                self.kv_cache[i].index_copy_(1, slots, kv)  # [2·nkv, S, hd]: K and V written at `slots`
            if by_splits:  # q as [n_kv, g·T, hd] (a view): row r·T + t is head kv·g + r
                o = split.split_attention(q.view(nkv, -1, self.hd), self.k_cache[i], self.v_cache[i], mask,
                                          self.scale, last=slots)  # [T, nh·hd]
            else:
                o = grouped_attention(q, self.k_cache[i], self.v_cache[i], bias, self.scale, stacked,
                                      exact)  # [T, nh·hd]
            h, x = self.post_attention(i, h, o)
        if want_aux and self.num_layers in self.aux_layer_ids:
            aux.append(h)
        if last_only:
            x = x[-1:]
        elif logits_at is not None:
            x = x.index_select(0, logits_at)  # [1, H]
        logits = self.linear(x, self.lm_head)  # [T', V]
        return logits, (torch.cat(aux, dim=-1) if want_aux else None)  # aux [T, 3·H]

    def forward_rows(
        self,
        ids: torch.Tensor,  # [B, T] long
        pos: torch.Tensor,  # [B, T] long, RoPE positions
        slots: torch.Tensor,  # [B, T] long, slots of each row's own cache
        mask: torch.Tensor,  # bool [B, T, S]
        k_rows: torch.Tensor,  # [L, B, n_kv, S, hd]: one cache per row (`eagle3.fast.rows`)
        v_rows: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],  # (cos, signed sin) [S, hd] from `rope_table`
        logits_at: torch.Tensor | None = None,  # [B] one position per row (prefill: each prompt's last token)
        want_aux: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` for B rows of T tokens, each row with its own cache; returns logits [B, T, V] ([B, 1, V] at
        `logits_at`) and aux [B, T, 3·H] (None unless want_aux)."""
        b, t = ids.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        rows = torch.arange(b, device=ids.device)[:, None]  # [B, 1]
        h = F.embedding(ids.reshape(-1), self.embed)  # [B·T, H]
        cos, sin = rope[0][pos.reshape(-1)], rope[1][pos.reshape(-1)]  # [B·T, hd]
        stacked, groups = gqa_layout(self.stacked, nh, nkv)
        bias = row_attention_bias(mask, groups, self.dtype)  # [B, 1, g·T, S]
        aux: list[torch.Tensor] = []
        folded = self.folded
        x = None if folded else self.pointwise.norm(h, self.layers[0].ln1, self.eps)  # [B·T, H]
        for i, lw in enumerate(self.layers):
            if want_aux and i in self.aux_layer_ids:
                aux.append(h.clone() if self.residual_in_gemm else h)  # h changes in place
            qkv = self.linear(h if folded else x, lw.wqkv, lw.bqkv)  # [B·T, (nh + 2·nkv)·hd]
            if folded:
                qkv = scale_rows(qkv, h, self.eps)
            q, k = self.rope_qk(qkv, lw, cos, sin)  # [B·T, nh, hd], [B·T, nkv, hd]
            k_rows[i][rows, :, slots] = k.view(b, t, nkv, hd)  # row b's tokens at its slots
            v_rows[i][rows, :, slots] = qkv[:, (nh + nkv) * hd :].view(b, t, nkv, hd)
            o = row_attention(q.view(b, t, nh, hd), k_rows[i], v_rows[i], bias, self.scale, stacked)  # [B·T, nh·hd]
            h, x = self.post_attention(i, h, o)
        if want_aux and self.num_layers in self.aux_layer_ids:
            aux.append(h)
        x = x.view(b, t, -1)  # the final norm of h
        if logits_at is not None:
            x = x[rows[:, 0], logits_at][:, None]  # [B, 1, H]
        logits = self.linear(x, self.lm_head)  # [B, T', V]
        return logits, (torch.cat(aux, dim=-1).view(b, t, -1) if want_aux else None)  # aux [B, T, 3·H]
