"""Split-KV attention over the static cache for decode-sized forwards on CUDA (Triton).

A plain step, a chain's verification and a tree's verification attend a few query rows to the whole static cache,
either under a `[T, S]` visibility mask (prefills, the drafter) or by position (`Paths`: the target's decoding
forwards, so that a tree node's sums do not depend on the slots its path sits at). cuDNN's SDPA kernel runs such a call as one program per KV head that walks all
S slots in turn, which leaves most of the GPU idle for a few hundred kilobytes of K/V. Splitting the slots over
programs (flash-decoding, as Dao, Haziza, Massa and Sizov's "Flash-Decoding for long-context inference", 2023,
describes it) keeps the GPU busy instead (docs/benchmarks.md).

Two kernels:
- `split_kernel`, one program per (KV head, block of 16 stacked query rows, split of the slots): an online
  softmax over its split's key blocks up to the forward's last slot (`last`; blocks past it no row sees); it
  writes its rows' partial (max, sum, weighted V), or, when one split covers the cache, the normalised output
  itself. By position (`Paths`), the programs are the stacked tiles of every split that holds only the committed
  prefix, then one token's heads over each split from the one holding the prefix's end to the last a path
  reaches (so a tree's grid grows by its tokens for one or two splits, not for all of them). Each block's K and
  V loads go out beside its mask's rather than waiting for a check that some row sees the block, which would put
  three dependent loads in a row.
- `combine_kernel`, one program per (KV head, stacked row): merges the splits in order and writes the row into
  the `[T, nh·hd]` output, the layout the output projection reads (no transposing copy after attention).
Products take fp32 operands at full precision (`input_precision="ieee"`, not TF32), bf16 and fp16 as they are.

Every quantity a row's output depends on is computed the same way whatever other rows come with it: the splits
and key blocks are fixed slot ranges (a function of S only, not of how many slots are in use), a block another
row needs but this row does not see adds exactly zero to this row (its weights are exp(-inf) = 0, its running
max is unchanged), and a row's products do not depend on the other rows of its 16-row tile. So the rows of a
chain's verification keep the bits of one-token steps, and with `Paths` so do a tree's, whose keys are walked by
position (a split holding only the committed prefix takes stacked tiles, any other one token's heads per tile),
as `tests/test_split_attention.py` checks (on a GPU, and on a CPU in Triton's interpreter).

Query rows are stacked as in `eagle3.fast.attention.row_attention`: q `[n_kv, g·T, hd]`, row r·T + t is query
head kv·g + r of token t.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

BLOCK_M = 16  # stacked query rows per program: the smallest tile `tl.dot` takes
BLOCK_N = 64  # slots per key block
MAX_SPLITS = 64  # the combine kernel holds one row's partials of every split at once
MAX_ROWS = 128  # tokens per forward this kernel serves (a 100-token tree's verification and less)
# Key blocks per split at least: shorter splits are more programs, each with a shorter chain of dependent loads,
# which was fastest at both the SmolLM2 and the Llama-3.1-8B shape.
MIN_SPLIT_BLOCKS = 1


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA wheels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def split_size(seq_len: int) -> int:
    """Slots per split for a cache of `seq_len` slots: a multiple of BLOCK_N, at least MIN_SPLIT_BLOCKS blocks, and
    large enough that there are at most MAX_SPLITS splits. It depends on the cache size only, so every forward
    over one cache splits its slots the same way."""
    blocks = -(-seq_len // BLOCK_N)
    per_split = max(MIN_SPLIT_BLOCKS, -(-blocks // MAX_SPLITS))
    return per_split * BLOCK_N


HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two from the smallest `tl.dot` takes


def supports(head_dim: int, tokens: int) -> bool:
    """Whether `split_attention` serves a forward of `tokens` tokens with this head size."""
    return head_dim in HEAD_DIMS and tokens <= MAX_ROWS


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, last_ptr, part_o_ptr, part_ml_ptr, out_ptr, tail_ptr, pos_ptr, length_ptr,
        stride_qh, stride_qr, stride_kh, stride_ks, stride_vh, stride_vs, stride_mt, stride_ot, stride_tt,
        stride_qb, stride_kb, stride_vb, stride_ob, stride_tb, stride_pb, n_kv,
        rows_total, tokens, seq_len, groups, n_last, scale_log2, tail_w, window, n_valid, tiles, tok_progs,
        HD: tl.constexpr, SPLIT: tl.constexpr, N_SPLITS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, SINGLE: tl.constexpr, PREC: tl.constexpr,
        BOUNDED: tl.constexpr, EP: tl.constexpr, PATHS: tl.constexpr, CHUNKS: tl.constexpr,
    ):
        kvh = tl.program_id(0)
        split = tl.program_id(2)
        if PATHS:  # noqa: SIM108 (a statement Triton resolves at compile time)
            bid = tl.program_id(2).to(tl.int64)  # the batch row (`Paths` of several rows)
        else:
            bid = 0
        q_ptr += bid * stride_qb
        k_ptr += bid * stride_kb
        v_ptr += bid * stride_vb
        out_ptr += bid * stride_ob
        if PATHS:  # positions, not slots (`Paths`); axis 1 numbers prefix tiles, then tail programs, axis 2 rows
            tail_ptr += bid * stride_tb
            pos_ptr += bid * stride_pb
            length = tl.load(length_ptr + bid)  # positions below it are the committed prefix, at their own slots
            pid = tl.program_id(1)
            if pid < tiles * N_SPLITS:  # stacked rows over a split of the prefix alone: every token sees its keys
                split = pid // tiles
                rows = (pid % tiles) * BM + tl.arange(0, BM)  # [BM] stacked rows r·T + t
                row_ok = (rows < rows_total) & (rows % tokens < n_valid) & (rows * 0 + (split + 1) * SPLIT <= length)
                tok1 = rows_total * 0
            else:  # one token's query heads over a split from the one holding `length` on: its own path's slots
                j = pid - tiles * N_SPLITS
                split = (length // SPLIT).to(tl.int32) + j // tok_progs
                tok1 = (j % tok_progs) // CHUNKS  # the token
                heads = (j % CHUNKS) * BM + tl.arange(0, BM)  # [BM] its query heads
                rows = heads * tokens + tok1  # [BM] stacked rows r·T + t
                row_ok = (heads < groups) & (heads * 0 + tok1 < n_valid) & (heads * 0 + split < N_SPLITS)
            tok = rows % tokens
            qpos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)  # [BM] each row sees positions up to its token's
            end = tl.max(qpos, 0) + 1
            n_blocks = tl.minimum(tl.maximum(end - split * SPLIT + BN - 1, 0) // BN, SPLIT // BN)
        else:
            rows = tl.program_id(1) * BM + tl.arange(0, BM)  # [BM] stacked rows r·T + t
            row_ok = rows < rows_total
            tok = rows % tokens
        d = tl.arange(0, HD)
        q = tl.load(q_ptr + kvh * stride_qh + rows[:, None] * stride_qr + d[None, :], mask=row_ok[:, None],
                    other=0.0)  # [BM, HD]
        m_i = tl.full([BM], -1.0e30, tl.float32)  # finite: a row with nothing visible yet keeps alpha = 1
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, HD], tl.float32)
        if not PATHS:
            if BOUNDED:  # no row sees a slot beyond the last written one: walk the split's blocks up to it only
                e = tl.arange(0, EP)
                end = tl.max(tl.load(last_ptr + e, mask=e < n_last, other=0), 0) + 1
                n_blocks = tl.minimum(tl.maximum(end - split * SPLIT + BN - 1, 0) // BN, SPLIT // BN)
            else:
                n_blocks = SPLIT // BN
        for b in range(0, n_blocks):
            cols = split * SPLIT + b * BN + tl.arange(0, BN)  # [BN] slots (PATHS: positions)
            if PATHS:
                rel = cols - length  # [BN] position relative to the first uncommitted one
                in_tail = (rel >= 0) & (rel < tail_w)
                tail = tl.load(tail_ptr + tok1 * stride_tt + rel, mask=in_tail, other=0)
                where = tl.where(rel < 0, cols, tail)  # [BN] the slot that holds each position for this token
                col_ok = ((rel < 0) | in_tail) & (cols < end)
                seen = (row_ok[:, None] & col_ok[None, :] & (cols[None, :] <= qpos[:, None])
                        & (cols[None, :] > qpos[:, None] - window))  # [BM, BN]
            else:
                where = cols
                col_ok = cols < seq_len
                seen = tl.load(mask_ptr + tok[:, None] * stride_mt + cols[None, :],
                               mask=row_ok[:, None] & col_ok[None, :], other=0) != 0  # [BM, BN]
            # no branch on `seen`: K and V reads go out beside the mask's instead of waiting on it, and a block no
            # row sees adds exactly nothing (its weights are exp(-inf) = 0, the running max stays)
            k = tl.load(k_ptr + kvh * stride_kh + where[:, None] * stride_ks + d[None, :],
                        mask=col_ok[:, None], other=0.0)  # [BN, HD]
            v = tl.load(v_ptr + kvh * stride_vh + where[:, None] * stride_vs + d[None, :],
                        mask=col_ok[:, None], other=0.0)  # [BN, HD]
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [BM, BN] fp32, log2 units
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        if SINGLE:
            head = kvh * groups + rows // tokens
            o = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows have l = 0
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * HD + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = ((bid * n_kv + kvh) * rows_total + rows) * N_SPLITS + split  # [BM] into [B, n_kv, R, N_SPLITS]
            tl.store(part_o_ptr + part[:, None] * HD + d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)

    @triton.jit
    def combine_kernel(
        part_o_ptr, part_ml_ptr, out_ptr, pos_ptr, stride_ot, stride_ob, stride_pb, n_kv, rows_total, tokens,
        groups, valid, HD: tl.constexpr, N_SPLITS: tl.constexpr, SP: tl.constexpr, SPLIT: tl.constexpr,
        PATHS: tl.constexpr,
    ):
        kvh = tl.program_id(0)
        row = tl.program_id(1)
        bid = tl.program_id(2).to(tl.int64)  # batch row (`Paths`; 0 otherwise)
        out_ptr += bid * stride_ob
        pos_ptr += bid * stride_pb
        sp = tl.arange(0, SP)  # [SP] splits, padded to a power of two
        d = tl.arange(0, HD)
        tok = row % tokens
        sp_ok = sp < N_SPLITS
        base = ((bid * n_kv + kvh) * rows_total + row) * N_SPLITS
        m = tl.load(part_ml_ptr + (base + sp) * 2, mask=sp_ok, other=-1.0e30)  # [SP]
        ell = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=sp_ok, other=0.0)
        acc = tl.load(part_o_ptr + (base + sp)[:, None] * HD + d[None, :], mask=sp_ok[:, None], other=0.0)
        if PATHS:  # splits past the token's position hold no partials (`split_kernel` runs no program there):
            # loaded beside the position rather than after it (a dependent load per row), then dropped
            reach = sp <= tl.load(pos_ptr + tok) // SPLIT
            m = tl.where(reach, m, -1.0e30)
            ell = tl.where(reach, ell, 0.0)
            acc = tl.where(reach[:, None], acc, 0.0)
        w = tl.exp2(m - tl.max(m, 0))  # [SP]: splits this row does not see have m = -1e30, so w = 0
        o = tl.sum(w[:, None] * acc, 0) / tl.sum(w * ell, 0)  # [HD]
        head = kvh * groups + row // tokens
        tl.store(out_ptr + tok * stride_ot + head * HD + d, o.to(out_ptr.dtype.element_ty),
                 mask=d * 0 + tok < valid)  # padding tokens (`Paths.valid`) keep their zeros

    return split_kernel, combine_kernel


class Paths(NamedTuple):
    """What each token of a decoding forward sees, by position rather than by slot: the committed prefix
    (positions below `length`, each at the slot of its own number), then its own path, positions length ..
    pos[t], at the slots `tail[t]` names (a tree node's ancestors sit at other slots than their positions).
    With B rows, each over its own cache (`eagle3.fast.rows`), every field gains a leading row axis.

    Walked by position, a token's keys fall into the same key blocks and splits wherever its path sits in the
    cache, so a tree node on the accepted path gets the bits a one-token step at its position gets."""

    length: torch.Tensor  # [1] or [B] long: the committed prefix
    tail: torch.Tensor  # [(B,) T, W] long: tail[t, j] = the slot of token t's path at position length + j (j <= depth)
    pos: torch.Tensor  # [(B,) T] long: each token's position
    valid: int | None = None  # tokens that count (the rest are padding: not computed, their outputs zero)


def split_attention(
    q: torch.Tensor,  # [(B,) n_kv, g·T, hd], stacked query rows (row r·T + t: head kv·g + r, token t)
    k: torch.Tensor,  # [(B,) n_kv, S, hd], last dim contiguous
    v: torch.Tensor,  # [(B,) n_kv, S, hd], last dim contiguous
    mask: torch.Tensor | None,  # bool [T, S]: which slots each token sees (None with `paths`)
    scale: float,
    last: torch.Tensor | None = None,  # int [n]: no token sees a slot beyond max(last) (a forward's own slots)
    paths: Paths | None = None,
    window: int | None = None,  # with `paths`: a token at position p sees positions above p - window only
) -> torch.Tensor:
    """Attention of the stacked rows to every visible slot; returns [T, nh·hd] (nh = n_kv·g) in q's dtype, or
    [B, T, nh·hd] for B rows (4-d q, k, v: `paths` only).

    Visibility is either a mask over slots or, for decoding forwards, `paths` (see `Paths`; splits holding only
    the committed prefix keep stacked tiles, the others take one token's query heads per tile, and each token
    walks the key blocks up to its own position). With `last`,
    each program walks its split's key blocks up to slot max(last) only (the caller vouches that no token sees a
    slot beyond it; the outputs are the same, since blocks no token sees add nothing); without it, every block."""
    batched = q.dim() == 4
    if batched and paths is None:
        raise ValueError("split_attention over several rows needs paths")
    if not batched:  # one row: the same kernels with a row axis of one
        q, k, v = q[None], k[None], v[None]
        if paths is not None:
            paths = Paths(paths.length.reshape(1), paths.tail[None], paths.pos[None], paths.valid)
    b, nkv, rows, hd = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("split_attention needs q, k and v contiguous in their last dimension")
    seq_len = k.shape[2]
    if paths is None:
        tokens = mask.shape[0]
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask_bytes = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    else:
        tokens = paths.pos.shape[1]
        mask_bytes = paths.pos  # unused
    groups = rows // tokens
    if rows != groups * tokens:
        raise ValueError("split_attention needs g·T query rows")
    split_kernel, combine_kernel = _kernels()
    split = split_size(seq_len)
    n_splits = -(-seq_len // split)
    valid = tokens if paths is None or paths.valid is None else paths.valid
    out = (torch.empty if valid == tokens else torch.zeros)(b, tokens, nkv * groups * hd, dtype=q.dtype,
                                                              device=q.device)  # [B, T, nh·hd]
    single = n_splits == 1
    if single:
        part_o = part_ml = out  # unused
    else:
        part_o = torch.empty(b, nkv, rows, n_splits, hd, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, nkv, rows, n_splits, 2, dtype=torch.float32, device=q.device)
    bounded = last is not None and paths is None
    if bounded and (last.dim() != 1 or last.is_floating_point() or not 1 <= last.numel() <= MAX_ROWS):
        raise ValueError(f"last must be an integer tensor of 1 to {MAX_ROWS} slots, got {tuple(last.shape)} "
                         f"{last.dtype}")
    tiles = -(-rows // BLOCK_M)
    if paths is None:
        chunks = tok_progs = 1
        grid = (nkv, tiles, n_splits)
        tail = length = pos = mask_bytes  # unused
    else:
        # prefix tiles of every split, then one token's heads per program over the splits a path reaches: positions
        # length .. length + W - 1 span at most this many splits from the one holding `length`
        chunks = -(-groups // BLOCK_M)
        tok_progs = valid * chunks
        tail_splits = min(n_splits, 1 + (split + paths.tail.shape[2] - 2) // split)
        grid = (nkv, tiles * n_splits + tail_splits * tok_progs, b)
        tail, length, pos = paths.tail, paths.length, paths.pos
        if (tail.shape[:2] != (b, tokens) or pos.shape != (b, tokens) or tail.stride(-1) != 1
                or pos.stride(-1) != 1 or length.numel() != b):
            raise ValueError(f"paths: tail must be [B, T, W] and pos [B, T] with B = {b} rows and T = {tokens} "
                             "tokens (contiguous rows), length [B]")
    split_kernel[grid](
        q, k, v, mask_bytes, last if bounded else mask_bytes, part_o, part_ml, out, tail, pos, length,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        mask_bytes.stride(0) if paths is None else 0, out.stride(1), tail.stride(1) if paths is not None else 0,
        q.stride(0), k.stride(0), v.stride(0), out.stride(0), tail.stride(0) if paths is not None else 0,
        pos.stride(0) if paths is not None else 0, nkv,
        rows, tokens, seq_len, groups, last.numel() if bounded else 0,
        scale * 1.4426950408889634,  # log2(e)
        tail.shape[2] if paths is not None else 0, window or seq_len + 1, valid, tiles, tok_progs,
        HD=hd, SPLIT=split, N_SPLITS=n_splits, BM=BLOCK_M, BN=BLOCK_N, SINGLE=single,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", BOUNDED=bounded,
        EP=1 << (last.numel() - 1).bit_length() if bounded else 1, PATHS=paths is not None, CHUNKS=chunks,
        num_warps=4, num_stages=2,
    )
    if not single:
        sp = 1 << (n_splits - 1).bit_length()
        combine_kernel[(nkv, rows, b)](
            part_o, part_ml, out, pos, out.stride(1), out.stride(0), pos.stride(0) if paths is not None else 0,
            nkv, rows, tokens, groups, valid,
            HD=hd, N_SPLITS=n_splits, SP=sp, SPLIT=split, PATHS=paths is not None, num_warps=1 if hd <= 64 else 2,
        )
    return out if batched else out[0]


@functools.cache
def split_paths_op():
    """`split_attention` of B rows by `Paths` as the opaque custom op `eagle3::split_attention_paths`, for compiled
    code: the server's rows' drafter attends this way inside compiled drafting (`FastDrafter.forward_rows`).
    Registered on first use; resolve it outside traced code."""

    @torch.library.custom_op("eagle3::split_attention_paths", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, tail: torch.Tensor,
           pos: torch.Tensor, scale: float) -> torch.Tensor:
        return split_attention(q, k, v, None, scale, paths=Paths(length, tail, pos))

    @op.register_fake
    def _(q, k, v, length, tail, pos, scale):
        b, nkv, rows, hd = q.shape
        return q.new_empty(b, pos.shape[1], nkv * rows // pos.shape[1] * hd)

    return torch.ops.eagle3.split_attention_paths.default
