"""Batched serving internals on CPU: batch caches never mix rows, the batched drafter equals the per-row one,
the adaptive policy, and position-keyed sampling.

The central check: requests decoded together by the `Scheduler` (rows joining at different times, ragged
acceptance, rows leaving) each give exactly the tokens `SpeculativeEngine` + `NoDraftProposer` gives alone.
Run: pytest tests/test_batching.py
"""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch

from conftest import ARCHS, TINY_SLIDING_WINDOW, build_tiny_target
from doubles import ScriptedProposer, SelfTreeProposer
from eagle3.config import ConfigError, DraftShape
from eagle3.decoding.drafters import Eagle3BatchDrafter, Eagle3Proposer, ProposerBatchDrafter, pad_trees
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.hf_batch import accept_batch, prefill
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.decoding.sampling import exponential_noise, race_sample
from eagle3.decoding.tree import DraftTree, ancestry
from eagle3.decoding.verify import accept
from eagle3.runtime import eos_token_ids, init_drafter
from eagle3.serving.config import ServeConfig
from eagle3.serving.policy import SpecPolicy, SpeedGate
from eagle3.serving.requests import GenParams, RequestHandle, SchedulerUnavailable, _Row
from eagle3.serving.scheduler import Scheduler
from eagle3.target import Target

SMALL_TREE = DraftShape(4, 3, 10)


def reference(model, tokenizer, prompts, max_tokens, eos) -> list:
    """Each prompt alone through the bs=1 engine with no drafts (what `eagle3 generate --draft none` runs)."""
    target = Target(model, [])
    engine = SpeculativeEngine(target, NoDraftProposer(), tokenizer)
    try:
        return [engine.generate(p, max_new_tokens=n, eos_token_ids=eos) for p, n in zip(prompts, max_tokens, strict=True)]
    finally:
        target.close()


def run_batch(sched: Scheduler, params: list[GenParams], stagger: dict[int, float] | None = None, timeout=60.0):
    """Submit all requests (request i after `stagger[i]` seconds), wait for every final event."""
    done: dict[int, object] = {}
    flags = [threading.Event() for _ in params]

    def sink_for(i):
        def sink(ev):
            if ev.kind != "delta":
                done[i] = ev
                flags[i].set()
        return sink

    sched.start()
    try:
        for i, p in enumerate(params):
            if stagger and i in stagger:
                time.sleep(stagger[i])
            sched.submit(RequestHandle(p, sink_for(i)))
        for i, f in enumerate(flags):
            assert f.wait(timeout), f"request {i} hung"
    finally:
        sched.stop(timeout=5)
    return [done[i] for i in range(len(params))]


def run_one(sched: Scheduler, params: GenParams, timeout=30.0):
    """Submit one request to a started scheduler and wait for its final event."""
    got, flag = {}, threading.Event()

    def sink(ev):
        if ev.kind != "delta":
            got["ev"] = ev
            flag.set()

    sched.submit(RequestHandle(params, sink))
    assert flag.wait(timeout), "request hung"
    return got["ev"]


def tiny_prompts(n_rows: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, TINY_SLIDING_WINDOW * 2 + 3, 9, 17, 5][:n_rows]  # one prompt passes the sliding window
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens]


# -- the scheduler equals bs=1 greedy decoding -----------------------------------------------------
@pytest.fixture(scope="module")
def stories(stories260k):
    model, tok = stories260k
    prompts = ["Once upon a time", "Lily and Tom went to the park. They", "The cat", "One day, a little girl named",
               "He", "The sun was shining and the birds"]
    ids = [tok(p)["input_ids"] for p in prompts]
    max_tokens = [20, 33, 7, 40, 25, 1]
    eos = eos_token_ids(model, tok)
    return model, tok, ids, max_tokens, eos, reference(model, tok, ids, max_tokens, eos)


