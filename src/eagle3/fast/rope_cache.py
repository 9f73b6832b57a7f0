"""RoPE and the KV-cache write of one decoder layer as one Triton kernel, for CUDA decoding forwards.

After its fused q/k/v projection a layer of the fast target rotates q and k and writes the new K and V into the
static cache at the forward's slots. As PyTorch work that is several kernels per layer (the rotation, then an
index write into each row's cache), each a launch per layer on the decoding path. Here one program per (token, head) reads its head's slice of
the projections, rotates it when it is a q or k head, and stores it where attention reads it: q heads first
`[nh, T, hd]` (the stacked layout `eagle3.fast.split_attention` takes), K and V straight into the layer's cache
`[2·n_kv, S, hd]` at the token's slot.

The rotation is `eagle3.fast.pointwise.apply_rope_heads` (rotate-half layout with the signed sin of `rope_tables`):
x·cos + roll(x, hd/2)·signed_sin, computed in fp32 and rounded once, as inductor's compiled piece does. Qwen3's
RMSNorm over each q and k head comes first (fp32, one rounding, as `F.rms_norm`). Each token is rotated on its
own, so a row's values do not depend on the rows beside it (bf16 chains stay identical to plain decoding).
Where the layer's input norm is folded into its q/k/v matrix (`eagle3.fast.norm_fold`, the default on CUDA),
each program first computes its token's rsqrt(mean(h²) + eps) from the residual row (`rms`) and scales its head
by it, in fp32, so the norm needs no kernel of its own.

`rope_into_rows` is the same kernel for the rows (`eagle3.fast.rows`, what every fast decoding runs): B rows of T
tokens, row b's K and V written into its own cache `[B, n_kv, S, hd]` at its own slots, q heads first per row
`[B, nh, T, hd]`; `rope_into_cache` is one row over one cache `[2·n_kv, S, hd]` (the reference its tests use).
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
        qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, res_ptr,
        t_row, stride_xt, stride_cs, stride_qb, stride_qh, stride_qt, stride_cb, stride_kh, stride_ks, stride_rt,
        n_res, eps,
        NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, HEAD_NORM: tl.constexpr, RMS: tl.constexpr,
        RB: tl.constexpr,
    ):
        n = tl.program_id(0)  # token t of row b: n = b·t_row + t
        h = tl.program_id(1)  # q heads, then k heads, then v heads
        b = n // t_row
        t = n - b * t_row
        d = tl.arange(0, HD)
        x = tl.load(qkv_ptr + n * stride_xt + h * HD + d)  # [HD]
        dtype = x.dtype
        if RMS:  # a folded norm (`eagle3.fast.norm_fold`): scale by the residual row's rsqrt(mean(h²) + eps)
            c_res = tl.arange(0, RB)
            res = tl.load(res_ptr + n * stride_rt + c_res, mask=c_res < n_res, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(res * res, 0) / n_res + eps)
            x = x.to(tl.float32) * r  # fp32 from here: one rounding at the end
        xt = x.dtype  # fp32 with RMS, else the model's: both branches below leave x so
        if h < NH + NKV:  # q or k: rotate
            p = tl.load(pos_ptr + n)
            other = (d + HD // 2) % HD  # roll(x, hd/2)
            partner = tl.load(qkv_ptr + n * stride_xt + h * HD + other)
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
            tl.store(q_ptr + b * stride_qb + h * stride_qh + t * stride_qt + d, x)
        else:
            slot = tl.load(slot_ptr + n)
            at = b * stride_cb + slot * stride_ks + d
            if h < NH + NKV:
                tl.store(k_ptr + (h - NH) * stride_kh + at, x)
            else:
                tl.store(v_ptr + (h - NH - NKV) * stride_kh + at, x)

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
    nkv = kv.shape[0] // 2
    return _launch(qkv, cos, signed_sin, pos, slots, kv[None, :nkv], kv[None, nkv:], nh, qkv.shape[0], head_norms,
                   eps, rms, valid)[0]


def rope_into_rows(
    qkv: torch.Tensor,  # [B·T, (nh + 2·nkv)·hd], row b's tokens at b·T .. b·T + T - 1
    cos: torch.Tensor,  # [S, hd], `rope_tables`
    signed_sin: torch.Tensor,  # [S, hd]
    pos: torch.Tensor,  # [B, T] long, RoPE positions
    slots: torch.Tensor,  # [B, T] long, slots of each row's own cache
    k: torch.Tensor,  # [B, nkv, S, hd]: each row's K cache, written at its slots
    v: torch.Tensor,  # [B, nkv, S, hd]
    nh: int,
    head_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
    rms: torch.Tensor | None = None,  # [B·T, H], as `rope_into_cache`
) -> torch.Tensor:
    """`rope_into_cache` for B rows, each with its own cache: returns q [B, nh, T, hd] (contiguous)."""
    b, t = pos.shape
    if slots.shape != pos.shape or k.shape != v.shape or k.shape[0] != b or k.stride() != v.stride():
        raise ValueError(f"rope_into_rows needs pos and slots [B, T] and K and V caches [B, n_kv, S, hd] of one "
                         f"layout, got pos {tuple(pos.shape)}, slots {tuple(slots.shape)}, K {tuple(k.shape)}, "
                         f"V {tuple(v.shape)}")
    return _launch(qkv, cos, signed_sin, pos.reshape(-1), slots.reshape(-1), k, v, nh, t, head_norms, eps, rms, None)


def _launch(qkv, cos, signed_sin, pos, slots, k, v, nh, t_row, head_norms, eps, rms, valid) -> torch.Tensor:
    """The kernel over N = B·t_row tokens (the first `valid`, else all); K and V [B, nkv, S, hd] share strides."""
    n = qkv.shape[0]
    b, nkv, _, hd = k.shape
    if qkv.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != signed_sin.stride():
        raise ValueError("rope_into_cache needs qkv, kv and the RoPE tables contiguous in their last dimension")
    if qkv.shape[1] != (nh + 2 * nkv) * hd:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, expected (nh + 2·nkv)·hd = {(nh + 2 * nkv) * hd}")
    if n != b * t_row or pos.shape[0] != n or slots.shape[0] != n:
        raise ValueError(f"qkv has {n} rows, expected B·T = {b}·{t_row} with a position and a slot each")
    if rms is not None and (rms.dim() != 2 or rms.shape[0] != n or rms.stride(-1) != 1):
        raise ValueError(f"rms must be the forward's residual rows [T={n}, H] with contiguous rows, got "
                         f"{tuple(rms.shape)}")
    q = torch.empty(b, nh, t_row, hd, dtype=qkv.dtype, device=qkv.device)
    qn, kn = head_norms if head_norms is not None else (qkv, qkv)  # unread without head norms
    res = qkv if rms is None else rms  # unread without rms
    n_res = res.shape[-1] if rms is not None else 1
    _kernel()[(n if valid is None else valid, nh + 2 * nkv)](
        qkv, cos, signed_sin, pos, slots, q, k, v, qn, kn, res,
        t_row, qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), res.stride(0), n_res,
        eps, NH=nh, NKV=nkv, HD=hd, HEAD_NORM=head_norms is not None, RMS=rms is not None,
        RB=1 << (n_res - 1).bit_length(), num_warps=1 if hd <= 128 else 2,
    )
    return q
