"""TTT unrolling: attention equals chained inference, alignment, weights and loss reduction.

Run: pytest tests/test_ttt.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import eagle3.training.ttt as ttt_mod
from eagle3.config import DrafterConfig
from eagle3.drafter import DrafterKV, Eagle3Drafter, ttt_attention
from eagle3.training.ttt import (
    ScoredRows,
    answer_positions,
    base_mask,
    shift_left,
    soft_cross_entropy,
    step_denominators,
    step_mask,
    step_supervision,
    ttt_loss,
    unroll,
)

V, VD, HT = 64, 40, 32


def make_drafter(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3], target_num_layers=4)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        d.embed_tokens.weight.normal_()
        for name, p in d.named_parameters():  # non-trivial norms so that their placement matters
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ids = torch.sort(torch.randperm(V)[:VD]).values
    d.set_vocab_mapping(ids)
    return d.eval()


def packed_batch():
    """Row 0: two packed documents (5 + 6 tokens); row 1: one document of 7 tokens, then 4 pad slots."""
    t = 11
    doc = torch.tensor([[0] * 5 + [1] * 6, [0] * 7 + [-1] * 4])
    pos = torch.tensor([list(range(5)) + list(range(6)), list(range(7)) + [0] * 4])
    ids = torch.randint(0, V, (2, t))
    ids[1, 7:] = 0
    return ids, pos, doc


def chain_reference(d: Eagle3Drafter, hidden, ids, pos, doc, b: int, t: int, k: int) -> torch.Tensor:
    """Inference-style: prefill the document up to row t (step-0 keys of rows <= t), then k single-token
    draft steps for row t with teacher-forced tokens, each attending to the whole cache."""
    start = int((doc[b] == doc[b, t]).nonzero()[0])
    cache = DrafterKV()
    rows = slice(start, t + 1)
    out = d(hidden[b : b + 1, rows], ids[b : b + 1, start + 1 : t + 2], pos[b : b + 1, rows], cache=cache)
    h = out[:, -1:]
    for j in range(1, k + 1):
        x = ids[b : b + 1, t + 1 + j : t + 2 + j]
        h = d(d.feedback(h), x, pos[b : b + 1, t : t + 1] + j, cache=cache)
    return h[0, -1]


def unpacked_batch():
    """Row 0: one document of 11 tokens; row 1: one document of 7 tokens, then 4 pad slots (as `collate`)."""
    ids, _, _ = packed_batch()
    doc = torch.tensor([[0] * 11, [0] * 7 + [-1] * 4])
    pos = torch.tensor([list(range(11)), list(range(7)) + [0] * 4])
    return ids, pos, doc


@pytest.mark.parametrize("batch", [packed_batch, unpacked_batch])
def test_ttt_attention_equals_chained_inference(batch):
    d = make_drafter()
    ids, pos, doc = batch()
    assert (ttt_mod.ttt_mask(doc).base is None) == (batch is unpacked_batch)  # causal kernels where they apply
    aux = torch.randn(2, ids.shape[1], 3 * HT)
    steps = 4
    with torch.no_grad():
        hidden = d.combine(aux)
        outs = list(unroll(d, hidden, ids, pos, doc, steps))
        checked = 0
        for b in range(2):
            for t in range(ids.shape[1]):
                for k in range(steps):
                    # the teacher-forced token x_{t+1+k} must exist inside row t's document
                    if doc[b, t] < 0 or t + 1 + k >= ids.shape[1] or doc[b, t + 1 + k] != doc[b, t]:
                        continue
                    ref = chain_reference(d, hidden, ids, pos, doc, b, t, k)
                    torch.testing.assert_close(outs[k][b, t], ref, atol=2e-5, rtol=1e-4)
                    checked += 1
    assert checked >= 20


def test_plain_causal_mask_over_steps_differs():
    """Pitfall 10: letting step k attend causally over all concatenated step blocks is a different model."""
    d = make_drafter()
    t = 8
    ids = torch.randint(0, V, (1, t))
    pos = torch.arange(t)[None]
    doc = torch.zeros(1, t, dtype=torch.long)
    aux = torch.randn(1, t, 3 * HT)
    with torch.no_grad():
        hidden = d.combine(aux)
        right = list(unroll(d, hidden, ids, pos, doc, 3))
        cache, h, wrong = DrafterKV(), hidden, []
        for k in range(3):
            out = d(h, shift_left(ids, 1 + k), pos + k, mask=None, cache=cache)  # causal after the cache
            wrong.append(out)
            h = d.feedback(out)
    torch.testing.assert_close(right[0], wrong[0])  # step 0 has no earlier blocks
    for k in (1, 2):
        assert (right[k][0, :-3] - wrong[k][0, :-3]).abs().max() > 1e-3


def test_step_mask_blocks():
    doc = torch.tensor([[0, 0, 1, 1, -1]])
    m = step_mask(doc, 2)
    assert m.shape == (1, 1, 5, 15)
    b0 = m[0, 0, :, :5]
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]])
    assert torch.equal(b0, expect.bool())
    for j in (1, 2):
        assert torch.equal(m[0, 0, :, 5 * j : 5 * (j + 1)], torch.eye(5, dtype=torch.bool))
    assert torch.equal(base_mask(doc)[0], b0)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_structured_ttt_attention_equals_dense_step_mask(n):
    """`ttt_attention` (step-0 scores + one dot product per own key) is SDPA under the dense `step_mask`, in the
    output and in the gradients of q, k and v, on packed documents with padding."""
    torch.manual_seed(0)
    _, _, doc = packed_batch()  # [2, 11]
    b, t, nh, hd = doc.shape[0], doc.shape[1], 4, 8
    q = torch.randn(b, nh, t, hd, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, nh, (n + 1) * t, hd, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, nh, (n + 1) * t, hd, dtype=torch.float64, requires_grad=True)
    w = torch.randn(b, nh, t, hd, dtype=torch.float64)
    outs, grads = [], []
    for fn in (lambda: ttt_attention(q, k, v, base_mask(doc)[:, None]),
               lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=step_mask(doc, n))):
        o = fn()
        outs.append(o)
        grads.append(torch.autograd.grad((o * w).sum(), (q, k, v)))
    torch.testing.assert_close(outs[0], outs[1])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1)


def test_causal_ttt_attention_equals_dense_step_mask_on_document_rows():
    """Rows of one document each, right-padded: the implicit causal pattern gives every document row the output
    and (with padding rows unweighted, as in the loss) the gradients of the dense `step_mask`."""
    torch.manual_seed(0)
    _, _, doc = unpacked_batch()
    b, t, nh, hd, n = doc.shape[0], doc.shape[1], 4, 8, 3
    q = torch.randn(b, nh, t, hd, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, nh, (n + 1) * t, hd, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, nh, (n + 1) * t, hd, dtype=torch.float64, requires_grad=True)
    w = torch.randn(b, nh, t, hd, dtype=torch.float64) * (doc >= 0)[:, None, :, None]  # padding rows: no weight
    real = doc >= 0
    outs, grads = [], []
    for fn in (lambda: ttt_attention(q, k, v, None),
               lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=step_mask(doc, n))):
        o = fn()
        outs.append(o.transpose(1, 2)[real])  # [real rows, nh, hd]
        grads.append(torch.autograd.grad((o * w).sum(), (q, k, v)))
    torch.testing.assert_close(outs[0], outs[1])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1)


def test_step_supervision_worked_example():
    """Docstring example, n = 6: row t is supervised at step k iff x_{t+2+k} exists and is a target token."""
    doc = torch.zeros(1, 6, dtype=torch.long)
    lm = torch.ones(1, 6)
    for k in range(4):
        w = step_supervision(lm, doc, k)[0]
        assert w.tolist() == [1.0 if t + 2 + k <= 5 else 0.0 for t in range(6)]
    lm = torch.tensor([[0, 0, 0, 1, 1, 0]])  # tokens x_3, x_4 written by the target
    assert step_supervision(lm, doc, 0)[0].tolist() == [0, 1, 1, 0, 0, 0]  # rows predicting x_3, x_4
    assert step_supervision(lm, doc, 1)[0].tolist() == [1, 1, 0, 0, 0, 0]
    assert step_denominators(lm, doc, 3).tolist() == [2, 2, 1]  # N_k = sum(m[2 + k:])
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])  # labels must stay inside the row's document
    assert step_supervision(torch.ones(1, 6), doc, 0)[0].tolist() == [1, 0, 0, 1, 0, 0]
    doc = torch.tensor([[0, 0, 0, 0, -1, -1]])  # nor run into padding
    assert step_supervision(torch.ones(1, 6), doc, 0)[0].tolist() == [1, 1, 0, 0, 0, 0]


def _targets(b, t, seed=1):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(b, t, V, generator=g) * 3
    return full


def _loss_inputs(d, full):
    return full[..., d.t2d], full.argmax(-1)


def test_one_step_loss_matches_soft_cross_entropy():
    d = make_drafter()
    b, t = 2, 9
    ids = torch.randint(0, V, (b, t))
    pos = torch.arange(t).expand(b, t)
    doc = torch.zeros(b, t, dtype=torch.long)
    lm = (torch.rand(b, t) > 0.3).float()
    aux = torch.randn(b, t, 3 * HT)
    full = _targets(b, t)
    full[0, 4, :] = -10.0
    full[0, 4, int((~d.t2d).nonzero()[0])] = 10.0  # argmax outside the draft vocab: dropped
    tl, ta = _loss_inputs(d, full)
    lm[0, 5] = 1.0  # row 3 is supervised
    out = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=1)
    with torch.no_grad():
        logits = d.logits(d(d.combine(aux), shift_left(ids, 1), pos, mask=step_mask(doc, 0), cache=DrafterKV()))
    sup = step_supervision(lm, doc, 0)
    w = sup * shift_left(d.t2d[ta], 1)
    assert sup[0, 3] == 1 and w[0, 3] == 0  # row 3 reads z_4, whose argmax has no draft id
    ce = F.cross_entropy(logits.reshape(-1, VD), torch.softmax(shift_left(tl, 1), -1).reshape(-1, VD),
                         reduction="none").view(b, t)
    expect = (ce * w).sum() / sup.sum()  # dropped positions count in the denominator, add no loss
    torch.testing.assert_close(out.loss, expect, rtol=1e-5, atol=1e-6)
    assert out.step_count.tolist() == [sup.sum().item()]
    assert out.step_kept.tolist() == [w.sum().item()]


def test_label_temperature_sharpens_the_labels_towards_the_targets_argmax():
    """soft_cross_entropy at temperature tau uses softmax(z / tau) as labels: 1 is the unchanged EAGLE-3 objective,
    0 the cross-entropy to the argmax, small tau approaches that; ttt_loss passes it through and refuses tau < 0."""
    g = torch.Generator().manual_seed(7)
    logits, z = torch.randn(5, VD, generator=g), torch.randn(5, VD, generator=g) * 3
    torch.testing.assert_close(soft_cross_entropy(logits, z), F.cross_entropy(logits, torch.softmax(z, -1),
                                                                              reduction="none"))
    torch.testing.assert_close(soft_cross_entropy(logits, z, 0.5), F.cross_entropy(logits, torch.softmax(z / 0.5, -1),
                                                                                   reduction="none"))
    hard = F.cross_entropy(logits, z.argmax(-1), reduction="none")
    torch.testing.assert_close(soft_cross_entropy(logits, z, 0.0), hard)
    torch.testing.assert_close(soft_cross_entropy(logits, z, 1e-3), hard, rtol=1e-4, atol=1e-4)

    d = make_drafter(seed=2)
    ids, pos, doc = packed_batch()
    b, t = ids.shape
    lm = (doc >= 0).float()
    aux = torch.randn(b, t, 3 * HT, generator=g)
    tl, ta = _loss_inputs(d, _targets(b, t))
    base = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=3)
    same = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=3, label_temperature=1.0)
    sharp = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=3, label_temperature=0.0)
    assert torch.equal(base.loss, same.loss)
    assert not torch.isclose(base.loss, sharp.loss)
    # what a row is pulled towards changes, not which rows count or how they score
    assert torch.equal(base.step_count, sharp.step_count) and torch.equal(base.step_correct, sharp.step_correct)
    assert torch.equal(base.step_kept, sharp.step_kept)
    with pytest.raises(ValueError, match=r"label_temperature=-0\.5 must be >= 0"):
        ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=3, label_temperature=-0.5)


def test_split_batch_with_global_denominators_equals_full_batch():
    """What makes DDP and gradient accumulation exact: per-part sums over the global count add up."""
    d = make_drafter()
    b, t, steps = 4, 10, 3
    ids = torch.randint(0, V, (b, t))
    pos = torch.arange(t).expand(b, t)
    doc = torch.zeros(b, t, dtype=torch.long)
    doc[1, 7:] = -1
    lm = (torch.rand(b, t) > 0.2).float()
    aux = torch.randn(b, t, 3 * HT)
    tl, ta = _loss_inputs(d, _targets(b, t))
    full = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=steps)
    full.loss.backward()
    g_full = d.fc.weight.grad.clone()
    d.zero_grad()
    den = step_denominators(lm, doc, steps)
    total = 0.0
    for part in (slice(0, 1), slice(1, 4)):
        o = ttt_loss(d, aux[part], ids[part], pos[part], doc[part], lm[part], tl[part], ta[part],
                     steps=steps, denominators=den)
        o.loss.backward()
        total += o.loss.item()
    assert total == pytest.approx(full.loss.item(), rel=1e-5)
    torch.testing.assert_close(d.fc.weight.grad, g_full, rtol=1e-4, atol=1e-7)


def test_step_decay_and_accuracy():
    d = make_drafter()
    b, t, steps = 1, 12, 3
    ids = torch.randint(0, V, (b, t))
    pos = torch.arange(t)[None]
    doc = torch.zeros(b, t, dtype=torch.long)
    lm = torch.ones(b, t)
    aux = torch.randn(b, t, 3 * HT)
    full = _targets(b, t)
    full[..., ~d.t2d] = -20.0  # every target argmax inside the draft vocab
    tl, ta = _loss_inputs(d, full)
    o = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=steps, step_decay=0.5)
    per_step = o.step_loss_sum / o.step_count
    torch.testing.assert_close(o.loss, (per_step * torch.tensor([1.0, 0.5, 0.25])).sum())
    assert o.step_count.tolist() == [t - 2, t - 3, t - 4]
    # a target whose argmax is the drafter's step-0 prediction gives step-0 accuracy 1
    with torch.no_grad():
        out0 = next(unroll(d, d.combine(aux), ids, pos, doc, 1))
        pred = d.draft_ids_to_target(d.logits(out0).argmax(-1))  # [B, T] row r predicts position r + 1
    agree = torch.full((b, t, V), -5.0)
    agree[0, torch.arange(1, t), pred[0, :-1]] = 5.0
    o2 = ttt_loss(d, aux, ids, pos, doc, lm, *_loss_inputs(d, agree), steps=1)
    assert o2.step_correct.item() == o2.step_count.item() == t - 2
    o3 = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=1)
    assert o3.step_correct.item() < o3.step_count.item()


def test_multi_step_loss_equals_a_dense_reference():
    """Every TTT step scores the right rows against the right targets: the loss and counts equal a dense
    computation over all rows, weighted by supervision and draft-vocabulary membership (packed documents, padding,
    some target argmaxes outside the draft vocabulary)."""
    d = make_drafter(seed=3)
    ids, pos, doc = packed_batch()
    b, t = ids.shape
    steps, decay = 4, 0.8
    g = torch.Generator().manual_seed(5)
    lm = (torch.rand(b, t, generator=g) > 0.3).float() * (doc >= 0)
    aux = torch.randn(b, t, 3 * HT, generator=g)
    full = _targets(b, t)
    full[0, 6, int((~d.t2d).nonzero()[0])] = 50.0  # this target's argmax has no draft id
    tl, ta = _loss_inputs(d, full)
    o = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=steps, step_decay=decay)
    den = step_denominators(lm, doc, steps).clamp_min(1.0)
    expect, kept = torch.zeros(()), []
    with torch.no_grad():
        for k, out in enumerate(unroll(d, d.combine(aux), ids, pos, doc, steps)):
            w = step_supervision(lm, doc, k) * shift_left(d.t2d[ta], 1 + k)  # [B, T]
            p = torch.softmax(shift_left(tl, 1 + k), -1)
            ce = -(p * torch.log_softmax(d.logits(out).float(), -1)).sum(-1)  # [B, T]
            expect = expect + decay**k * (torch.nan_to_num(ce) * w).sum() / den[k]
            kept.append(w.sum().item())
    torch.testing.assert_close(o.loss.detach(), expect, rtol=1e-5, atol=1e-6)
    assert o.step_kept.tolist() == kept and kept[0] > kept[-1] > 0


def test_answer_positions_and_early_accuracy(monkeypatch):
    """Answer positions restart at every supervised run; the early counts keep labels among each answer's first
    EARLY_TOKENS tokens, and equal the full counts when every answer is shorter than that."""
    lm = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 1, 1, 1, 1, 0]], dtype=torch.float)
    assert answer_positions(lm).tolist() == [[-1, 0, 1, 2, -1, -1, 0, 1], [0, 1, -1, 0, 1, 2, 3, -1]]
    packed = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0] * 8])  # row 0: a second document starts at token 4
    lm_packed = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [1] * 8], dtype=torch.float)
    assert answer_positions(lm_packed, packed).tolist() == [[-1, 0, 1, 2, 0, 1, -1, -1], list(range(8))]
    d = make_drafter()
    b, t, steps = 2, 8, 2
    ids = torch.randint(0, V, (b, t))
    pos = torch.arange(t).expand(b, t)
    doc = torch.zeros(b, t, dtype=torch.long)
    aux = torch.randn(b, t, 3 * HT)
    tl, ta = _loss_inputs(d, _targets(b, t))
    o = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=steps)
    assert o.step_early_count.tolist() == o.step_count.tolist()
    assert o.step_early_correct.tolist() == o.step_correct.tolist()
    monkeypatch.setattr(ttt_mod, "EARLY_TOKENS", 2)  # labels at answer positions 0 and 1 only
    o2 = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=steps)
    # step 0: row t's label is x_{t+2}; supervised labels at positions 2, 3, 6, 7 (doc 0) and 3..6 (doc 1)
    early0 = [(0, 2), (0, 6), (0, 7), (1, 3), (1, 4)]  # (row, label index) with answer position < 2
    assert o2.step_early_count[0].item() == len(early0)
    assert o2.step_early_count[0] < o2.step_count[0]
    assert o2.step_early_correct[0] <= o2.step_early_count[0]


def test_garbage_on_unsupervised_rows_does_not_reach_the_gradient():
    d = make_drafter()
    ids, pos, doc = packed_batch()
    b, t = ids.shape
    lm = torch.ones(b, t)
    tl, ta = _loss_inputs(d, _targets(b, t))
    tl[1, 7:] = float("nan")  # padding
    o = ttt_loss(d, torch.randn(b, t, 3 * HT), ids, pos, doc, lm, tl, ta, steps=3)
    o.loss.backward()
    assert torch.isfinite(o.loss)
    assert all(torch.isfinite(p.grad).all() for p in d.trainable_parameters() if p.grad is not None)


def test_scored_rows_planned_on_the_host_give_the_same_objective():
    """ScoredRows built from the host copy of a batch (what the trainer passes) gives the loss, gradients and
    counts of letting ttt_loss find the rows itself; a zero-weight batch plans no rows; a plan for another number
    of steps is refused."""
    d = make_drafter(seed=4)
    ids, pos, doc = packed_batch()
    b, t = ids.shape
    g = torch.Generator().manual_seed(9)
    lm = (torch.rand(b, t, generator=g) > 0.3).float() * (doc >= 0)
    aux = torch.randn(b, t, 3 * HT, generator=g)
    full = _targets(b, t)
    full[1, 3, int((~d.t2d).nonzero()[0])] = 50.0  # one target argmax without a draft id
    tl, ta = _loss_inputs(d, full)
    plan = ScoredRows.of(lm.clone(), doc.clone(), 3)
    assert plan.per_step == [int(step_supervision(lm, doc, k).sum()) for k in range(3)]
    assert plan.one_doc is False and ScoredRows.of(lm[:1, :5], torch.zeros(1, 5, dtype=torch.long), 3).one_doc
    outs = []
    for scored in (None, plan):
        d.zero_grad()
        o = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=3, scored=scored)
        o.loss.backward()
        outs.append((o, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    (a, ga), (c, gc) = outs
    torch.testing.assert_close(a.loss, c.loss)
    for f in ("step_loss_sum", "step_correct", "step_count", "step_kept", "step_early_correct", "step_early_count"):
        torch.testing.assert_close(getattr(a, f), getattr(c, f), msg=f)
    assert ga.keys() == gc.keys() and ga
    for n in ga:
        torch.testing.assert_close(ga[n], gc[n], msg=n)
    assert ScoredRows.of(torch.zeros_like(lm), doc, 3).per_step == [0, 0, 0]
    with pytest.raises(ValueError, match="planned for 3 TTT steps, not 2"):
        ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=2, scored=plan)


def _aligned_reference(d, aux, ids, pos, doc, lm, tl, ta, steps, decay, k_top):
    """Dense TTT loss where step k's row t counts only if, at every earlier step j whose row t was scored, the
    data token x_{t+2+j} was among that step's k_top best draft tokens (the module docstring)."""
    den = step_denominators(lm, doc, steps).clamp_min(1.0)
    reach = torch.ones(ids.shape, dtype=torch.bool)
    loss, alive = torch.zeros(()), []
    with torch.no_grad():
        for k, out in enumerate(unroll(d, d.combine(aux), ids, pos, doc, steps)):
            sup = step_supervision(lm, doc, k) > 0  # [B, T]
            w = sup & shift_left(d.t2d[ta], 1 + k, False) & reach
            logits = d.logits(out).float()  # [B, T, Vd]
            ce = -(torch.softmax(shift_left(tl, 1 + k), -1) * torch.log_softmax(logits, -1)).sum(-1)
            loss = loss + decay**k * (torch.nan_to_num(ce) * w).sum() / den[k]
            alive.append(int((sup & reach).sum()))
            top = d.draft_ids_to_target(logits.topk(k_top, dim=-1).indices)  # [B, T, K]
            proposed = (top == shift_left(ids, 2 + k)[..., None]).any(-1)
            reach = reach & (proposed | ~sup)
    return loss, alive


