"""The server's HF rows (`eagle3.decoding.hf_rows`: any AutoModelForCausalLM, a padded `DynamicCache`, 4-D tree
masks) on a Gemma-3 target (sliding-window layers) and a Qwen3-MoE target (per-token expert routing): 16
concurrent greedy clients, speculation on, each answer equal token for token to the single-request answer.

Per architecture the reference is each prompt alone through `SpeculativeEngine` with plain decoding; each prompt
alone through the scheduler (speculating) must give the same tokens, and so must 16 clients submitting at once
(a few arriving while the others decode), with drafters that are right a different number of times per row
(scripted chains and trees: ragged acceptance in one batch) or a random EAGLE-3 drafter (the batched drafter and
the target's aux features). Every Gemma-3 prompt + answer is longer than its 16-position sliding window.
CPU, fp32. Run: pytest tests/test_serving_families.py
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from conftest import TINY_SLIDING_WINDOW, build_tiny_target
from doubles import ScriptedProposer
from eagle3.config import DraftShape
from eagle3.decoding.drafters import Eagle3BatchDrafter, ProposerBatchDrafter
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.runtime import init_drafter
from eagle3.serving.config import ServeConfig
from eagle3.serving.policy import SpecPolicy
from eagle3.serving.requests import GenParams
from eagle3.serving.server import build_scheduler
from eagle3.target import Target
from test_batching import run_one

CLIENTS = 16
LATE = 4  # the last LATE clients arrive while the others decode (rows join a running batch)
SHAPE = DraftShape(4, 2, 8)


@pytest.fixture(scope="module", params=["gemma3_text", "qwen3_moe"])
def family(request):
    """(arch, model, prompts, max_tokens, reference answers) with the references from the bs=1 plain engine."""
    arch = request.param
    model = build_tiny_target(arch)
    if arch == "gemma3_text":
        assert model.config.sliding_window == TINY_SLIDING_WINDOW
        assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    g = torch.Generator().manual_seed(11)
    lens = [3 + (7 * i) % 29 for i in range(CLIENTS)]  # 3..31 tokens: some past the window already
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens]
    max_tokens = [24 + (5 * i) % 25 for i in range(CLIENTS)]  # 24..48
    target = Target(model, [])
    try:
        engine = SpeculativeEngine(target, NoDraftProposer(), None)
        refs = [engine.generate(p, max_new_tokens=n, eos_token_ids=[]).token_ids
                for p, n in zip(prompts, max_tokens, strict=True)]
    finally:
        target.close()
    for p, r, n in zip(prompts, refs, max_tokens, strict=True):
        assert len(r) == n and len(set(r)) > 4  # varied greedy output, not one repeated token
        assert len(p) + n > TINY_SLIDING_WINDOW
    return arch, model, prompts, max_tokens, refs


def _scheduler(model, prompts, refs, drafter_kind: str):
    """A scheduler speculating with `drafter_kind` on every row, whatever it accepts (the gate and the
    acceptance floor off, so every cycle verifies trees)."""
    if drafter_kind == "eagle3":
        d = init_drafter(model, draft_vocab_size=200, seed=1)
        drafter, aux = Eagle3BatchDrafter(d), d.config.aux_layer_ids
    else:
        # right k = 0..4 times a cycle, k by prompt: rows of one batch accept different amounts
        by_prompt = {tuple(p): (r, i % 5) for i, (p, r) in enumerate(zip(prompts, refs, strict=True))}

        def factory(prompt):
            ref, k = by_prompt[tuple(prompt)]
            return ScriptedProposer(ref, k=k, length=4, vocab_size=300, tree=drafter_kind == "tree")

        drafter, aux = ProposerBatchDrafter(factory), []
    policy = SpecPolicy(SHAPE, token_budget=1000, measure=False)
    return build_scheduler(Target(model, aux), None, [], drafter=drafter, policy=policy,
                           config=ServeConfig(max_batch_size=CLIENTS))


@pytest.mark.parametrize("drafter_kind", ["chain", "tree", "eagle3"])
def test_concurrent_greedy_clients_equal_single_requests(family, drafter_kind):
    arch, model, prompts, max_tokens, refs = family
    sched = _scheduler(model, prompts, refs, drafter_kind)
    assert sched.fast_rows is None  # the generic path only
    assert next(model.parameters()).dtype == torch.float32
    sched.start()
    try:
        # each prompt alone through this scheduler (speculating): the single-request answer
        for i, (p, n, ref) in enumerate(zip(prompts, max_tokens, refs, strict=True)):
            ev = run_one(sched, GenParams(p, n))
            assert ev.kind == "done" and ev.finish_reason == "length", ev.text
            assert ev.token_ids == ref, f"{arch} {drafter_kind}: prompt {i} alone"
        alone = sched.cycles_traced
        assert max(sched.cycle_trace()["rows"]) == 1

        # 16 clients at once; the last LATE arrive once the others have started decoding
        out: dict[int, object] = {}
        errors: list[BaseException] = []
        start = threading.Barrier(CLIENTS - LATE)

        def client(i: int) -> None:
            try:
                if i < CLIENTS - LATE:
                    start.wait()
                else:
                    deadline = time.monotonic() + 30
                    while sched.cycles_traced < alone + 2 * (i - CLIENTS + LATE + 1) and time.monotonic() < deadline:
                        time.sleep(0.001)
                out[i] = run_one(sched, GenParams(prompts[i], max_tokens[i]))
            except BaseException as e:  # reported below, in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        assert sched.error is None
    finally:
        sched.stop(timeout=5)
    for i, ref in enumerate(refs):
        ev = out[i]
        assert ev.kind == "done" and ev.finish_reason == "length", ev.text
        assert ev.token_ids == ref, f"{arch} {drafter_kind}: client {i} in the batch"

    trace = sched.cycle_trace(since=alone)
    rows = trace["rows"]
    assert all(p == "batch" for p in trace["path"])
    # the burst shared cycles (12 rows from the first cycle in a quiet run; a loaded machine may spread the
    # first arrivals over a few cycles), and late rows joined a running batch
    assert max(rows) >= CLIENTS // 2 and sum(rows) / len(rows) > 3, rows
    assert any(b > a > 1 for a, b in itertools.pairwise(rows)), rows
    assert all(trace["spec"]), "every cycle verified drafts"
    snap = sched.metrics.snapshot()
    assert snap["eagle3_draft_tokens_total"] > 0
    if drafter_kind != "eagle3":  # scripted rows accept 0-4 drafts a cycle
        assert snap["eagle3_accepted_tokens_total"] > snap["eagle3_spec_row_steps_total"]