@pytest.mark.parametrize("mode", ["plain", "eagle3"])
def test_scheduler_greedy_matches_single_requests(stories, mode):
    model, tok, ids, max_tokens, eos, refs = stories
    model = copy.deepcopy(model)  # the Target below hooks the model; keep the shared fixture clean
    drafter, aux = None, []
    if mode == "eagle3":
        d = init_drafter(model, seed=0)
        drafter, aux = Eagle3BatchDrafter(d), d.config.aux_layer_ids
    policy = SpecPolicy(SMALL_TREE, token_budget=1000, measure=False) if drafter else None
    sched = Scheduler(Target(model, aux), tok, eos, drafter=drafter, policy=policy)
    params = [GenParams(p, n) for p, n in zip(ids, max_tokens, strict=True)]
    out = run_batch(sched, params, stagger={3: 0.05, 5: 0.05})
    for i, (ev, ref) in enumerate(zip(out, refs, strict=True)):
        assert ev.kind == "done", ev.text
        assert ev.token_ids == ref.token_ids, f"row {i}"
        assert (ev.text, ev.finish_reason) == (ref.text, ref.finish_reason), f"row {i}"
        assert ev.completion_tokens == len(ref.token_ids)
    snap = sched.metrics.snapshot()
    assert snap["eagle3_batch_size_sum"] / snap["eagle3_batch_size_count"] > 1.5  # rows really shared cycles
    if mode == "eagle3":
        assert snap["eagle3_draft_tokens_total"] > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["self-tree", "scripted-2"])
def test_ragged_acceptance_keeps_rows_apart(arch, kind):
    """Always-right trees and partial acceptance, on every architecture (sliding windows, MoE)."""
    model = build_tiny_target(arch)
    prompts = tiny_prompts(4, seed=len(arch))
    max_tokens = [24, 18, 30, 12]
    refs = reference(model, None, prompts, max_tokens, eos=[])
    by_prompt = {tuple(p): r.token_ids for p, r in zip(prompts, refs, strict=True)}
    if kind == "self-tree":
        def factory(_prompt):
            return SelfTreeProposer(model, depth=3)
    else:
        def factory(prompt):
            return ScriptedProposer(by_prompt[tuple(prompt)], k=2, length=4, vocab_size=300, tree=True)
    policy = SpecPolicy(DraftShape(4, 2, 8), token_budget=1000, measure=False)
    sched = Scheduler(Target(model, []), None, [], drafter=ProposerBatchDrafter(factory), policy=policy)
    out = run_batch(sched, [GenParams(p, n) for p, n in zip(prompts, max_tokens, strict=True)], stagger={2: 0.02})
    for i, (ev, ref) in enumerate(zip(out, refs, strict=True)):
        assert ev.token_ids == ref.token_ids, f"{arch} {kind} row {i}"
    snap = sched.metrics.snapshot()
    assert snap["eagle3_accepted_tokens_total"] > 0.3 * snap["eagle3_spec_row_steps_total"]


def test_eos_inside_an_accepted_run_finishes_only_that_row():
    model = build_tiny_target("llama")
    prompts = tiny_prompts(3, seed=5)
    refs = reference(model, None, prompts, [30] * 3, eos=[])
    eos = refs[1].token_ids[6]  # a token row 1 emits mid-way; always-right trees accept runs across it
    want = reference(model, None, prompts, [30] * 3, eos=[eos])
    assert want[1].finish_reason == "stop" and len(want[1].token_ids) <= 7
    policy = SpecPolicy(DraftShape(4, 2, 8), token_budget=1000)
    sched = Scheduler(Target(model, []), None, [eos], policy=policy,
                      drafter=ProposerBatchDrafter(lambda _p: SelfTreeProposer(model, depth=4)))
    out = run_batch(sched, [GenParams(p, 30) for p in prompts])
    for ev, ref in zip(out, want, strict=True):
        assert (ev.token_ids, ev.finish_reason) == (ref.token_ids, ref.finish_reason)


# -- cancellation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["batch", "rows"])
def test_a_cancelled_request_frees_its_row(stories, where):
    """A request cancelled mid-stream (as a client disconnect does) leaves its row, on the HF rows and on the fast
    rows alike, with no final event; the server goes on serving."""
    from eagle3.serving.cli import fast_rows

    model, tok, ids, max_tokens, eos, refs = stories
    model = copy.deepcopy(model)  # the Target below hooks the model; keep the shared fixture clean
    cfg = ServeConfig(max_batch_size=4, fast_rows_len=256)
    rows = fast_rows("on", model, None, SpecPolicy(largest=None), cfg, "cpu") if where == "rows" else None
    sched = Scheduler(Target(model, []), tok, eos, config=cfg, rows=rows)
    events = []
    holder = {}

    def sink(ev):
        events.append(ev)
        if ev.kind == "delta" and len(events) == 2:
            holder["h"].cancelled = True

    sched.start()
    try:
        holder["h"] = RequestHandle(GenParams(ids[3], 40, stream=True), sink)
        sched.submit(holder["h"])
        deadline = time.monotonic() + 30
        while not holder["h"].finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert holder["h"].finished and all(ev.kind == "delta" for ev in events)
        after = run_one(sched, GenParams(ids[0], max_tokens[0]))
        assert after.token_ids == refs[0].token_ids  # the server goes on serving
    finally:
        sched.stop(timeout=5)
    assert 'finish_reason="cancelled"' in sched.metrics.render()
    assert set(sched.cycle_trace()["path"]) == {where} and sched.running == 0
    assert all(b.backend.n == 0 for b in sched._batches)


