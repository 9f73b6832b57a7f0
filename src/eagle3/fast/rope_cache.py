"""RoPE and the KV-cache write of one decoder layer as one Triton kernel, for CUDA decoding forwards.

After its fused q/k/v projection a layer of the fast target rotates q and k and writes the new K and V into the
static cache at the forward's slots. As PyTorch work that is two kernels per layer, a compiled copy-and-rotate
(`eagle3.fast.target.heads_first_rope`) and an index copy into the cache, each a launch per layer on the
decoding path. Here one program per (token, head) reads its head's slice of
the projections, rotates it when it is a q or k head, and stores it where attention reads it: q heads first
`[nh, T, hd]` (the stacked layout `eagle3.fast.split_attention` takes), K and V straight into the layer's cache
`[2·n_kv, S, hd]` at the token's slot.

The rotation is `eagle3.fast.target.apply_rope_heads` (rotate-half layout with the signed sin of `rope_tables`):
x·cos + roll(x, hd/2)·signed_sin, computed in fp32 and rounded once, as inductor's compiled piece does. Qwen3's
RMSNorm over each q and k head comes first (fp32, one rounding, as `F.rms_norm`). Each token is rotated on its
own, so a row's values do not depend on the rows beside it (bf16 chains stay identical to plain decoding).
Where the layer's input norm is folded into its q/k/v matrix (`eagle3.fast.norm_fold`, the default on CUDA),
each program first computes its token's rsqrt(mean(h²) + eps) from the residual row (`rms`) and scales its head
by it, in fp32, so the norm needs no kernel of its own.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_cache_kernel(
        qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kv_ptr, qn_ptr, kn_ptr, res_ptr,
        stride_xt, stride_cs, stride_qh, stride_qt, stride_kh, stride_ks, stride_rt, n_res, eps,
        NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, HEAD_NORM: tl.constexpr, RMS: tl.constexpr,
        RB: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)  # q heads, then k heads, then v heads
        d = tl.arange(0, HD)
        x = tl.load(qkv_ptr + t * stride_xt + h * HD + d)  # [HD]
        dtype = x.dtype
        if RMS:  # a folded norm (`eagle3.fast.norm_fold`): scale by the residual row's rsqrt(mean(h²) + eps)
            c_res = tl.arange(0, RB)
            res = tl.load(res_ptr + t * stride_rt + c_res, mask=c_res < n_res, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(res * res, 0) / n_res + eps)
            x = x.to(tl.float32) * r  # fp32 from here: one rounding at the end
        xt = x.dtype  # fp32 with RMS, else the model's: both branches below leave x so
        if h < NH + NKV:  # q or k: rotate
            p = tl.load(pos_ptr + t)
            other = (d + HD // 2) % HD  # roll(x, hd/2)
            partner = tl.load(qkv_ptr + t * stride_xt + h * HD + other)
            if RMS:
                partner = partner.to(tl.float32) * r
            if HEAD_NORM:  # Qwen3: RMSNorm over the head first, rounded to x's dtype as `F.rms_norm` leaves it
                x32 = x.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / HD + eps)
                w_ptr = qn_ptr if h < NH else kn_ptr
                partner = (partner.to(tl.float32) * rstd * tl.load(w_ptr + other).to(tl.float32)).to(dtype)
                x = (x32 * rstd * tl.load(w_ptr + d).to(tl.float32)).to(dtype).to(xt)
            c = tl.load(cos_ptr + p * stride_cs + d).to(tl.float32)
            s = tl.load(sin_ptr + p * stride_cs + d).to(tl.float32)
            x = (x.to(tl.float32) * c + partner.to(tl.float32) * s).to(xt)
        x = x.to(dtype)  # one rounding
        if h < NH:
            tl.store(q_ptr + h * stride_qh + t * stride_qt + d, x)
        else:
            slot = tl.load(slot_ptr + t)
            tl.store(kv_ptr + (h - NH) * stride_kh + slot * stride_ks + d, x)

    return rope_cache_kernel


def rope_into_cache(
    qkv: torch.Tensor,  # [T, (nh + 2·nkv)·hd], the fused projections (rows contiguous)
    cos: torch.Tensor,  # [S, hd], `rope_tables`
    signed_sin: torch.Tensor,  # [S, hd]
    pos: torch.Tensor,  # [T] long, RoPE positions
    slots: torch.Tensor,  # [T] long, cache slots
    kv: torch.Tensor,  # [2·nkv, S, hd]: the layer's K heads then V heads, written at `slots`
    nh: int,
    head_norms: tuple[torch.Tensor, torch.Tensor] | None = None,  # Qwen3's q_norm, k_norm [hd]
    eps: float = 1e-6,
    rms: torch.Tensor | None = None,  # [T, H]: the layer's residual rows, when its input norm is folded
    valid: int | None = None,  # the first `valid` tokens only (the rest are padding: q left unset, nothing written)
) -> torch.Tensor:
    """Rotate q and k (after RMSNorm over each head with `head_norms`), write K and V into `kv` at `slots`;
    returns q [nh, T, hd] (contiguous, heads first). With `rms` (the products were folded,
    `eagle3.fast.norm_fold`), every head is first multiplied by its token's rsqrt(mean(rms²) + eps), in fp32."""
    t = qkv.shape[0]
    two_nkv, _, hd = kv.shape
    if qkv.stride(-1) != 1 or kv.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != signed_sin.stride():
        raise ValueError("rope_into_cache needs qkv, kv and the RoPE tables contiguous in their last dimension")
    if qkv.shape[1] != (nh + two_nkv) * hd:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, expected (nh + 2·nkv)·hd = {(nh + two_nkv) * hd}")
    if rms is not None and (rms.dim() != 2 or rms.shape[0] != t or rms.stride(-1) != 1):
        raise ValueError(f"rms must be the forward's residual rows [T={t}, H] with contiguous rows, got "
                         f"{tuple(rms.shape)}")
    q = torch.empty(nh, t, hd, dtype=qkv.dtype, device=qkv.device)
    qn, kn = head_norms if head_norms is not None else (qkv, qkv)  # unread without head norms
    res = qkv if rms is None else rms  # unread without rms
    n_res = res.shape[-1] if rms is not None else 1
    _kernel()[(t if valid is None else valid, nh + two_nkv)](
        qkv, cos, signed_sin, pos, slots, q, kv, qn, kn, res,
        qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), res.stride(0), n_res,
        eps, NH=nh, NKV=two_nkv // 2, HD=hd, HEAD_NORM=head_norms is not None, RMS=rms is not None,
        RB=1 << (n_res - 1).bit_length(), num_warps=1 if hd <= 128 else 2,
    )
    return q
