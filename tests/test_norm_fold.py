"""RMSNorms folded into the products after them (`eagle3.fast.norm_fold`, `FastTarget.select_norm`).

The algebra (W ⊙ g applied to h, scaled by r afterwards, equals W applied to the normed h), the SwiGLU kernel
that applies r (on a CPU in Triton's interpreter, on a GPU compiled in bf16) and the RoPE kernel's `rms`
argument against PyTorch, rows that keep their bits whatever rows come with them, and the target: folded
forwards close to unfolded ones on every fast-path family, the weights rebuilt exactly when unfolded, and the
configurations that cannot fold refused. Greedy decoding through the folded kernel path against HF `generate`
is `tests/test_split_attention.py::test_fast_path_with_split_attention_matches_hf_generate`.
Run: pytest tests/test_norm_fold.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_target
from eagle3.config import ConfigError
from eagle3.fast.norm_fold import (
    fold_columns,
    rms_scale,
    scale_rows,
    scale_rows_torch,
    scale_rows_triton,
    scaled_gate,
    scaled_gate_torch,
    scaled_gate_triton,
)
from eagle3.fast.pointwise import apply_rope_heads, rms_norm, rope_tables, silu_gate
from eagle3.fast.rope_cache import rope_into_cache
from eagle3.fast.target import FastTarget

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_folded_product_equals_the_product_of_the_normed_rows():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 48, generator=gen, dtype=torch.float64) * 3
    w = torch.randn(20, 48, generator=gen, dtype=torch.float64)
    g = torch.rand(48, generator=gen, dtype=torch.float64) + 0.5
    eps = 1e-6
    unfolded = rms_norm(h, g, eps) @ w.T
    folded = (h @ fold_columns(w, g).T) * rms_scale(h, eps).double()
    torch.testing.assert_close(folded, unfolded, atol=1e-6, rtol=1e-6)  # r is fp32
    torch.testing.assert_close(scale_rows(h @ fold_columns(w, g).T, h, eps), unfolded, atol=1e-6, rtol=1e-6)
    gu = h @ fold_columns(torch.randn(40, 48, generator=gen, dtype=torch.float64), g).T
    torch.testing.assert_close(scaled_gate_torch(gu, h, eps), silu_gate(gu * rms_scale(h, eps).double()))


@pytest.mark.parametrize("n,hidden,inter", [(1, 576, 1536), (7, 100, 3000), (61, 64, 48)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_gate_kernel_matches_torch_and_keeps_row_bits(interpreted, n, hidden, inter, dtype, tol):
    gen = torch.Generator().manual_seed(n)
    gu = torch.randn(n, 2 * inter, generator=gen).to(dtype)
    h = (torch.randn(n, hidden, generator=gen) * 4).to(dtype)
    out = scaled_gate_triton(gu, h, 1e-5)
    assert out.shape == (n, inter) and out.dtype == dtype
    torch.testing.assert_close(out.double(), scaled_gate_torch(gu.double(), h.double(), 1e-5), atol=tol, rtol=tol)
    for i in (0, n - 1):
        assert torch.equal(scaled_gate_triton(gu[i : i + 1], h[i : i + 1], 1e-5), out[i : i + 1]), i
    assert torch.equal(scaled_gate(gu, h, 1e-5), scaled_gate_torch(gu, h, 1e-5))  # no CUDA: PyTorch
    with pytest.raises(ValueError, match="contiguous rows"):
        scaled_gate_triton(gu, h[:, ::2], 1e-5)


@pytest.mark.parametrize("n,hidden,cols", [(1, 576, 960), (9, 100, 2500)])
def test_scale_kernel_matches_torch_and_keeps_row_bits(interpreted, n, hidden, cols):
    gen = torch.Generator().manual_seed(n)
    y = torch.randn(n, cols, generator=gen)
    h = torch.randn(n, hidden, generator=gen) * 3
    out = scale_rows_triton(y, h, 1e-6)
    torch.testing.assert_close(out.double(), scale_rows_torch(y.double(), h.double(), 1e-6), atol=1e-6, rtol=1e-6)
    assert torch.equal(scale_rows_triton(y[-1:], h[-1:], 1e-6), out[-1:])
    assert torch.equal(scale_rows(y, h, 1e-6), scale_rows_torch(y, h, 1e-6))  # no CUDA: PyTorch
    with pytest.raises(ValueError, match="contiguous rows"):
        scale_rows_triton(y, h[:, ::2], 1e-6)


@pytest.mark.parametrize("head_norm", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float16, 2e-3)])
def test_rope_kernel_applies_the_folded_scale(interpreted, head_norm, dtype, tol):
    """`rope_into_cache(rms=h)`: q, K and V as if the projections had been scaled by h's rsqrt(mean(h²) + eps)
    before RoPE (and Qwen3's head norms); each token's rows alone give the same bits."""
    t, nh, nkv, hd, s, hidden, eps = 5, 4, 2, 32, 40, 72, 1e-6
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen).to(dtype)
    h = (torch.randn(t, hidden, generator=gen) * 5).to(dtype)
    angles = (torch.rand(s, hd // 2, generator=gen) * 6).repeat(1, 2)
    cos, sin = rope_tables(angles.cos().to(dtype), angles.sin().to(dtype))
    pos, slots = torch.randint(0, s, (t,), generator=gen), torch.randperm(s, generator=gen)[:t]
    norms = tuple(torch.randn(hd, generator=gen).to(dtype) for _ in range(2)) if head_norm else None
    kv = torch.zeros(2 * nkv, s, hd, dtype=dtype)
    q = rope_into_cache(qkv, cos, sin, pos, slots, kv, nh, norms, eps, rms=h)
    x = (qkv.double() * rms_scale(h.double(), eps).double()).view(t, nh + 2 * nkv, hd).transpose(0, 1)
    if head_norm:
        x = torch.cat([rms_norm(x[:nh], norms[0].double(), eps), rms_norm(x[nh : nh + nkv], norms[1].double(), eps),
                       x[nh + nkv :]])
    rot = apply_rope_heads(x[: nh + nkv], cos[pos].double(), sin[pos].double())
    torch.testing.assert_close(q.double(), rot[:nh], atol=tol, rtol=tol)
    torch.testing.assert_close(kv[:, slots].double(), torch.cat([rot[nh:], x[nh + nkv :]]), atol=tol, rtol=tol)
    one = rope_into_cache(qkv[2:3], cos, sin, pos[2:3], slots[2:3], kv.clone(), nh, norms, eps, rms=h[2:3])
    assert torch.equal(one, q[:, 2:3])
    with pytest.raises(ValueError, match="residual rows"):
        rope_into_cache(qkv, cos, sin, pos, slots, kv, nh, norms, eps, rms=h[:2])


def forwards(target: FastTarget, seed: int = 0):
    """Logits and aux of a 9-token prefill and a 3-token continuation in one row, and of all 12 tokens in another."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (12,), generator=gen)
    pos = torch.arange(12)
    mask = pos[None, :] <= pos[:, None]
    mask = torch.cat([mask, torch.zeros(12, 52, dtype=torch.bool)], dim=1)  # [12, 64]
    rope = target.rope_table(64)

    def cache() -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.zeros(target.num_layers, 1, target.nkv, 64, target.hd, dtype=target.dtype)
        return k, torch.zeros_like(k)

    k, v = cache()

    def run(a: int, b: int, k: torch.Tensor, v: torch.Tensor):
        return target.forward_rows(ids[None, a:b], pos[None, a:b], pos[None, a:b], mask[None, a:b], k, v, rope,
                                   want_aux=True)

    return run(0, 9, k, v), run(9, 12, k, v), run(0, 12, *cache())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_folded_target_matches_the_unfolded_one(arch):
    """fp32 on the CPU (the PyTorch paths scale the products' rows): the same logits and aux features within
    fp32 rounding over six layers (about 1e-5 of their size; a scale left out or applied twice is of order one),
    and unfolding rebuilds the fused matrices bit for bit."""
    model = build_tiny_target(arch)
    gen = torch.Generator().manual_seed(1)
    for name, w in model.named_parameters():  # norm weights start at one, where folding changes nothing
        if "norm" in name:
            w.copy_(torch.rand(w.shape, generator=gen) + 0.5)
    target = FastTarget(model, aux_layer_ids=[0, 1])
    assert not target.folded and target.foldable  # on a CPU the default stays unfolded
    fresh = [lw.wqkv.clone() for lw in target.layers], [lw.w13.clone() for lw in target.layers]
    want = forwards(target)
    target.norm_kernel = "fold"
    target.select_norm()
    assert target.folded
    assert not torch.equal(target.layers[0].wqkv, fresh[0][0])
    got = forwards(target)
    for (lw, aw), (lg, ag) in zip(want, got, strict=True):  # logits up to ~9, aux features up to ~60
        torch.testing.assert_close(lg, lw, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ag, aw, atol=1e-3, rtol=1e-4)
    target.norm_kernel = "off"
    target.select_norm()
    assert not target.folded
    assert all(torch.equal(lw.wqkv, w) for lw, w in zip(target.layers, fresh[0], strict=True))
    assert all(torch.equal(lw.w13, w) for lw, w in zip(target.layers, fresh[1], strict=True))


def test_what_cannot_fold_is_refused():
    biased = FastTarget(build_tiny_target("qwen2"))  # q/k/v biases: r cannot go after the product
    assert not biased.foldable
    biased.attention = "split"
    biased.select_norm()  # auto: not folded, the row norms instead
    assert not biased.folded
    biased.norm_kernel = "fold"
    with pytest.raises(ConfigError, match="biases"):
        biased.select_norm()
    target = FastTarget(build_tiny_target("llama"))
    target.norm_kernel = "typo"
    with pytest.raises(ConfigError, match="expected auto, fold, on or off"):
        target.select_norm()


@pytest.mark.gpu
@cuda
def test_gate_and_scale_kernels_in_bf16_on_a_gpu():
    gen = torch.Generator().manual_seed(0)
    gu = torch.randn(61, 2 * 14336, generator=gen).to(torch.bfloat16).cuda()
    h = (torch.randn(61, 4096, generator=gen) * 4).to(torch.bfloat16).cuda()
    out = scaled_gate(gu, h, 1e-5)
    want = scaled_gate_torch(gu.cpu().double(), h.cpu().double(), 1e-5).float()
    torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(scaled_gate(gu[5:6], h[5:6], 1e-5), out[5:6])
    y = gu[:, :6144].contiguous()
    scaled = scale_rows(y, h, 1e-5)
    want = scale_rows_torch(y.cpu().double(), h.cpu().double(), 1e-5).float()
    torch.testing.assert_close(scaled.float().cpu(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(scale_rows(y[5:6], h[5:6], 1e-5), scaled[5:6])


@pytest.mark.gpu
@cuda
def test_folded_target_on_a_gpu_matches_the_unfolded_one():
    """The CUDA default (norms folded where the target attends by splits) against the row-kernel norms, fp32: a
    200-token prefill (PyTorch attention, `scale_rows`) and a 3-token step after it (the split, RoPE and gate
    kernels), logits and aux features within rounding."""
    model = build_tiny_target("llama").cuda()
    gen = torch.Generator().manual_seed(1)
    for name, w in model.named_parameters():
        if "norm" in name:
            w.copy_(torch.rand(w.shape, generator=gen).cuda() + 0.5)
    target = FastTarget(model, aux_layer_ids=[0, 1])
    assert target.attention == "split" and target.folded

    def run():
        k = torch.zeros(target.num_layers, 1, target.nkv, 256, target.hd, device="cuda")
        v, rope = torch.zeros_like(k), target.rope_table(256)
        ids = torch.randint(3, 300, (1, 203), generator=torch.Generator().manual_seed(2)).cuda()
        pos = torch.arange(203, device="cuda")[None]
        mask = torch.arange(256, device="cuda")[None, None, :] <= pos[:, :, None]  # [1, 203, 256]
        tail = torch.tensor([[[200, 200, 200], [200, 201, 200], [200, 201, 202]]], device="cuda")  # a chain's paths
        step = (pos[0, :1] + 200, tail)  # by position: the committed 200 slots, then each token's path [1, 3, 3]
        return target.forward_rows(ids[:, :200], pos[:, :200], pos[:, :200], mask[:, :200], k, v, rope,
                                   want_aux=True), \
            target.forward_rows(ids[:, 200:], pos[:, 200:], pos[:, 200:], None, k, v, rope, want_aux=True,
                                path=step)

    folded = run()
    target.norm_kernel = "on"
    target.select_norm()
    assert not target.folded
    for (lf, af), (lu, au) in zip(folded, run(), strict=True):
        torch.testing.assert_close(lf, lu, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(af, au, atol=1e-3, rtol=1e-4)