# -- batched drafter == per-row drafter ------------------------------------------------------------
def test_batched_eagle3_drafter_matches_per_row_proposer(stories260k):
    """Rows drafted together (padded caches, ragged extensions, a subset of rows) give the trees each row gives
    alone (`Eagle3Proposer`: one row of its own)."""
    model, tok = stories260k
    model = copy.deepcopy(model)
    d = init_drafter(model, seed=3)
    target = Target(model, d.config.aux_layer_ids)
    prompts = [tok(t)["input_ids"] for t in ["Once upon a time there was a", "Tom", "The dog ran to"]]
    _kv, last, aux = prefill(target, prompts)
    first = last.argmax(-1).tolist()
    batched = Eagle3BatchDrafter(d)
    batched.add(prompts, aux, first)
    shape = DraftShape(4, 3, 10)
    singles = []
    for i, p in enumerate(prompts):
        pr = Eagle3Proposer(d, DraftShape(4, 3, 10))
        pr.begin(torch.tensor(p), aux[i : i + 1, : len(p)], first[i])
        singles.append(pr)
    for step in range(2):
        tokens, parents = batched.propose([0, 1, 2], shape)
        for i, pr in enumerate(singles):
            tree = pr.propose()
            assert tokens[i].tolist() == tree.tokens.tolist(), f"step {step} row {i}"
            assert parents[i].tolist() == tree.parents.tolist(), f"step {step} row {i}"
        # extend rows by different amounts (ragged acceptance), then draft again
        counts = [1, 3, 2]
        feats = torch.randn(3, 3, aux.shape[-1])
        new = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
        batched.extend(feats, new, counts)
        for i, pr in enumerate(singles):
            pr.accept(feats[i, : counts[i]], torch.tensor(new[i][: counts[i]]))
    # a subset of rows drafts alone: same trees
    tokens, _ = batched.propose([2], shape)
    assert tokens[0].tolist() == singles[2].propose().tokens.tolist()


# -- batched acceptance ------------------------------------------------------------------------
def test_padded_batch_acceptance_matches_each_tree_alone():
    g = torch.Generator().manual_seed(0)
    trees = []
    for n in [0, 1, 5, 9]:
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)], dtype=torch.long)
        trees.append(DraftTree(tokens=torch.randint(0, 4, (n,), generator=g), parents=parents))
    for trial in range(30):
        tokens, parents = pad_trees([(t.tokens, t.parents) for t in trees], "cpu")
        logits = torch.randn(len(trees), tokens.shape[1] + 1, 4, generator=g)
        parents1 = torch.cat([torch.zeros(len(trees), 1, dtype=torch.long), parents + 1], dim=1)
        paths, nxt = accept_batch(tokens, parents1, ancestry(parents1, tokens.shape[1]), logits.argmax(-1))
        for i, t in enumerate(trees):
            single = accept(t, logits[i, : t.n + 1].argmax(-1))
            assert (paths[i], nxt[i]) == (single.path, single.next_token), f"trial {trial} tree {i}"


# -- policy ------------------------------------------------------------------------------------
def test_policy_shrinks_trees_with_batch_size():
    pol = SpecPolicy(DraftShape(6, 10, 60), token_budget=256)
    sizes = {b: pol.draft_tokens(b) for b in (1, 4, 8, 16, 32, 64, 128, 256)}
    assert sizes == {1: 60, 4: 60, 8: 31, 16: 15, 32: 7, 64: 3, 128: 1, 256: 0}
    assert pol.shape(1) == DraftShape(6, 10, 60)
    assert pol.shape(64) == DraftShape.chain(3)
    assert pol.shape(256) is None
    for b in (1, 4, 8, 16, 32, 64, 128):
        s = pol.shape(b)
        assert b * (s.total + 1) <= 256 and s.total <= s.top_k + (s.depth - 1) * s.top_k ** 2
    assert SpecPolicy(max_batch=8).shape(9) is None
    assert SpecPolicy(largest=None).shape(1) is None
    chain = SpecPolicy(DraftShape.chain(5), token_budget=32)
    assert chain.shape(1) == DraftShape.chain(5) and chain.shape(8) == DraftShape.chain(3)


