"""Coupled drafts for sampled requests (`FastRows.choose_drafts`): the drafter draws with the noise of the target's
own position-keyed draw, so a drafter that matches the target drafts exactly the token the target will draw; the
target's tokens, and so the output, stay its own draws."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import DraftShape, SamplingConfig
from eagle3.decoding.sampling import FILTERED, TEMPERATURE, race_sample
from eagle3.fast import FastRows, FastTarget
from eagle3.runtime import init_drafter

SEED = 7


def rows_for(model, vocab: int | None, coupled: bool = True, k: int = 1) -> FastRows:
    drafter = init_drafter(model, draft_vocab_size=vocab, seed=2).eval()
    shape = DraftShape(3, k, 3 * k if k > 1 else 3)
    return FastRows(FastTarget(model, drafter.config.aux_layer_ids), drafter, capacity=1, seq_len=64,
                    shapes=lambda _b: shape, coupled=coupled)


def coupled_hits(rows: FastRows, sampling: SamplingConfig, mode: int, positions: range, outside: float) -> int:
    """How often the first draft equals the target's draw when the drafter's logits are the target's on the draft
    vocabulary (the target's logits elsewhere: `outside`)."""
    d = rows.d
    vocab = rows.row_sampling.vocab_h.shape[0]
    draft_to_target = d.to_target_ids(torch.arange(d.lm_head.shape[0]))  # [Vd]
    rows.row_sampling.set(0, [sampling])
    g = torch.Generator().manual_seed(0)
    hits = 0
    for p in positions:
        target = torch.full((vocab,), outside)
        target[draft_to_target] = 3.0 * torch.randn(len(draft_to_target), generator=g)
        d.logits = lambda out, t=target: t[draft_to_target].expand(*out.shape[:-1], -1)  # [..., Vd]
        _, ids = rows.choose_drafts(torch.zeros(1, 1, d.hidden_size), torch.tensor([p]), mode, 1)  # [1, 1, 1]
        drawn = race_sample(target[None], torch.tensor([p]), SEED, sampling.temperature, sampling.top_p,
                            sampling.top_k)
        hits += int(d.to_target_ids(ids[0, 0, :1])) == int(drawn)
    return hits


@pytest.mark.parametrize("vocab", [None, 200])  # the whole vocabulary, or a draft vocabulary of 200 ids
@pytest.mark.parametrize("sampling, mode", [(SamplingConfig(temperature=1.0, seed=SEED), TEMPERATURE),
                                            (SamplingConfig(temperature=0.7, top_p=0.9, top_k=50, seed=SEED),
                                             FILTERED)])
def test_a_drafter_that_is_the_target_drafts_the_targets_draw(stories260k, vocab, sampling, mode):
    model, _ = stories260k
    positions = range(40, 240)
    assert coupled_hits(rows_for(model, vocab), sampling, mode, positions, float("-inf")) == len(positions)
    # negative control: the drafter's top-1 is the target's draw far less often at these temperatures
    assert coupled_hits(rows_for(model, vocab, coupled=False), sampling, mode, positions,
                        float("-inf")) < 0.8 * len(positions)


def test_siblings_are_draws_without_replacement(stories260k):
    """A tree's k children of one node: distinct tokens, the first the coupled draw."""
    model, _ = stories260k
    rows = rows_for(model, None, k=4)
    rows.row_sampling.set(0, [SamplingConfig(temperature=1.0, seed=SEED)])
    out = torch.randn(1, 3, rows.d.hidden_size)
    lq, ids = rows.choose_drafts(out, torch.tensor([55]), TEMPERATURE, 4)
    assert ids.shape == (1, 3, 4) and all(len(set(row.tolist())) == 4 for row in ids[0])
    assert torch.all(lq <= 0)


def test_the_generic_engines_proposer_couples_its_drafts_too(stories260k):
    """`Eagle3Proposer` (the generic engine's drafting: one row of `Eagle3BatchDrafter`): with the target's own
    logits as the drafter's, its first draft is the target's draw at the drafted position, for every seed; its
    sampled output is plain sampling's, token for token."""
    from eagle3.decoding.drafters import Eagle3Proposer
    from eagle3.decoding.engine import SpeculativeEngine
    from eagle3.decoding.proposers import NoDraftProposer
    from eagle3.target import Target

    model, tok = stories260k
    drafter = init_drafter(model, draft_vocab_size=None, seed=2).eval()
    prompt = torch.arange(5, 17)  # 12 tokens and the first new one: the first draft is the token at 13
    aux = torch.randn(1, 12, 3 * model.config.hidden_size)

    def hits(prop: Eagle3Proposer) -> int:
        g, n = torch.Generator().manual_seed(1), 0
        for seed in range(100):
            target = 3.0 * torch.randn(drafter.lm_head.weight.shape[0], generator=g)
            drafter.logits = lambda out, t=target: t.expand(*out.shape[:-1], -1)
            prop.sample_with(SamplingConfig(temperature=1.0), seed)
            prop.begin(prompt, aux, 3)
            drawn = race_sample(target[None], torch.tensor([13]), seed, 1.0)
            n += int(prop.propose().tokens[0]) == int(drawn)
        return n

    assert hits(Eagle3Proposer(drafter, DraftShape.chain(3))) == 100
    # negative control: drafting the top-1 finds the draw only where the draw is the argmax
    assert hits(Eagle3Proposer(drafter, DraftShape.chain(3), coupled=False)) < 80
    del drafter.logits
    sampling = SamplingConfig(temperature=1.0, seed=SEED)

    t = Target(model, drafter.config.aux_layer_ids)
    try:
        ids = tok("Once upon a time", add_special_tokens=True)["input_ids"]
        plain = SpeculativeEngine(t, NoDraftProposer()).generate(ids, max_new_tokens=40, sampling=sampling)
        coupled = SpeculativeEngine(t, Eagle3Proposer(drafter, DraftShape(3, 2, 5))).generate(
            ids, max_new_tokens=40, sampling=sampling)
    finally:
        t.close()
    assert coupled.token_ids == plain.token_ids


def test_the_servers_batch_drafter_couples_each_sampled_row(stories260k):
    """`Eagle3BatchDrafter` (the server's batch on the generic engine): with the target's logits as the drafter's,
    each sampled row's first draft is that row's own draw at its position; a greedy row beside it drafts the argmax."""
    from eagle3.decoding.drafters import Eagle3BatchDrafter

    model, _ = stories260k
    drafter = init_drafter(model, draft_vocab_size=None, seed=2).eval()
    batch = Eagle3BatchDrafter(drafter)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 14, 5)]
    aux = torch.randn(3, 14, 3 * model.config.hidden_size)
    batch.add(prompts, aux, [7, 8, 9])
    target = 3.0 * torch.randn(3, drafter.lm_head.weight.shape[0], generator=g)  # per row
    drafter.logits = lambda out: target.view(3, *([1] * (out.dim() - 2)), -1).expand(*out.shape[:-1], -1)
    sampling = [SamplingConfig(temperature=1.0, seed=11), SamplingConfig(), SamplingConfig(temperature=0.8, seed=12)]
    tokens, _ = batch.propose([0, 1, 2], DraftShape.chain(1), sampling)
    for r, (p, s) in enumerate(zip(prompts, sampling, strict=True)):
        pos = torch.tensor([len(p) + 1])  # the token after the first generated one
        want = target[r].argmax() if s.temperature == 0 else race_sample(target[r : r + 1], pos, s.seed,
                                                                          s.temperature)[0]
        assert int(tokens[r, 0]) == int(want), r
    del drafter.logits
