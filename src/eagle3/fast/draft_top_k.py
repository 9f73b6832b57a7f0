"""The drafter's top-k log-probabilities in two Triton kernels, for CUDA drafting.

Each draft step of a tree takes, for each of its k frontier rows, the k best draft-vocabulary tokens and their
log-probabilities. As PyTorch work (a log-softmax over [k, Vd] and `eagle3.decoding.expand.top_k_last`), compiled by
inductor, that is about ten kernels per step, several of them reductions that run one program per row, a
large share of a tree's drafting time. Log-probabilities are logits minus the row's log-sum-exp, so
the best k log-probabilities are the best k logits shifted, and two short kernels do it all:
- `chunk_kernel`, one program per (row, chunk of the vocabulary): the chunk's maximum, its sum of exp(x - max),
  and its k best logits (k passes of max and lowest index among equals).
- `merge_kernel`, one program per row: the row's log-sum-exp from the chunks' (max, sum), and the k best of the
  chunks' candidates, minus it.
Values come out in descending order; among exactly equal logits the lower vocabulary index comes first. They are
fp32, as `FastDrafter.log_probs` returns them, within a few units in the last place of its values (another order
of summation): the drafter's rounding only changes which tokens are proposed, never what the target emits.
"""

from __future__ import annotations

import functools

import torch

MAX_CHUNKS = 64  # the merge kernel holds one row's (max, sum) of every chunk at once
MIN_CHUNK = 256
MAX_K = 32


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_kernel(x_ptr, part_v_ptr, part_i_ptr, part_ms_ptr, stride_x, vocab, n_chunks,
                     K: tl.constexpr, CHUNK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + r * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        base = r * n_chunks + c
        tl.store(part_ms_ptr + base * 2, m)
        tl.store(part_ms_ptr + base * 2 + 1, tl.sum(tl.exp(x - m), 0))  # masked slots add exp(-inf) = 0
        for j in tl.static_range(K):
            best = tl.max(x, 0)
            at = tl.min(tl.where(x == best, cols, 2147483647), 0)  # the lowest index among equals
            tl.store(part_v_ptr + base * K + j, best)
            tl.store(part_i_ptr + base * K + j, at)
            x = tl.where(cols == at, float("-inf"), x)

    @triton.jit
    def merge_kernel(part_v_ptr, part_i_ptr, part_ms_ptr, out_v_ptr, out_i_ptr, n_chunks,
                     K: tl.constexpr, CP: tl.constexpr, NP: tl.constexpr):
        r = tl.program_id(0)
        ch = tl.arange(0, CP)
        ch_ok = ch < n_chunks
        m = tl.load(part_ms_ptr + (r * n_chunks + ch) * 2, mask=ch_ok, other=float("-inf"))  # [CP]
        s = tl.load(part_ms_ptr + (r * n_chunks + ch) * 2 + 1, mask=ch_ok, other=0.0)
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(tl.where(ch_ok, s * tl.exp(m - top), 0.0), 0))
        n = tl.arange(0, NP)  # the chunks' candidates, chunk by chunk
        n_ok = n < n_chunks * K
        v = tl.load(part_v_ptr + r * n_chunks * K + n, mask=n_ok, other=float("-inf"))
        idx = tl.load(part_i_ptr + r * n_chunks * K + n, mask=n_ok, other=2147483647)
        for j in tl.static_range(K):
            best = tl.max(v, 0)
            at = tl.min(tl.where(v == best, idx, 2147483647), 0)  # vocabulary ids are distinct
            tl.store(out_v_ptr + r * K + j, best - lse)
            tl.store(out_i_ptr + r * K + j, at.to(tl.int64))
            v = tl.where(idx == at, float("-inf"), v)

    return chunk_kernel, merge_kernel


def chunk_size(vocab: int) -> int:
    """Vocabulary entries per chunk: a power of two of at least MIN_CHUNK, so that there are at most MAX_CHUNKS."""
    per = -(-vocab // MAX_CHUNKS)
    return max(MIN_CHUNK, 1 << (per - 1).bit_length())


def top_k_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-softmax values of each row of logits [R, V] (any float dtype), descending, fp32 [R, k],
    and their indices [R, k] (int64), by the custom op `draft_top_k_op` (inside compiled code call the op itself,
    resolved beforehand: tracing into its registration fails)."""
    if not takes(k, logits.shape[-1]):
        raise ValueError(f"the draft top-k kernel takes 1 <= k <= {min(MAX_K, logits.shape[-1])}, got {k}")
    return draft_top_k_op()(logits, k)


def takes(k: int, vocab: int) -> bool:
    """Whether the kernels take the top `k` of `vocab` entries."""
    return 1 <= k <= min(MAX_K, vocab)


@functools.cache
def draft_top_k_op():
    """The kernels as the opaque custom op `eagle3::draft_top_k` (`torch.library.custom_op` with a fake
    implementation: torch.compile keeps it as one call, CUDA graphs capture its launches), registered on first
    use."""
    chunk_kernel, merge_kernel = _kernels()

    @torch.library.custom_op("eagle3::draft_top_k", mutates_args=())
    def draft_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits if logits.stride(-1) == 1 else logits.contiguous()
        rows, vocab = x.shape
        chunk = chunk_size(vocab)
        n_chunks = -(-vocab // chunk)
        dev = x.device
        part_v = torch.empty(rows, n_chunks, k, dtype=torch.float32, device=dev)
        part_i = torch.empty(rows, n_chunks, k, dtype=torch.int32, device=dev)
        part_ms = torch.empty(rows, n_chunks, 2, dtype=torch.float32, device=dev)
        out_v = torch.empty(rows, k, dtype=torch.float32, device=dev)
        out_i = torch.empty(rows, k, dtype=torch.long, device=dev)
        chunk_kernel[(rows, n_chunks)](x, part_v, part_i, part_ms, x.stride(0), vocab, n_chunks,
                                       K=k, CHUNK=chunk, num_warps=max(1, min(8, chunk // 256)))
        cp = 1 << (n_chunks - 1).bit_length()
        np_ = 1 << (n_chunks * k - 1).bit_length()
        # one warp: its k passes of max and min reduce by shuffles, with no barrier between warps
        merge_kernel[(rows,)](part_v, part_i, part_ms, out_v, out_i, n_chunks, K=k, CP=cp, NP=np_, num_warps=1)
        return out_v, out_i

    @draft_top_k.register_fake
    def _(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = logits.shape[0]
        return (logits.new_empty(rows, k, dtype=torch.float32), logits.new_empty(rows, k, dtype=torch.long))

    return torch.ops.eagle3.draft_top_k.default