def test_stop_cancels_in_flight_requests_after_the_timeout(stories):
    model, tok, ids, _max, eos, _refs = stories
    sched = Scheduler(Target(copy.deepcopy(model), []), tok, eos)
    events, first = [], threading.Event()

    def sink(ev):
        events.append(ev)
        first.set()

    sched.start()
    sched.submit(RequestHandle(GenParams(ids[0], 480, stream=True), sink))
    assert first.wait(30)
    sched.stop(timeout=0.0)
    assert events[-1].kind == "error" and events[-1].status == 503 and len(events) < 400
    assert not sched.alive and sched.running == 0
    with pytest.raises(SchedulerUnavailable):
        sched.submit(RequestHandle(GenParams(ids[0], 4), sink))


# -- admission -----------------------------------------------------------------------------------
@pytest.mark.parametrize("admit_wait", [0.0, 1e9])
def test_arrivals_gather_for_one_prefill_while_the_batch_decodes(stories, admit_wait):
    """Requests arriving one by one while a row decodes share one prefill when they may wait (here without
    limit: they join when the batch is full, or when it empties); at 0 each is admitted on arrival. Outputs
    equal the single-request reference either way."""
    model, tok, ids, _max, eos, _refs = stories
    model = copy.deepcopy(model)
    lens = [200, 12, 9, 14, 11]
    refs = reference(model, tok, ids[:5], lens, eos)
    cfg = ServeConfig(max_batch_size=5, admit_wait=admit_wait)
    sched = Scheduler(Target(model, []), tok, eos, config=cfg)
    sched._prefill_ema = 1.0  # as if one prefill had been measured
    out = run_batch(sched, [GenParams(p, n) for p, n in zip(ids[:5], lens, strict=True)],
                    stagger={i: 0.02 for i in range(1, 5)})
    assert [ev.token_ids for ev in out] == [r.token_ids for r in refs]
    prefills = sched.metrics.snapshot()["eagle3_prefill_seconds_count"]
    if admit_wait:
        assert prefills == 2  # the first request alone, then the four that waited for it
    else:
        assert prefills >= 3


def test_a_waiting_request_joins_when_the_batch_empties(stories):
    model, tok, ids, _max, eos, _refs = stories
    model = copy.deepcopy(model)
    refs = reference(model, tok, ids[:2], [30, 8], eos)
    sched = Scheduler(Target(model, []), tok, eos, config=ServeConfig(admit_wait=1e9))
    sched._prefill_ema = 1.0
    out = run_batch(sched, [GenParams(ids[0], 30), GenParams(ids[1], 8)], stagger={1: 0.02})
    assert [ev.token_ids for ev in out] == [r.token_ids for r in refs]
    assert sched.metrics.snapshot()["eagle3_prefill_seconds_count"] == 2


def test_a_cold_first_prefill_does_not_set_the_wait(stories260k):
    """The first measured prefill may be cold: it sets no wait until a second confirms it, and a fast second one
    replaces a slow first at once; slower prefills later raise the average slowly."""
    model, tok = stories260k
    sched = Scheduler(Target(model, []), tok, eos_token_ids(model, tok))
    sched._note_prefill(0.5)  # cold
    assert sched._prefill_ema is None
    sched._note_prefill(0.02)
    assert sched._prefill_ema == pytest.approx(0.02)
    sched._note_prefill(0.04)
    assert sched._prefill_ema == pytest.approx(0.024)


def test_admit_wait_and_stream_interval_are_checked():
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="admit_wait"):
            ServeConfig(admit_wait=bad)
    with pytest.raises(ConfigError, match="stream_interval"):
        ServeConfig(stream_interval=0)


def test_backend_decoding_only_for_the_stock_fast_tokenizer(stories260k):
    """The Rust-backend shortcut is taken for transformers' own fast tokenizer; a subclass that rewrites decoded
    text (as some model tokenizers do) keeps its own `decode`."""
    from eagle3.serving.output import _stock_decode

    _, tok = stories260k
    assert _stock_decode(tok)

    class Rewriting(type(tok)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).replace(" ", "_")

    assert not _stock_decode(object.__new__(Rewriting))


@pytest.mark.parametrize("interval", [1, 5])
def test_stream_interval_sends_fewer_chunks_of_the_same_text(stories, interval):
    model, tok, ids, _max, eos, _refs = stories
    sched = Scheduler(Target(copy.deepcopy(model), []), tok, eos, config=ServeConfig(stream_interval=interval))
    events, done = [], threading.Event()

    def sink(ev):
        events.append(ev)
        if ev.kind != "delta":
            done.set()

    sched.start()
    try:
        sched.submit(RequestHandle(GenParams(ids[3], 40, stream=True), sink))
        assert done.wait(30)
    finally:
        sched.stop(timeout=5)
    deltas, final = [e for e in events if e.kind == "delta"], events[-1]
    assert final.kind == "done" and len(final.token_ids) == 40
    assert "".join(e.text for e in deltas) == final.text  # nothing lost or repeated
    assert deltas[0].text  # the first chunk comes at once
    if interval == 1:
        assert len(deltas) >= 30
    else:
        assert len(deltas) <= 40 // interval + 2


