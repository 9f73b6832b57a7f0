"""The greedy ids' Triton kernels (`eagle3.fast.row_argmax`: the fast target's argmax where it attends by splits).

On a CPU through Triton's interpreter (fp32, fp16): the ids torch.argmax gives, for one chunk and many, a short
last chunk, equal maxima inside a chunk and across chunks, NaN and -inf rows; which argmax a `FastTarget` takes.
On a GPU (`gpu`): the same in bf16 at SmolLM2's and Llama-3's vocabularies.
Run: pytest tests/test_row_argmax.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_target
from eagle3.fast import FastTarget, row_argmax

pytest.importorskip("triton")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def check(x: torch.Tensor) -> torch.Tensor:
    got = row_argmax.argmax_rows(x)
    assert got.dtype == torch.long and got.shape == x.shape[:1]
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))
    return got


@pytest.mark.parametrize("rows,vocab,dtype", [(1, 1000, torch.float32), (5, 5000, torch.float16),
                                              (2, 128_256, torch.float32)])  # 1 chunk; 5 (a short last); 126
def test_matches_torch_argmax(interpreted, rows, vocab, dtype):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    check(x)


def test_equal_maxima_give_the_lowest_index(interpreted):
    x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(1))
    x[0, [7, 3000, 4999]] = 10.0  # across chunks
    x[1, [1030, 1025]] = 10.0  # within one chunk
    x[2] = 0.5  # all equal
    x[3, [2048, 4096]] = float("inf")
    assert check(x).tolist() == [7, 1025, 0, 2048]


def test_nan_counts_as_the_largest(interpreted):
    x = torch.randn(3, 3000, generator=torch.Generator().manual_seed(2))
    x[0, [2500, 1200]] = float("nan")
    x[1, 5] = float("inf")
    x[1, 2999] = float("nan")
    x[2] = float("-inf")
    assert check(x).tolist() == [1200, 2999, 0]


def test_shape_is_checked(interpreted):
    with pytest.raises(ValueError, match=r"logits \[R, V\]"):
        row_argmax.argmax_rows(torch.zeros(2, 3, 4))


def test_chunks_stay_within_the_merge():
    assert row_argmax.chunk_size(1000) == row_argmax.MIN_CHUNK
    for vocab in (49_152, 128_256, 152_064, 262_144, 1_000_000):
        size = row_argmax.chunk_size(vocab)
        assert size & (size - 1) == 0 and -(-vocab // size) <= row_argmax.MAX_CHUNKS


def test_target_takes_the_kernel_where_it_attends_by_splits(interpreted):
    target = FastTarget(build_tiny_target("llama"))
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(3))
    logits[1, [4, 9]] = 9.0
    calls = []
    real = row_argmax.argmax_rows

    def spy(x):
        calls.append(x.shape)
        return real(x)

    import eagle3.fast.target as target_module

    target_module.argmax_rows, saved = spy, target_module.argmax_rows
    try:
        assert target.attention == "sdpa" and target.argmax(logits).tolist() == logits.argmax(-1).tolist()
        assert calls == []  # off CUDA: torch's argmax
        target.attention = "split"
        assert target.argmax(logits).tolist() == logits.argmax(-1).tolist() and calls == [(3, 300)]
    finally:
        target_module.argmax_rows = saved


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows,vocab", [(1, 49_152), (61, 49_152), (1, 128_256), (61, 128_256)])
def test_compiled_kernels_in_bf16(rows, vocab):
    x = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)  # bf16: many equal values
    check(x)
