"""The elementwise work of a decoder layer (RMSNorm, RoPE, SwiGLU, residual adds), eager or with RoPE and SwiGLU
compiled (`Pointwise`, `FastOptions.fuse_pointwise` as `fuse_level` reads it), and where the residual adds go
(`residual_in_gemm`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3.config import FUSE_POINTWISE_CHOICES, ConfigError, on_for_device


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


# The pieces `Pointwise` compiles: those without reductions, so a token's values do not depend on how many tokens
# share the forward whichever kernel inductor generates for that count (a specialised one for one token, a dynamic
# one for many), and a one-token step and a many-token verification round alike. The norms reduce over the hidden
# size, and inductor may split a one-row reduction where it does not split 61 rows: compiled too, they broke bf16
# chain identity (docs/benchmarks.md), so they stay eager.
ELEMENTWISE_PIECES = ("rope", "gate")


def fuse_level(value: bool | str | None, device: torch.device | str) -> str | None:
    """`FastOptions.fuse_pointwise` for a target on `device`: "elementwise" (compile `ELEMENTWISE_PIECES`) or None
    (off). None or "auto": elementwise on CUDA (faster, and bf16 chains stay identical to plain decoding), off
    elsewhere (the auto of every auto/on/off option, `eagle3.config.on_for_device`: on a CPU compiled pieces run
    outside CUDA graphs and their call overhead costs more than they save); False or "off": off; True or
    "elementwise": elementwise."""
    if value is None or value == "auto":
        return "elementwise" if on_for_device("auto", device) else None
    if value is False or value == "off":
        return None
    if value is True or value == "elementwise":
        return "elementwise"
    raise ConfigError(f"fuse_pointwise {value!r}: expected one of {FUSE_POINTWISE_CHOICES}")


class Pointwise:
    """The elementwise work of a decoder layer (norms, residual adds, RoPE, SwiGLU), eager or with
    `ELEMENTWISE_PIECES` compiled.

    Compiled (`backend` given), each piece becomes one or two inductor kernels, while
    the matrix products and the attention stay with the vendor libraries (cuBLAS, cuDNN), which beats both eager
    and compiling the whole step (docs/benchmarks.md). The pieces compile for the first shapes they see and,
    once the number of tokens changes, for any number of tokens (dynamo's automatic dynamic shapes), so prefills
    of any length reuse them while the model's own sizes stay constants in the kernels. With `dynamic=True` those
    sizes would be runtime values too, and every index would go through integer divisions by them (visible in
    inductor's CPU code), which makes the kernels slower.
    """

    def __init__(self, backend: str | None = None):
        self.fused = frozenset(ELEMENTWISE_PIECES if backend is not None else ())
        fns = {"norm": rms_norm, "add_norm": add_rms_norm, "rope": apply_rope, "gate": silu_gate}
        for name, f in fns.items():
            if name in self.fused:
                f = torch.compile(f, dynamic=None, fullgraph=True, backend=backend)
            setattr(self, name, f)

    @property
    def compiled(self) -> bool:
        return bool(self.fused)


EAGER = Pointwise()