# -- position-keyed sampling -------------------------------------------------------------------
def test_race_sampling_matches_the_target_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log()[None].expand(4000, -1)
    counts = torch.zeros(5)
    for seed in range(5):
        toks = race_sample(logits, torch.arange(4000) + 7 * seed, seed=seed, temperature=1.0)
        counts += torch.bincount(toks, minlength=5)
    freq = counts / counts.sum()
    # 20000 draws: each frequency's standard error is <= 0.0036; 5 sigma
    assert (freq - probs).abs().max() < 0.018, freq
    noise = exponential_noise(123, torch.arange(2000), 64)
    assert abs(float(noise.mean()) - 1.0) < 0.02 and abs(float(noise.var()) - 1.0) < 0.05
    top = race_sample(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([3]), seed=1, temperature=1.0, top_k=1)
    assert top.tolist() == [1]


def test_seeded_sampling_ignores_batch_and_speculation(stories):
    model, tok, ids, _max, eos, _refs = stories
    model = copy.deepcopy(model)
    d = init_drafter(model, seed=0)
    target = Target(model, d.config.aux_layer_ids)
    req = GenParams(ids[0], 30, temperature=0.9, top_p=0.95, seed=7)
    others = [GenParams(ids[i], 25, temperature=1.0, seed=i) for i in (1, 2, 4)]
    spec = SpecPolicy(SMALL_TREE, token_budget=1000)
    alone = run_batch(Scheduler(target, tok, eos), [req])[0]
    batched = run_batch(Scheduler(target, tok, eos, drafter=Eagle3BatchDrafter(d), policy=spec), [*others, req])[-1]
    assert alone.token_ids == batched.token_ids
    reseeded = run_batch(Scheduler(target, tok, eos), [GenParams(ids[0], 30, temperature=0.9, top_p=0.95, seed=8)])
    assert reseeded[0].token_ids != alone.token_ids


# -- the measured speed gate -------------------------------------------------------------------------
def test_speed_gate_runs_the_faster_mode_and_probes_the_other():
    gate = SpeedGate(probe_every=4, ema=1.0)
    assert gate.speculate(3)  # nothing measured: try speculation first
    gate.record(3, True, seconds=1.0, tokens=3)  # 1 token per row-second
    assert not gate.speculate(2)  # same bucket (2-3): plain is unmeasured, time it
    gate.record(2, False, seconds=0.5, tokens=2)  # 2 tokens per row-second: plain wins
    modes = [gate.speculate(3) for _ in range(8)]
    assert modes == [False, False, False, True] * 2  # plain, with one speculative probe every 4 cycles
    assert gate.speculate(4)  # another bucket starts over
    gate.record(3, True, seconds=1.0, tokens=9)  # speculation got better: 3 tokens per row-second
    assert gate.rates(2) == (3.0, 2.0)
    assert [gate.speculate(3) for _ in range(4)] == [True, True, True, False]
    assert gate.snapshot() == {"b2_q4": {"spec": 3.0, "plain": 2.0, "spec_ms": 1000.0, "plain_ms": 500.0,
                                         "probe_every": 4}}


def test_speed_gate_learns_separately_by_the_share_of_rows_drafting():
    gate = SpeedGate(probe_every=4, ema=1.0)
    assert gate.bucket(16) == gate.bucket(16, drafting=16) == (5, 4, False)
    assert gate.bucket(16, drafting=4) == (5, 1, False) and gate.bucket(16, drafting=5) == (5, 2, False)
    # all 16 rows draft: speculation wins; 3 of 16 draft: every row pays the speculative cycle, plain wins
    for drafting, spec_tokens in ((16, 40), (3, 20)):
        assert gate.speculate(16, drafting=drafting)  # each share bucket tries speculation first
        gate.record(16, True, seconds=1.0, tokens=spec_tokens, drafting=drafting)
        assert not gate.speculate(16, drafting=drafting)
        gate.record(16, False, seconds=1.0, tokens=32, drafting=drafting)
    assert gate.rates(16, drafting=16) == (2.5, 2.0) and gate.rates(16, drafting=2) == (1.25, 2.0)
    assert gate.speculate(16, drafting=16) and not gate.speculate(16, drafting=3)
    assert gate.speculate(17, drafting=17)  # 16-31 rows share a batch bucket: as measured at 16 of 16
    assert gate.speculate(32)  # a new batch bucket starts over