@pytest.mark.parametrize("k_top", [1, 3])
def test_align_top_k_scores_only_the_rows_drafting_can_reach(k_top):
    """With align_top_k = K a row of step k adds loss only where its earlier steps each had the next data token
    among their K best draft tokens: the loss equals a dense reference, gradients reach only through those rows,
    the counts and accuracies still cover every supervised row, and fewer rows count at later steps."""
    d = make_drafter(seed=3)
    ids, pos, doc = packed_batch()
    doc[0] = 0  # row 0: one document of 11 tokens, long enough for every step; row 1 as packed_batch
    pos[0] = torch.arange(11)
    b, t = ids.shape
    ids = d.draft_ids_to_target(torch.randint(0, VD, (b, t), generator=torch.Generator().manual_seed(2)))
    steps, decay = 4, 0.8
    g = torch.Generator().manual_seed(5)
    lm = (torch.rand(b, t, generator=g) > 0.2).float() * (doc >= 0)
    lm[0] = 1.0
    aux = torch.randn(b, t, 3 * HT, generator=g)
    tl, ta = _loss_inputs(d, _targets(b, t))
    with torch.no_grad():  # let row 0 of document 0 be drafted right at every step: x_{2+j} = its step-j guess
        for j in range(steps - 1):  # row 0's step j reads x_1 .. x_{1+j} only, so earlier guesses stay
            out = list(unroll(d, d.combine(aux), ids, pos, doc, j + 1))[j]
            ids[0, 2 + j] = d.draft_ids_to_target(d.logits(out[0, 0]).argmax(-1))
    o = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=steps, step_decay=decay, align_top_k=k_top)
    expect, alive = _aligned_reference(d, aux, ids, pos, doc, lm, tl, ta, steps, decay, k_top)
    torch.testing.assert_close(o.loss.detach(), expect, rtol=1e-5, atol=1e-6)
    plain = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=steps, step_decay=decay)
    assert o.step_count.tolist() == plain.step_count.tolist() and o.step_correct.tolist() == plain.step_correct.tolist()
    assert alive[0] == o.step_count[0] and 0 < alive[-1] < o.step_count[-1]  # step 0 is always reachable
    assert o.step_loss_sum[0] == plain.step_loss_sum[0] and o.step_loss_sum[-1] < plain.step_loss_sum[-1]


def test_align_top_k_over_the_whole_draft_vocabulary_changes_nothing():
    """Every data token in the draft vocabulary is among all Vd draft tokens: K = Vd scores every row, with the
    same loss and gradients as K = 0; a negative K is refused."""
    d = make_drafter(seed=1)
    ids, pos, doc = packed_batch()
    b, t = ids.shape
    ids = d.draft_ids_to_target(torch.randint(0, VD, (b, t), generator=torch.Generator().manual_seed(4)))
    lm = (doc >= 0).float()
    aux = torch.randn(b, t, 3 * HT)
    tl, ta = _loss_inputs(d, _targets(b, t))
    grads = []
    for k_top in (0, VD):
        d.zero_grad()
        o = ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=3, align_top_k=k_top)
        o.loss.backward()
        grads.append((o.loss.detach(), d.fc.weight.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    with pytest.raises(ValueError, match="align_top_k=-1 must be >= 0"):
        ttt_loss(d, aux, ids, pos, doc, lm, tl, ta, steps=3, align_top_k=-1)
