"""The speculation guard: its decisions on scripted cycle timings, and both engines under it decoding exactly what
plain decoding does while they switch drafting off and on."""

from __future__ import annotations

import copy

import pytest
import torch

from eagle3.config import ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.guard import SpeculationGuard
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.fast import FastEngine, FastOptions, FastRows, FastTarget
from eagle3.runtime import init_drafter
from eagle3.target import Target


def drive(guard: SpeculationGuard, cycles: int, spec_s: float, spec_tokens: int, plain_s: float = 1.0) -> list[bool]:
    """Run `cycles` through the guard with fixed costs; the drafting decision of each."""
    out = []
    for _ in range(cycles):
        d = guard.drafting()
        out.append(d)
        guard.record(d, spec_s if d else plain_s, spec_tokens if d else 1)
    return out


def test_guard_keeps_drafting_that_pays():
    g = SpeculationGuard()
    decisions = drive(g, 200, spec_s=2.5, spec_tokens=3)  # 1.2 tokens in a plain step's time: a close win
    assert g.switches == 0
    # plain steps only to measure one: the first cycle, then one after every `remeasure_every` drafting cycles
    assert decisions[0] is False and decisions.count(False) == 1 + (200 - 1) // (g.remeasure_every + 1)


def test_guard_measures_plain_steps_rarely_while_drafting_clearly_wins():
    g = SpeculationGuard()
    decisions = drive(g, 600, spec_s=1.3, spec_tokens=3)  # 2.3 tokens in a plain step's time
    assert g.switches == 0
    assert decisions[0] is False and decisions.count(False) == 1 + (600 - 1) // (g.remeasure_when_clear + 1)


def test_guard_stops_drafting_that_loses_and_probes_less_and_less():
    g = SpeculationGuard()
    decisions = drive(g, 400, spec_s=1.3, spec_tokens=1)  # a drafter that is never right, cycles 1.3 plain steps
    assert g.switches == 1
    # measure, 6 drafting cycles (a close loss must hold beyond the noise of the cycles seen), then probes of 2
    # after 8 plain steps and after waits that double or keep the probes' cost near 3 % (20 steps)
    runs, cur, n = [], decisions[0], 0
    for d in decisions:
        if d == cur:
            n += 1
        else:
            runs.append((cur, n))
            cur, n = d, 1
    assert runs[:12] == [(False, 1), (True, 6), (False, 8), (True, 2), (False, 20), (True, 2), (False, 40),
                         (True, 2), (False, 80), (True, 2), (False, 160), (True, 2)]
    assert decisions.count(True) == 16
    assert sum(1.3 if d else 1.0 for d in decisions) / len(decisions) < 1.02  # within 2 % of plain decoding


def test_guard_stops_a_drafter_that_is_never_right_and_costs_little():
    """A never-right drafter whose cycle costs 1.14 plain steps (a CPU chain that stops after one draft): every
    cycle agrees, so the variance floor meant for a few agreeing cycles shrinks as more agree, and drafting stops
    within a short answer. With a fixed floor the decayed window (about 10 cycles) never got past the noise
    margin of such a close loss, and the answer ran at 1.14x plain decoding's time."""
    g = SpeculationGuard()
    decisions = drive(g, 128, spec_s=1.14, spec_tokens=1)
    assert g.switches == 1 and decisions[:20].count(True) < 20
    assert sum(1.14 if d else 1.0 for d in decisions) / len(decisions) < 1.03  # within 3 % of plain decoding


def test_guard_gives_up_on_an_expensive_loss_at_once():
    g = SpeculationGuard()
    decisions = drive(g, 400, spec_s=3.0, spec_tokens=1)  # a 60-node tree on a CPU with a random drafter
    assert decisions[:3] == [False, True, False]  # one cycle at a third of plain speed is enough
    assert decisions.count(True) == 7  # probes after 8, then 124 (3 % of the time), then 248 plain steps
    assert sum(3.0 if d else 1.0 for d in decisions) / len(decisions) < 1.04  # within 4 % of plain decoding