def test_speed_gate_measures_sampled_cycles_apart():
    """Greedy cycles that speculate well say nothing about sampled ones: a sampled bucket starts over, and
    speculation that loses there is switched off there only."""
    gate = SpeedGate(probe_every=4, ema=1.0)
    gate.record(1, True, seconds=1.0, tokens=3)
    gate.record(1, False, seconds=1.0, tokens=1)  # greedy: speculation 3x
    assert gate.speculate(1) and gate.speculate(1, sampled=True)  # sampled: nothing measured, try it first
    gate.record(1, True, seconds=1.0, tokens=1, sampled=True)
    assert not gate.speculate(1, sampled=True)  # sampled plain is unmeasured: time it
    gate.record(1, False, seconds=0.5, tokens=1, sampled=True)  # 2 tokens per second: plain wins there
    assert [gate.speculate(1, sampled=True) for _ in range(3)] == [False] * 3
    assert gate.speculate(1)  # greedy keeps speculating
    assert gate.rates(1) == (3.0, 1.0) and gate.rates(1, sampled=True) == (1.0, 2.0)
    assert set(gate.snapshot()) == {"b1_q4", "b1_q4_sampled"}


def test_speed_gate_probes_less_often_while_the_choice_holds():
    gate = SpeedGate(probe_every=4, ema=1.0, max_probe_every=16)
    gate.record(1, True, seconds=1.0, tokens=1)  # speculation: 1 token per row-second
    gate.record(1, False, seconds=1.0, tokens=2)  # plain: 2, so plain runs and speculation is probed

    def cycles(n: int, spec_rate: float = 1.0) -> list[bool]:
        modes = []
        for _ in range(n):
            m = gate.speculate(1)
            gate.record(1, m, seconds=1.0, tokens=spec_rate if m else 2)
            modes.append(m)
        return modes

    modes = cycles(4 + 8 + 16 + 16)  # each confirming probe doubles the interval, up to 16
    assert [i for i, m in enumerate(modes) if m] == [3, 11, 27, 43]
    assert gate.interval(1) == 16
    modes = cycles(16, spec_rate=3.0)  # speculation got better: the next probe overturns the choice
    assert modes[-1] and gate.rates(1) == (3.0, 2.0)
    assert gate.interval(1) == 4  # and the interval starts over
    assert cycles(3, spec_rate=3.0) == [True, True, True]


def test_speed_gate_does_not_measure_the_cycle_after_a_switch():
    """settle=1: the first cycle of each mode after the other (it carries the switch) is not measured, so a
    probe runs two cycles and is judged by its second; a slow first cycle after every switch does not make the
    probed mode look slower."""
    gate = SpeedGate(probe_every=4, ema=1.0, settle=1)
    times = {True: 1.0, False: 1.0}

    def cycles(n: int) -> list[bool]:
        modes = []
        for _ in range(n):
            m = gate.speculate(1)
            switched = bool(modes) and m != modes[-1]
            # each mode emits 2 (spec) or 1 token per second, but the cycle after a switch takes 4x as long
            gate.record(1, m, seconds=4 * times[m] if switched else times[m], tokens=2 if m else 1)
            modes.append(m)
        return modes

    modes = cycles(4)
    assert modes == [True, True, False, False]  # try each mode, measured from its second cycle on
    assert gate.rates(1) == (2.0, 1.0)
    modes = cycles(10)  # speculation wins; the probes of plain cycles take 2 cycles, judged by the second
    assert modes == [True] * 3 + [False, False] + [True] * 5
    assert gate.rates(1) == (2.0, 1.0) and gate.interval(1) == 8  # the slow switch cycles were never measured
    bare = SpeedGate(probe_every=4, ema=1.0)  # without settling, the same switch cycles drag plain's rate down
    bare.record(1, True, 1.0, 2)
    bare.record(1, False, 4.0, 1)
    assert bare.rates(1) == (2.0, 0.25)


