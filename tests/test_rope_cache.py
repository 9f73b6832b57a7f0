"""RoPE and the KV-cache write in one Triton kernel (`eagle3.fast.rope_cache`).

On a CPU the kernel runs in Triton's interpreter (fp32 and fp16); on a GPU (marked `gpu`) compiled, in bf16.
Against the PyTorch path it replaces (`FastTarget.rope_qk`'s rotation, then the index copy into the
cache): q, the cached K and V, slots not written left as they were, Qwen3's head norms, and rows that keep their
values whatever rows come with them. The fast path's greedy decoding through it is checked against HF `generate`
in `tests/test_split_attention.py` (forwards that attend by splits use it).
Run: pytest tests/test_rope_cache.py
"""

from __future__ import annotations

import pytest
import torch

from eagle3.fast.pointwise import apply_rope_heads, rms_norm, rope_tables
from eagle3.fast.rope_cache import rope_into_cache, rope_into_rows

pytest.importorskip("triton")


def case(t, nh, nkv, hd, s, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen).to(dtype)
    angles = (torch.rand(s, hd // 2, generator=gen) * 6).repeat(1, 2)
    cos, sin = rope_tables(angles.cos().to(dtype), angles.sin().to(dtype))
    pos = torch.randint(0, s, (t,), generator=gen)
    slots = torch.randperm(s, generator=gen)[:t]
    norms = (torch.randn(hd, generator=gen).to(dtype), torch.randn(hd, generator=gen).to(dtype))
    return [x.to(device) for x in (qkv, cos, sin, pos, slots)], [w.to(device) for w in norms]


def reference(qkv, cos, sin, pos, nh, nkv, hd, norms, eps):
    """q [nh, T, hd] and the new K/V heads [2·nkv, T, hd] in fp64, as the PyTorch path computes them (norms in
    the input dtype first, as `F.rms_norm` rounds them)."""
    t = qkv.shape[0]
    x = qkv.view(t, nh + 2 * nkv, hd).transpose(0, 1)  # [heads, T, hd]
    if norms is not None:
        x = torch.cat([rms_norm(x[:nh], norms[0], eps), rms_norm(x[nh : nh + nkv], norms[1], eps), x[nh + nkv :]])
    x = x.double()
    c, s_ = cos[pos].double(), sin[pos].double()
    rot = apply_rope_heads(x[: nh + nkv], c, s_)
    return rot[:nh], torch.cat([rot[nh:], x[nh + nkv :]])


@pytest.mark.parametrize("t,nh,nkv,hd,head_norm", [(1, 9, 3, 64, False), (7, 4, 2, 16, False), (61, 6, 2, 32, True),
                                                   (3, 8, 8, 128, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_into_cache_matches_the_torch_path(interpreted, t, nh, nkv, hd, head_norm, dtype):
    s, eps = 80, 1e-6
    (qkv, cos, sin, pos, slots), norms = case(t, nh, nkv, hd, s, dtype)
    norms = norms if head_norm else None
    kv = torch.randn(2 * nkv, s, hd).to(dtype)
    before = kv.clone()
    q = rope_into_cache(qkv, cos, sin, pos, slots, kv, nh, norms, eps)
    want_q, want_kv = reference(qkv, cos, sin, pos, nh, nkv, hd, norms, eps)
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    assert q.shape == (nh, t, hd) and q.dtype == dtype and q.is_contiguous()
    torch.testing.assert_close(q.double(), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(kv[:, slots].double(), want_kv, atol=tol, rtol=tol)
    untouched = torch.ones(s, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(kv[:, untouched], before[:, untouched])


@pytest.mark.parametrize("head_norm", [False, True])
def test_rows_keep_their_bits_alone(interpreted, head_norm):
    """Each token's q, K and V from a 5-token call equal those of a call with that token alone."""
    nh, nkv, hd, s = 6, 2, 32, 40
    (qkv, cos, sin, pos, slots), norms = case(5, nh, nkv, hd, s, torch.float16, seed=3)
    norms = norms if head_norm else None
    kv = torch.zeros(2 * nkv, s, hd, dtype=torch.float16)
    q = rope_into_cache(qkv, cos, sin, pos, slots, kv, nh, norms)
    for i in range(5):
        one = torch.zeros_like(kv)
        qi = rope_into_cache(qkv[i : i + 1], cos, sin, pos[i : i + 1], slots[i : i + 1], one, nh, norms)
        assert torch.equal(qi[:, 0], q[:, i]) and torch.equal(one[:, slots[i]], kv[:, slots[i]]), i


def rows_against_one_row(head_norm, folded, dtype, device="cpu"):
    """`rope_into_rows` (the server's rows): row b's q, K and V are those of `rope_into_cache` over row b alone,
    written into row b's cache only (K and V as separate caches [B, n_kv, S, hd])."""
    b, t, nh, nkv, hd, s = 3, 4, 6, 2, 32, 40
    (qkv, cos, sin, _, _), norms = case(b * t, nh, nkv, hd, s, dtype, seed=5, device=device)
    norms = norms if head_norm else None
    gen = torch.Generator().manual_seed(6)
    pos = torch.randint(0, s, (b, t), generator=gen).to(device)
    slots = torch.stack([torch.randperm(s, generator=gen)[:t] for _ in range(b)]).to(device)  # [B, T]
    rms = torch.randn(b * t, 48, generator=gen).to(device, dtype) if folded else None
    k = torch.randn(b, nkv, s, hd, generator=gen).to(device, dtype)
    v = torch.randn(b, nkv, s, hd, generator=gen).to(device, dtype)
    k0, v0 = k.clone(), v.clone()
    q = rope_into_rows(qkv, cos, sin, pos, slots, k, v, nh, norms, rms=rms)
    assert q.shape == (b, nh, t, hd) and q.is_contiguous()
    for r in range(b):
        kv = torch.cat([k0[r], v0[r]])  # [2·nkv, S, hd]: this row alone, before the call
        rows = slice(r * t, (r + 1) * t)
        qr = rope_into_cache(qkv[rows], cos, sin, pos[r], slots[r], kv, nh, norms,
                             rms=None if rms is None else rms[rows])
        assert torch.equal(q[r], qr), r
        assert torch.equal(k[r], kv[:nkv]) and torch.equal(v[r], kv[nkv:]), r


@pytest.mark.parametrize("head_norm,folded", [(False, False), (True, False), (False, True)])
def test_rows_write_their_own_caches_with_the_bits_of_one_row(interpreted, head_norm, folded):
    rows_against_one_row(head_norm, folded, torch.float16)


def test_bad_shapes_are_refused(interpreted):
    (qkv, cos, sin, pos, slots), _ = case(2, 4, 2, 16, 20, torch.float32)
    kv = torch.zeros(4, 20, 16)
    with pytest.raises(ValueError, match="expected"):
        rope_into_cache(qkv[:, :-16], cos, sin, pos, slots, kv, 4)
    with pytest.raises(ValueError, match="contiguous"):
        rope_into_cache(qkv, cos.t().contiguous().t(), sin, pos, slots, kv, 4)
    k = torch.zeros(2, 2, 20, 16)
    with pytest.raises(ValueError, match="rows"):
        rope_into_rows(qkv, cos, sin, pos[None], slots[None], k, k.clone(), 4)  # 2 rows of caches, 1 of tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_norm", [False, True])
def test_compiled_kernel_in_bf16(head_norm):
    nh, nkv, hd, s, t = 32, 8, 128, 900, 61
    (qkv, cos, sin, pos, slots), norms = case(t, nh, nkv, hd, s, torch.bfloat16, device="cuda")
    norms = norms if head_norm else None
    kv = torch.zeros(2 * nkv, s, hd, dtype=torch.bfloat16, device="cuda")
    q = rope_into_cache(qkv, cos, sin, pos, slots, kv, nh, norms)
    want_q, want_kv = reference(qkv.cpu(), cos.cpu(), sin.cpu(), pos.cpu(), nh, nkv, hd,
                                None if norms is None else [w.cpu() for w in norms], 1e-6)
    torch.testing.assert_close(q.cpu().double(), want_q, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(kv[:, slots].cpu().double(), want_kv, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_norm,folded", [(False, False), (True, True)])
def test_compiled_rows_kernel_in_bf16(head_norm, folded):
    rows_against_one_row(head_norm, folded, torch.bfloat16, "cuda")