def test_guard_resumes_when_drafting_pays_again():
    g = SpeculationGuard()
    drive(g, 40, spec_s=1.3, spec_tokens=1)
    assert not g.on
    later = drive(g, 100, spec_s=1.3, spec_tokens=3)  # the text became predictable
    assert g.on and later[-20:].count(True) >= 19


def test_guard_keeps_a_good_drafter_through_a_hard_stretch():
    """Five tokens a cycle, then 20 cycles of one (a hard stretch of text), then five again: the stretch's mean
    loses, but not beyond the noise the cycles have shown, so drafting stays on; a guard that judges the mean
    alone switches off there; a loss that lasts (60 cycles) switches both off."""

    def switches(guard: SpeculationGuard, hard: int) -> int:
        for e in [5] * 100 + [1] * hard + [5] * 100:
            d = guard.drafting()
            guard.record(d, 1.57 if d else 1.0, e if d else 1)  # a tree cycle on a GPU: 1.57 plain steps
        return guard.switches

    assert switches(SpeculationGuard(), 20) == 0
    assert switches(SpeculationGuard(z=0.0, min_var=0.0), 20) == 1  # the mean alone
    assert switches(SpeculationGuard(), 60) == 1


def test_guard_uses_a_known_plain_step():
    g = SpeculationGuard(plain_s=1.0)
    decisions = drive(g, 12, spec_s=1.3, spec_tokens=1)
    assert decisions[:7] == [True] * 6 + [False]  # no measuring step first


@pytest.fixture(scope="module")
def pair(stories260k):
    model, tok = stories260k
    model = copy.deepcopy(model)
    drafter = init_drafter(model, seed=3).eval()  # random: the guard switches drafting off on any device
    return model, tok, drafter


