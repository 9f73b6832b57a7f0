"""The drafter's top-k log-probabilities in two Triton kernels (`eagle3.fast.draft_top_k`).

On a CPU the kernels run in Triton's interpreter; on a GPU (marked `gpu`) compiled. Against torch's log-softmax
and top-k: values, indices, the lower index first among equal logits, vocabularies of one chunk and of many (with
a short last chunk), k = 1; the op through torch.compile; and the rows' drafted tree, which must be the tree
that the PyTorch top-k drafts from the same state, with greedy decoding through it equal to HF `generate`.
Run: pytest tests/test_draft_top_k.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_target
from eagle3.config import DraftShape
from eagle3.fast import FastRows, FastTarget
from eagle3.fast import draft_top_k as dtk
from eagle3.runtime import init_drafter

pytest.importorskip("triton")


def reference(logits, k):
    return torch.log_softmax(logits.double(), dim=-1).topk(k, dim=-1)


@pytest.mark.parametrize("rows,vocab,k", [(3, 12_288, 10), (1, 12_288, 10), (3, 1_000, 1), (4, 300, 7),
                                          (2, 70_000, 5), (5, 256, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_log_probs_matches_torch(interpreted, rows, vocab, k, dtype):
    gen = torch.Generator().manual_seed(rows * vocab + k)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    if dtype == torch.bfloat16:  # bf16 holds many equal values: compare the values and that the ids carry them
        logits = torch.randperm(rows * vocab, generator=gen).view(rows, vocab).float().div(rows * vocab).to(dtype)
    vals, ids = dtk.top_k_log_probs(logits, k)
    want_vals, want_ids = reference(logits, k)
    assert vals.shape == ids.shape == (rows, k) and vals.dtype == torch.float32 and ids.dtype == torch.long
    torch.testing.assert_close(vals.double(), want_vals, atol=2e-5, rtol=1e-5)
    lp = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(lp.gather(-1, ids), want_vals, atol=2e-5, rtol=1e-5)  # ids of the k best values
    assert all(len(set(r)) == k for r in ids.tolist())
    if dtype == torch.float32:  # no equal values: the same ids in the same order
        assert torch.equal(ids, want_ids)


def test_equal_logits_come_lowest_index_first(interpreted):
    logits = torch.zeros(2, 1_000)
    logits[0, [700, 3, 450]] = 5.0
    logits[1, 999] = 1.0
    vals, ids = dtk.top_k_log_probs(logits, 4)
    assert ids[0].tolist() == [3, 450, 700, 0] and ids[1].tolist() == [999, 0, 1, 2]
    assert torch.equal(vals[0, 0], vals[0, 2])


def test_bad_k_is_refused(interpreted):
    with pytest.raises(ValueError, match="1 <= k <= 32"):
        dtk.top_k_log_probs(torch.zeros(1, 100), 33)
    with pytest.raises(ValueError, match="1 <= k <= 5"):
        dtk.top_k_log_probs(torch.zeros(1, 5), 6)
    assert dtk.chunk_size(100) == dtk.MIN_CHUNK and dtk.chunk_size(70_000) == 2_048
    assert -(-1_000_000 // dtk.chunk_size(1_000_000)) <= dtk.MAX_CHUNKS


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_op_compiles_as_one_call(interpreted, backend):
    op = dtk.draft_top_k_op()
    f = torch.compile(lambda x: op(x * 2, 4), backend=backend, fullgraph=True)
    x = torch.randn(3, 2_000, generator=torch.Generator().manual_seed(0))
    vals, ids = f(x)
    want = torch.log_softmax(x * 2, dim=-1).topk(4)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(vals, want.values)


def test_rows_draft_the_same_tree_through_the_kernels_and_decode_losslessly(interpreted):
    """A 4,3,12 tree on the fast path with the kernels: HF `generate`'s greedy tokens, and from the state the last
    cycle left, the same drafted tree as the PyTorch top-k."""
    model = build_tiny_target("llama")
    d = init_drafter(model, draft_vocab_size=200, seed=1)
    rows = FastRows(FastTarget(model, d.config.aux_layer_ids), d, capacity=1, seq_len=256,
                    shapes=lambda _b: DraftShape(4, 3, 12), sampling=False)
    assert rows._top_k_ops[3] is None  # a CPU: PyTorch's top-k unless asked
    rows._top_k_ops[3] = dtk.draft_top_k_op()
    prompt = torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(5))
    ref = model.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 11:].tolist()
    out = [rows.add(prompt.tolist())]
    while len(out) < 12:
        out += rows.cycle(spec=True)[0]
    assert out[:12] == ref
    tree = rows._draft(1)
    rows._top_k_ops[3] = None
    assert all(torch.equal(a, b) for a, b in zip(rows._draft(1), tree, strict=True))



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernels_on_a_gpu():
    logits = torch.randn(10, 12_288, device="cuda").to(torch.bfloat16)
    vals, ids = dtk.top_k_log_probs(logits, 10)
    lp = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(vals, lp.topk(10, dim=-1).values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp.gather(-1, ids), vals, atol=1e-5, rtol=1e-5)
