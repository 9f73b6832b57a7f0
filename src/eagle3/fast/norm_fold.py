"""RMSNorms folded into the products that read them (the fast target's decoding path on CUDA).

A pre-norm decoder layer normalises its residual h before two of its products: x = g ⊙ h·r, where r =
rsqrt(mean(h²) + eps) is one number per row and g (the norm's weight) one per column, then q/k/v = x·Wᵀ, and the
same with the second norm before gate/up. Since r scales a whole row and g a whole input column,

    x·Wᵀ = r · (h·(W ⊙ g)ᵀ)

so with g folded once into the fused q/k/v and gate/up matrices (`fold_columns`) the products read h itself and r
multiplies their outputs. The kernels that read those outputs next compute r from h on their own: the RoPE and
cache-write kernel (`eagle3.fast.rope_cache`, argument `rms`) and the SwiGLU activation here (`scaled_gate`); the
forwards that rotate in PyTorch (prefills, the server's rows) scale the q/k/v product by `scale_rows` first.
The two norm kernels before a layer's two products go away, two launches of a handful each; only the final norm
before the lm_head stays (its weight cannot go into a head tied to the embedding).

Rounding: HF rounds the normalised row to the model dtype, multiplies by g and rounds again, then multiplies.
Folded, W ⊙ g is rounded once (a weight's last bit), the product reads h as it is, and r is applied in fp32 with
one rounding at the end of the kernel that applies it. Each row's values come from that row alone (r is one
fixed-width sum over the row), so a chain's verification keeps the bits of one-token steps. Against the unfolded
forward, bf16 results differ in the last bits, as any other kernel choice does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from eagle3.fast.split_attention import triton_available


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or as it is where it is wider (fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def fold_columns(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """w [O, I] with column i scaled by g[i] (the norm weight), in fp32, rounded once to w's dtype."""
    return (_wide(w) * _wide(g)[None, :]).to(w.dtype)


def rms_scale(h: torch.Tensor, eps: float) -> torch.Tensor:
    """r = rsqrt(mean(h²) + eps) per row of h [N, H], fp32 (fp64 for fp64 h) [N, 1]."""
    return torch.rsqrt(_wide(h).pow(2).mean(-1, keepdim=True) + eps)


def scale_rows_torch(y: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """y [N, C] times h's `rms_scale` [N, 1], in fp32, rounded once to y's dtype: a folded product's output as the
    unfolded one gives it."""
    return (_wide(y) * rms_scale(h, eps)).to(y.dtype)


def scaled_gate_torch(gate_up: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """silu(r·gate)·(r·up) [N, I] of a folded gate/up product [N, 2·I], r = `rms_scale`(h); fp32, one rounding."""
    gate, up = (_wide(gate_up) * rms_scale(h, eps)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


BLOCK_I = 1024  # activations (or scaled columns) per program


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_gate_kernel(gu_ptr, h_ptr, out_ptr, stride_g, stride_h, stride_o, n_hidden, n_inter, eps,
                           HB: tl.constexpr, BI: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, HB)
        hv = tl.load(h_ptr + row * stride_h + c, mask=c < n_hidden, other=0.0).to(tl.float32)  # [HB]
        r = tl.rsqrt(tl.sum(hv * hv, 0) / n_hidden + eps)  # one fixed-width sum: the row's bits alone
        i = tl.program_id(1) * BI + tl.arange(0, BI)  # [BI] activations
        ok = i < n_inter
        gate = tl.load(gu_ptr + row * stride_g + i, mask=ok, other=0.0).to(tl.float32) * r
        up = tl.load(gu_ptr + row * stride_g + n_inter + i, mask=ok, other=0.0).to(tl.float32) * r
        tl.store(out_ptr + row * stride_o + i, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def scale_rows_kernel(y_ptr, h_ptr, out_ptr, stride_y, stride_h, stride_o, n_hidden, n_cols, eps,
                          HB: tl.constexpr, BC: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, HB)
        hv = tl.load(h_ptr + row * stride_h + c, mask=c < n_hidden, other=0.0).to(tl.float32)  # [HB]
        r = tl.rsqrt(tl.sum(hv * hv, 0) / n_hidden + eps)
        j = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = j < n_cols
        y = tl.load(y_ptr + row * stride_y + j, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + j, (y * r).to(out_ptr.dtype.element_ty), mask=ok)

    return scaled_gate_kernel, scale_rows_kernel


def _check_rows(y: torch.Tensor, h: torch.Tensor, what: str) -> None:
    if y.dim() != 2 or h.dim() != 2 or y.stride(-1) != 1 or h.stride(-1) != 1 or h.shape[0] != y.shape[0]:
        raise ValueError(f"{what} needs [N, C] outputs and the residual rows h [N, H], both with contiguous rows")


def scaled_gate_triton(gate_up: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """`scaled_gate_torch` as one Triton kernel: one program per (row, block of BLOCK_I activations), each
    computing its row's r from h (a few kilobytes, from L2) before its block."""
    _check_rows(gate_up, h, "scaled_gate")
    n, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"scaled_gate needs gate_up [N, 2·I], got {two_i} columns")
    hidden, inter = h.shape[-1], two_i // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(BLOCK_I, 1 << (inter - 1).bit_length())
    gate_kernel, _ = _kernels()
    gate_kernel[(n, -(-inter // block))](gate_up, h, out, gate_up.stride(0), h.stride(0), out.stride(0), hidden,
                                         inter, eps, HB=1 << (hidden - 1).bit_length(), BI=block, num_warps=4)
    return out


def scale_rows_triton(y: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """`scale_rows_torch` as one Triton kernel (one program per row and block of columns), for the PyTorch
    decoding paths on CUDA: one launch where the unfolded path had its norm's."""
    _check_rows(y, h, "scale_rows")
    n, cols = y.shape
    hidden = h.shape[-1]
    out = torch.empty_like(y)
    block = min(BLOCK_I, 1 << (cols - 1).bit_length())
    _, scale_kernel = _kernels()
    scale_kernel[(n, -(-cols // block))](y, h, out, y.stride(0), h.stride(0), out.stride(0), hidden, cols, eps,
                                         HB=1 << (hidden - 1).bit_length(), BC=block, num_warps=4)
    return out


def _kernel_path(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available() and not torch.compiler.is_compiling()


def scale_rows(y: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """A folded product's output y [N, C] scaled by its rows' r from the residual h [N, H] (the paths other than
    the RoPE kernel's, which applies r itself): the Triton kernel on CUDA, else (and inside traced code) PyTorch."""
    if _kernel_path(y):
        return scale_rows_triton(y, h, eps)
    return scale_rows_torch(y, h, eps)


def scaled_gate(gate_up: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """SwiGLU's activation after a folded gate/up product: the Triton kernel on CUDA, else (and inside traced
    code: `--compile` traces whole steps) the same in PyTorch."""
    if _kernel_path(gate_up):
        return scaled_gate_triton(gate_up, h, eps)
    return scaled_gate_torch(gate_up, h, eps)
