"""RMSNorm as one Triton program per row, for CUDA: the fast target's norms where it attends by splits
(`eagle3.fast.target.FastTarget.select_norm`).

torch's fused `F.rms_norm` costs far more per row than reading one row of a few kilobytes needs, and a
decoding step runs two per layer. This kernel reads a row in one
tile and reduces it with one `tl.sum` over a fixed power-of-two width, so every row is rounded the same way
whatever rows come with it (bf16 chains stay identical to plain decoding, which inductor's compiled norm does not
promise: `eagle3.fast.target.Pointwise`). Like `F.rms_norm` it normalises and scales in fp32 and rounds once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
        rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)

    return rms_norm_kernel


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] (last dimension contiguous) over its last dimension, scaled by weight [H]; x's dtype."""
    if torch.compiler.is_compiling():  # inside torch.compile: the fused norm
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.reshape(-1, h)  # a view where x's leading dimensions allow it
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = 1 << (h - 1).bit_length()
    _kernel()[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), h, eps, BLOCK=block,
                                num_warps=max(1, min(16, block // 256)))
    return out.view(x.shape)
