"""The row-wise Triton RMSNorm (`eagle3.fast.row_norm`: the fast target's norms where it attends by splits).

On a CPU through Triton's interpreter (fp32, fp16): against HF's RMSNorm maths, each row's bits whatever rows
come with it, and which norm a `FastTarget` picks (`select_norm`). On a GPU (`gpu`): the same in bf16, and the
default on CUDA.
Run: pytest tests/test_row_norm.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_target
from eagle3.config import ConfigError
from eagle3.fast import FastTarget
from eagle3.fast.pointwise import EAGER, rms_norm
from eagle3.fast.row_norm import rms_norm_rows

pytest.importorskip("triton")


def reference(x, w, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def check(x, w, eps, tol):
    out = rms_norm_rows(x, w, eps)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), reference(x, w, eps), atol=tol, rtol=tol)
    rows = x.reshape(-1, x.shape[-1])
    for i in (0, rows.shape[0] - 1):  # a row alone gets the bits it gets among the others
        assert torch.equal(rms_norm_rows(rows[i : i + 1], w, eps)[0], out.reshape(-1, x.shape[-1])[i])


@pytest.mark.parametrize("shape,dtype,tol", [((1, 576), torch.float32, 1e-5), ((7, 576), torch.float16, 2e-3),
                                             ((3, 4, 64), torch.float32, 1e-5)])  # q/k norms: [n, heads, hd]
def test_matches_rms_norm_and_keeps_row_bits(interpreted, shape, dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    check(x, w, 1e-5, tol)


def test_the_switch_is_for_cuda():
    with pytest.raises(ConfigError, match="CUDA only"):
        FastTarget(build_tiny_target("llama")).use_norm_kernel()


def test_the_norm_goes_with_the_split_attention(interpreted):
    """`select_norm`: the row kernel where the target attends by splits (auto), torch's norm with other
    attentions or `norm_kernel = "off"`, also with RoPE and SwiGLU compiled; the shared eager pieces never change."""
    t = FastTarget(build_tiny_target("llama"))
    assert t.attention == "sdpa" and t.pointwise.norm is rms_norm  # a CPU's default
    t.attention = "split"  # on a CPU only through the interpreter
    t.select_norm()
    assert t.pointwise.norm is rms_norm_rows and EAGER.norm is rms_norm
    t.norm_kernel = "off"
    t.select_norm()
    assert t.pointwise.norm is rms_norm
    t.norm_kernel = "auto"
    t.fuse_pointwise("aot_eager")
    assert t.pointwise.compiled and "norm" not in t.pointwise.fused and t.pointwise.norm is rms_norm_rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_a_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(61, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.rand(4096, device="cuda", generator=g) + 0.5).bfloat16()
    check(x, w, 1e-5, 2e-2)
    t = FastTarget(build_tiny_target("llama").cuda())
    assert t.attention == "split" and t.pointwise.norm is rms_norm_rows and EAGER.norm is rms_norm  # the default
    t.use_attention("sdpa")
    assert t.pointwise.norm is rms_norm
    t.use_norm_kernel()
    assert t.pointwise.norm is rms_norm_rows