def test_speed_gate_margin_and_affordable_probes():
    """margin: speculation must win by that fraction; probe_share: a probe of a mode that is much slower per
    cycle waits until it costs at most that share of the time."""
    gate = SpeedGate(probe_every=4, ema=1.0, margin=0.05)
    gate.record(1, True, seconds=1.0, tokens=104)
    gate.record(1, False, seconds=1.0, tokens=100)
    assert not gate.speculate(1)  # 4 % faster is within the margin: plain
    gate.record(1, True, seconds=1.0, tokens=106)
    assert gate.speculate(1)
    gate = SpeedGate(probe_every=4, ema=1.0, probe_share=0.05)
    gate.record(1, True, seconds=30.0, tokens=60)  # 2 tokens per second, each cycle 30x a plain one
    gate.record(1, False, seconds=1.0, tokens=8)  # 8 tokens per second
    # a probe loses 30 s x (1 - 2/8) = 22.5 s of output; at 5 % of 1 s cycles that is one per 450 cycles
    assert gate.interval(1) == 450
    modes = [gate.speculate(1) for _ in range(450)]
    assert modes.count(True) == 1 and modes[-1]


def _noisy_cycles(gate: SpeedGate, accept: float, n: int = 1000, seed: int = 0) -> tuple[float, float]:
    """n cycles of one row: a speculative cycle takes 1.9 s and emits 1-7 tokens (each next draft accepted with
    probability `accept`), a plain one takes 1 s for 1 token. Returns (share of speculative cycles, tokens/s)."""
    rng = random.Random(seed)
    spec_cycles, tokens, seconds = 0, 0, 0.0
    for _ in range(n):
        spec = gate.speculate(1)
        t = 1
        while spec and t < 7 and rng.random() < accept:
            t += 1
        s = (1.9 if spec else 1.0) * (1 + 0.02 * rng.random())
        gate.record(1, spec, s, t)
        spec_cycles, tokens, seconds = spec_cycles + spec, tokens + t, seconds + s
    return spec_cycles / n, tokens / seconds


def test_speed_gate_tells_a_noisy_win_from_a_loss():
    """Speculative cycles emit 1 to 7 tokens: the serving gate (decayed sums, 4-cycle probes, an interval that
    grows only on a clear verdict) runs speculation where it gives 1.6x and costs at most a few percent where
    it loses 27 %; the bare rules (single-cycle probes, a fast-fading average) mostly miss the win."""
    wins = [_noisy_cycles(SpecPolicy().speed_gate(), 0.7, seed=s) for s in range(8)]
    bare = [_noisy_cycles(SpeedGate(16, 0.25, 512), 0.7, seed=s) for s in range(8)]
    assert min(f for f, _ in wins) > 0.7 and sum(f for f, _ in wins) / 8 > 0.85 and min(r for _, r in wins) > 1.45
    assert sum(f for f, _ in bare) / 8 < 0.6 and sum(r for _, r in bare) < sum(r for _, r in wins) - 0.8
    losses = [_noisy_cycles(SpecPolicy().speed_gate(), 0.3, seed=s) for s in range(8)]
    assert max(f for f, _ in losses) < 0.1 and min(r for _, r in losses) > 0.95


