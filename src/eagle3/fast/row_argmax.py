"""Greedy token ids as two Triton kernels, for CUDA: the argmax of each row of the target's logits
(`eagle3.fast.rows.FastRows` verification where the target attends by splits, `FastTarget.argmax`).

torch's argmax reduces one row in one thread block, which leaves most of the GPU idle for a vocabulary-wide
row (once per plain step and once per verification). Here `argmax_chunk_kernel` runs one program per (row,
chunk of the vocabulary) and writes the chunk's maximum and where it is; `argmax_merge_kernel`, one program per row, takes the best of those. Among equal
values the lowest index wins and NaN counts as the largest (the first NaN of a row wins), as in torch.argmax,
so the ids are the same.
"""

from __future__ import annotations

import functools

import torch

MAX_CHUNKS = 128  # the merge kernel holds one row's chunk maxima at once
MIN_CHUNK = 1024


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def argmax_chunk_kernel(x_ptr, part_v_ptr, part_i_ptr, stride_x, vocab, n_chunks, CHUNK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + r * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        nan = x != x
        best = tl.max(tl.where(nan, float("-inf"), x), 0)
        at = tl.min(tl.where(x == best, cols, 2147483647), 0)
        first_nan = tl.min(tl.where(nan, cols, 2147483647), 0)
        any_nan = first_nan < 2147483647  # then the chunk's value is NaN, at its first NaN
        tl.store(part_v_ptr + r * n_chunks + c, tl.where(any_nan, float("nan"), best))
        tl.store(part_i_ptr + r * n_chunks + c, tl.where(any_nan, first_nan, at))

    @triton.jit
    def argmax_merge_kernel(part_v_ptr, part_i_ptr, out_ptr, n_chunks, CP: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, CP)
        ok = c < n_chunks
        v = tl.load(part_v_ptr + r * n_chunks + c, mask=ok, other=float("-inf"))
        i = tl.load(part_i_ptr + r * n_chunks + c, mask=ok, other=2147483647)
        nan = v != v
        best = tl.max(tl.where(nan, float("-inf"), v), 0)
        at = tl.min(tl.where(v == best, i, 2147483647), 0)
        first_nan = tl.min(tl.where(nan, i, 2147483647), 0)  # chunks in index order: the first NaN of the row
        tl.store(out_ptr + r, tl.where(first_nan < 2147483647, first_nan, at).to(tl.int64))

    return argmax_chunk_kernel, argmax_merge_kernel


def chunk_size(vocab: int) -> int:
    """Vocabulary entries per chunk: a power of two of at least MIN_CHUNK, so that there are at most MAX_CHUNKS."""
    per = -(-vocab // MAX_CHUNKS)
    return max(MIN_CHUNK, 1 << (per - 1).bit_length())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The index [R] (int64) of each row's largest value of logits [R, V] (any float dtype), as
    `logits.argmax(dim=-1)`: the lowest index among equals, NaN first."""
    if torch.compiler.is_compiling():  # inside torch.compile (compiled drafting's pieces): torch's argmax
        return logits.argmax(dim=-1)
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows takes logits [R, V], got {tuple(logits.shape)}")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = x.shape
    chunk = chunk_size(vocab)
    n_chunks = -(-vocab // chunk)
    part_v = torch.empty(rows, n_chunks, dtype=torch.float32, device=x.device)
    part_i = torch.empty(rows, n_chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    chunk_kernel, merge_kernel = _kernels()
    chunk_kernel[(rows, n_chunks)](x, part_v, part_i, x.stride(0), vocab, n_chunks, CHUNK=chunk,
                                   num_warps=max(1, min(8, chunk // 512)))
    merge_kernel[(rows,)](part_v, part_i, out, n_chunks, CP=1 << (n_chunks - 1).bit_length(), num_warps=1)
    return out
