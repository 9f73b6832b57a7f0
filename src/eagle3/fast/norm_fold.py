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


BLOCK_I = 1024  # output columns per program


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_rows_kernel(y_ptr, h_ptr, out_ptr, stride_y, stride_h, stride_o, n_hidden, n_out, eps,
                           HB: tl.constexpr, BI: tl.constexpr, GATE: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, HB)
        hv = tl.load(h_ptr + row * stride_h + c, mask=c < n_hidden, other=0.0).to(tl.float32)  # [HB]
        r = tl.rsqrt(tl.sum(hv * hv, 0) / n_hidden + eps)  # one fixed-width sum: the row's bits alone
        i = tl.program_id(1) * BI + tl.arange(0, BI)  # [BI] output columns
        ok = i < n_out
        y = tl.load(y_ptr + row * stride_y + i, mask=ok, other=0.0).to(tl.float32) * r  # the gate, with GATE
        if GATE:  # SwiGLU: silu(r·gate)·(r·up), up n_out columns further on
            up = tl.load(y_ptr + row * stride_y + n_out + i, mask=ok, other=0.0).to(tl.float32) * r
            y = y * tl.sigmoid(y) * up
        tl.store(out_ptr + row * stride_o + i, y.to(out_ptr.dtype.element_ty), mask=ok)

    return scaled_rows_kernel


def _scaled_rows(y: torch.Tensor, h: torch.Tensor, eps: float, gate: bool) -> torch.Tensor:
    """The kernel's launch: one program per (row, block of BLOCK_I output columns), each computing its row's r
    from h (a few kilobytes, from L2) first."""
    what = "scaled_gate" if gate else "scale_rows"
    if y.dim() != 2 or h.dim() != 2 or y.stride(-1) != 1 or h.stride(-1) != 1 or h.shape[0] != y.shape[0]:
        raise ValueError(f"{what} needs [N, C] outputs and the residual rows h [N, H], both with contiguous rows")
    n, cols = y.shape
    if gate and cols % 2:
        raise ValueError(f"scaled_gate needs gate_up [N, 2·I], got {cols} columns")
    hidden, n_out = h.shape[-1], cols // 2 if gate else cols
    out = torch.empty(n, n_out, dtype=y.dtype, device=y.device)
    block = min(BLOCK_I, 1 << (n_out - 1).bit_length())
    _kernel()[(n, -(-n_out // block))](y, h, out, y.stride(0), h.stride(0), out.stride(0), hidden, n_out, eps,
                                       HB=1 << (hidden - 1).bit_length(), BI=block, GATE=gate, num_warps=4)
    return out


def scaled_gate_triton(gate_up: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """`scaled_gate_torch` as one Triton kernel."""
    return _scaled_rows(gate_up, h, eps, gate=True)


def scale_rows_triton(y: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    """`scale_rows_torch` as one Triton kernel, for the PyTorch decoding paths on CUDA: one launch where the
    unfolded path had its norm's."""
    return _scaled_rows(y, h, eps, gate=False)


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
    code) the same in PyTorch."""
    if _kernel_path(gate_up):
        return scaled_gate_triton(gate_up, h, eps)
    return scaled_gate_torch(gate_up, h, eps)