class _Alternating(SpeedGate):
    """Speculate on every other cycle, whatever was measured."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def speculate(self, batch_size: int, drafting: int | None = None, sampled: bool = False) -> bool:
        self.calls += 1
        return self.calls % 2 == 1


def test_paused_cycles_keep_the_drafter_current():
    """Plain cycles chosen by the gate still extend every drafting row: a drafter scripted to be right twice
    per cycle stays right after each pause (a stale history would make every draft wrong)."""
    model = build_tiny_target("llama")
    prompts = tiny_prompts(3, seed=5)
    prompts = [prompts[0], prompts[2], prompts[1][:12]]
    max_tokens = [40, 31, 36]
    refs = reference(model, None, prompts, max_tokens, eos=[])
    by_prompt = {tuple(p): r.token_ids for p, r in zip(prompts, refs, strict=True)}

    def factory(prompt):
        return ScriptedProposer(by_prompt[tuple(prompt)], k=2, length=4, vocab_size=300)

    policy = SpecPolicy(DraftShape(4, 1, 4), token_budget=1000)
    sched = Scheduler(Target(model, []), None, [], drafter=ProposerBatchDrafter(factory), policy=policy)
    sched._batches[-1].gate = _Alternating()
    out = run_batch(sched, [GenParams(p, n) for p, n in zip(prompts, max_tokens, strict=True)])
    for i, (ev, ref) in enumerate(zip(out, refs, strict=True)):
        assert ev.token_ids == ref.token_ids, f"row {i}"
    snap = sched.metrics.snapshot()
    assert snap["eagle3_spec_paused_cycles_total"] >= 5
    steps, accepted = snap["eagle3_spec_row_steps_total"], snap["eagle3_accepted_tokens_total"]
    assert accepted >= 2 * steps - 2 * len(prompts)  # 2 per row-cycle; the last cycle of a row may be cut short


def test_gate_turns_a_losing_drafter_off(stories):
    """A drafter that is never right: the gate measures plain cycles
    faster and runs mostly those; the answer is unchanged."""
    model, tok, ids, _max_tokens, eos, refs = stories
    model = copy.deepcopy(model)
    d = init_drafter(model, seed=0)
    policy = SpecPolicy(SMALL_TREE, token_budget=1000, probe_every=8)
    sched = Scheduler(Target(model, d.config.aux_layer_ids), tok, eos, drafter=Eagle3BatchDrafter(d), policy=policy)
    out = run_batch(sched, [GenParams(ids[3], 40)])
    assert out[0].token_ids == refs[3].token_ids
    snap = sched.metrics.snapshot()
    assert snap["eagle3_spec_paused_cycles_total"] > snap["eagle3_spec_row_steps_total"]


@pytest.mark.parametrize("window", [3, 32])
def test_plain_cycles_hold_the_drafter_input_back_and_feed_it(window):
    """`HFRows`: plain cycles hold each row's new tokens back for the drafter and feed them in one extension once
    `feed_window` are held or before the next speculative cycle, so a drafter scripted to be right twice per cycle
    is right in every speculative cycle after a run of plain ones (a lost token would make every draft wrong)."""
    from eagle3.attention import shapes_vary
    from eagle3.decoding.hf_rows import HFRows

    model = build_tiny_target("llama")
    prompts = tiny_prompts(2, seed=7)
    refs = reference(model, None, prompts, [60, 60], eos=[])
    by_prompt = {tuple(p): r.token_ids for p, r in zip(prompts, refs, strict=True)}
    drafter = ProposerBatchDrafter(lambda p: ScriptedProposer(by_prompt[tuple(p)], k=2, length=4, vocab_size=300))
    fed, extend = [], drafter.extend
    drafter.extend = lambda aux, toks, counts: (fed.append(list(counts)), seen.append(shapes_vary()),
                                                extend(aux, toks, counts))[1]
    seen, propose = [], drafter.propose
    drafter.propose = lambda *a: (seen.append(shapes_vary()), propose(*a))[1]
    rows = HFRows(Target(model, []), drafter, 4, shapes=lambda n: DraftShape.chain(4), feed_window=window)
    out = [[t] for t in rows.add_many(prompts)]
    for cycle in range(15):
        spec = cycle % 5 == 4  # four plain cycles, then a speculative one
        new = rows.cycle(spec)
        assert [len(t) for t in new] == ([3, 3] if spec else [1, 1]), f"cycle {cycle}"
        for o, t in zip(out, new, strict=True):
            o.extend(t)
    for o, r in zip(out, refs, strict=True):
        assert o == r.token_ids[: len(o)]
    # per run of four plain cycles: a feed of the held tokens (after three with a window of 3), then the rest
    # and the speculative cycle's accepted path
    run = [[3, 3], [1, 1], [3, 3]] if window == 3 else [[4, 4], [3, 3]]
    assert fed == run * 3
    # the drafter's forwards change shape every cycle too: no cuDNN attention plans (one per shape) for them
    assert seen and all(seen)


@pytest.mark.parametrize("which", ["stories260k", "smollm2"])
def test_incremental_text_equals_a_full_decode(which, request):
    """Streamed text is decoded in windows (`Scheduler._stable_text`); fed 1-3 tokens at a time, its pieces add
    up to the full decode whenever that ends in a complete character, for a SentencePiece tokenizer that
    drops leading spaces (stories260K) and a byte-level BPE one with multi-byte characters (SmolLM2)."""
    model, tok = request.getfixturevalue(which)
    sched = Scheduler(Target(copy.deepcopy(model), []), tok, [])
    assert sched._incremental
    text = "Héllo wörld, naïve café! 😀 Done. 日本語のテキスト and  two  spaces\nnew line."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    row = _Row(RequestHandle(GenParams(prompt_ids=[1], max_tokens=len(ids)), lambda ev: None))
    g = torch.Generator().manual_seed(0)
    i = 0
    while i < len(ids):
        i += int(torch.randint(1, 4, (1,), generator=g))
        row.out = ids[:i]
        stable = sched._stable_text(row)
        full = tok.decode(row.out, skip_special_tokens=True)
        assert full.startswith(stable)
        if not full.endswith("\ufffd"):
            assert stable == full
    assert sched._stable_text(row) == tok.decode(ids, skip_special_tokens=True)