class Flaky(SpeculationGuard):
    """Drafts in bursts, whatever the timing: every mix of drafting and plain cycles is exercised."""

    def __init__(self):
        super().__init__()
        self.i = 0

    def drafting(self) -> bool:
        self.i += 1
        return (self.i // 3) % 2 == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("shape", [DraftShape.chain(3), DraftShape(3, 2, 5)])
def test_generic_engine_under_guard_is_plain_decoding(pair, monkeypatch, shape, temperature):
    model, tok, drafter = pair
    target = Target(model, drafter.config.aux_layer_ids)
    plain = SpeculativeEngine(target, NoDraftProposer(), tok)
    monkeypatch.setattr("eagle3.decoding.engine.SpeculationGuard", Flaky)
    guarded = SpeculativeEngine(target, Eagle3Proposer(drafter, shape), tok, guard=True)
    sampling = SamplingConfig(temperature=temperature, seed=5)
    ids = tok("Once upon a time", add_special_tokens=True)["input_ids"]
    a = plain.generate(ids, max_new_tokens=40, sampling=sampling)
    b = guarded.generate(ids, max_new_tokens=40, sampling=sampling)
    assert a.token_ids == b.token_ids
    assert 0 < b.stats.plain_steps < b.stats.cycles


@pytest.mark.parametrize("chain_stop", [None, 0.3])
def test_fast_engine_under_guard_is_plain_decoding(pair, monkeypatch, chain_stop):
    model, tok, drafter = pair
    plain = FastEngine(model, draft="none", tokenizer=tok)
    monkeypatch.setattr("eagle3.fast.engine.SpeculationGuard", Flaky)
    guarded = FastEngine(model, draft="eagle3", spec=DraftShape.chain(4), drafter=drafter, tokenizer=tok,
                         options=FastOptions(guard=True, chain_stop=chain_stop))
    ids = tok("Once upon a time", add_special_tokens=True)["input_ids"]
    for temperature in (0.0, 0.8):
        sampling = SamplingConfig(temperature=temperature, seed=7)
        a = plain.generate(ids, max_new_tokens=48, sampling=sampling)
        b = guarded.generate(ids, max_new_tokens=48, sampling=sampling)
        assert a.token_ids == b.token_ids
        assert 0 < b.stats.plain_steps < b.stats.cycles


def test_plain_cycles_feed_the_drafter_what_they_held(pair):
    """The guard's plain steps are plain cycles of the row: they hold their rows for the drafter, and fed in one
    forward the rows leave the drafter where a prefill of the whole text leaves it (no stale cache slots), also
    after a request that left with its rows unfed."""
    model, tok, drafter = pair
    ids = tok("Once upon a time", add_special_tokens=True)["input_ids"]

    def rows() -> FastRows:
        return FastRows(FastTarget(model, drafter.config.aux_layer_ids), drafter, capacity=1, seq_len=256,
                        shapes=lambda _b: DraftShape.chain(4), feed_window=32)

    late = rows()
    late.add(tok("The dog", add_special_tokens=True)["input_ids"])
    for _ in range(19):  # leaves 19 unfed
        late.cycle(spec=False)
    late.clear()
    out = [late.add(ids)]
    for _ in range(29):
        out += late.cycle(spec=False)[0]
    assert late._held == [29] and int(late.length[0]) == len(ids) + 29
    late._feed(1)
    fresh = rows()
    fresh.add(ids + out[:-1], root=out[-1])
    assert torch.allclose(late.last_out[0], fresh.last_out[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine", ["generic", "fast"])
def test_engines_keep_their_guards_from_request_to_request(pair, monkeypatch, engine):
    """One guard for greedy requests and one for sampled ones, kept across requests: what the first request
    learned (drafting does not pay) holds in the next, which starts where the first left off."""
    model, tok, drafter = pair
    made = []

    class Counted(Flaky):
        def __init__(self):
            super().__init__()
            made.append(self)

    module = "eagle3.decoding.engine" if engine == "generic" else "eagle3.fast.engine"
    monkeypatch.setattr(f"{module}.SpeculationGuard", Counted)
    if engine == "generic":
        guarded = SpeculativeEngine(Target(model, drafter.config.aux_layer_ids), Eagle3Proposer(drafter, DraftShape.chain(3)),
                                    tok, guard=True)
    else:
        guarded = FastEngine(model, draft="eagle3", spec=DraftShape.chain(3), drafter=drafter, tokenizer=tok,
                             options=FastOptions(guard=True))
    ids = tok("Once upon a time", add_special_tokens=True)["input_ids"]
    guarded.generate(ids, max_new_tokens=12)
    first = made[0].i
    guarded.generate(ids, max_new_tokens=12)
    assert len(made) == 1 and made[0].i > first  # the same guard went on counting
    guarded.generate(ids, max_new_tokens=12, sampling=SamplingConfig(temperature=0.8, seed=1))
    assert len(made) == 2 and len(guarded.guards) == 2
    guarded.guards.reset()
    guarded.generate(ids, max_new_tokens=12)
    assert len(made) == 3


def test_guard_needs_eager_drafting(pair):
    model, tok, _ = pair
    with pytest.raises(ConfigError, match="guard"):
        FastEngine(model, draft="none", tokenizer=tok, options=FastOptions(guard=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_engine_under_guard_with_cuda_graphs_is_plain_decoding(pair, monkeypatch, dtype):
    """Plain steps replay their own graph between the cycles' graphs, pipelined; the tokens stay plain decoding's
    (bf16: a chain's rows round as one-token steps do)."""
    model, tok, drafter = pair
    model = copy.deepcopy(model).to("cuda", dtype)
    drafter = copy.deepcopy(drafter).to("cuda", dtype)
    plain = FastEngine(model, draft="none", tokenizer=tok)
    monkeypatch.setattr("eagle3.fast.engine.SpeculationGuard", Flaky)
    guarded = FastEngine(model, draft="eagle3", spec=DraftShape.chain(4), drafter=drafter, tokenizer=tok,
                         options=FastOptions(guard=True))
    ids = tok("Once upon a time", add_special_tokens=True)["input_ids"]
    for temperature in (0.0, 0.8):
        sampling = SamplingConfig(temperature=temperature, seed=7)
        a = plain.generate(ids, max_new_tokens=96, sampling=sampling)
        b = guarded.generate(ids, max_new_tokens=96, sampling=sampling)
        assert guarded.graphed
        assert a.token_ids == b.token_ids
        assert 0 < b.stats.plain_steps < b.stats.cycles
