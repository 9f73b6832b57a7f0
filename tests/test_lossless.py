"""Speculative decoding emits exactly what plain decoding emits (fp32, CPU): greedy output equals HF
`generate(do_sample=False)` token for token, and sampled output equals plain sampling with the same seed.

Three kinds of drafter on every supported architecture and on the real stories260K: the target drafting for
itself (always right), a random EAGLE-3 drafter (almost never right), and a scripted drafter right exactly
k times per cycle (partial acceptance and cache compaction). Chains and trees; short and long prompts (the
long one passes Gemma-3's sliding window); max_new_tokens reached mid-cycle; EOS inside an accepted run. (That the
sampled tokens follow the target's distribution is tests/test_sampling_stats.py.)
Run: pytest tests/test_lossless.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, TINY_SLIDING_WINDOW, build_tiny_target
from doubles import proposer
from eagle3.config import SamplingConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import ModelProposer, NgramProposer, NoDraftProposer
from eagle3.runtime import eos_token_ids, init_drafter
from eagle3.target import Target

NEW = 24
PROMPTS = {"short": 5, "long": TINY_SLIDING_WINDOW * 2 + 3}


def hf_greedy(model, prompt: torch.Tensor, max_new: int, eos=None) -> list[int]:
    kw = {} if eos is None else {"eos_token_id": eos}
    out = model.generate(prompt[None], max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kw)
    return out[0, prompt.numel():].tolist()


def random_prompt(n: int, seed: int, vocab: int = 300) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


@pytest.fixture(scope="module")
def models():
    return {a: build_tiny_target(a) for a in ARCHS}




@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt_kind", list(PROMPTS))
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "random", "scripted-0", "scripted-2"])
def test_greedy_matches_hf_generate(models, arch, prompt_kind, mode, kind):
    model = models[arch]
    prompt = random_prompt(PROMPTS[prompt_kind], seed=len(arch))
    ref = hf_greedy(model, prompt, NEW)
    drafter_aux = init_drafter(model, seed=1).config.aux_layer_ids
    target = Target(model, drafter_aux)
    try:
        prop = proposer(model, kind, mode, ref, model.config.vocab_size)
        res = SpeculativeEngine(target, prop).generate(prompt, max_new_tokens=NEW,
                                                       eos_token_ids=eos_token_ids(model, None))
    finally:
        target.close()
    assert res.token_ids == ref
    if kind == "self":
        assert res.stats.tau > 2.5, "an always-right drafter must be accepted"
    if kind.startswith("scripted"):
        k = int(kind.split("-")[1])
        # every full cycle accepts exactly k drafts (the last cycle may stop early at max_new_tokens)
        assert all(a == k for a in res.stats.accepted_per_cycle[:-1])


SAMPLED = SamplingConfig(temperature=0.9, top_p=0.95, top_k=50, seed=7)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "random", "scripted-2"])
def test_sampled_equals_plain_sampling_with_the_same_seed(models, arch, mode, kind):
    model = models[arch]
    prompt = random_prompt(PROMPTS["long"], seed=len(arch) + 1)
    target = Target(model, init_drafter(model, seed=1).config.aux_layer_ids)
    try:
        plain = SpeculativeEngine(target, NoDraftProposer()).generate(prompt, max_new_tokens=NEW, sampling=SAMPLED)
        greedy = SpeculativeEngine(target, NoDraftProposer()).generate(prompt, max_new_tokens=NEW)
        prop = proposer(model, kind, mode, plain.token_ids, model.config.vocab_size)
        res = SpeculativeEngine(target, prop).generate(prompt, max_new_tokens=NEW, sampling=SAMPLED)
    finally:
        target.close()
    assert plain.token_ids != greedy.token_ids  # the sampled run does sample
    assert res.token_ids == plain.token_ids
    if kind.startswith("scripted"):  # drafts that are right twice a cycle are accepted twice a cycle
        assert all(a == 2 for a in res.stats.accepted_per_cycle[:-1])


@pytest.mark.parametrize("kind", ["none", "ngram"])
def test_other_drafters_match(models, kind):
    model = models["llama"]
    prompt = torch.cat([random_prompt(6, 3)] * 3)  # repeats, so prompt lookup finds matches
    ref = hf_greedy(model, prompt, NEW)
    target = Target(model, [])
    prop = NoDraftProposer() if kind == "none" else NgramProposer(4)
    res = SpeculativeEngine(target, prop).generate(prompt, max_new_tokens=NEW, eos_token_ids=[2])
    target.close()
    assert res.token_ids == ref
    if kind == "none":
        assert res.stats.cycles == NEW - 1 and res.stats.tau == 1.0


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_max_new_tokens_mid_cycle(models, mode):
    model = models["qwen3"]
    prompt = random_prompt(7, 11)
    ref = hf_greedy(model, prompt, 40)
    target = Target(model, [])
    for n in (1, 2, 6, 7, 13):  # with an always-right chain of 4, cycles emit 5: these stop mid-cycle
        prop = proposer(model, "self", mode, ref)
        res = SpeculativeEngine(target, prop).generate(prompt, max_new_tokens=n, eos_token_ids=[2])
        assert res.token_ids == ref[:n] and res.finish_reason == "length"
    target.close()


def test_eos_inside_accepted_run(models):
    model = models["llama"]
    prompt = random_prompt(9, 5)
    ref = hf_greedy(model, prompt, 30)
    eos = ref[7]  # declare the 8th greedy token EOS: an always-right chain of 4 accepts it mid-run
    ref_eos = hf_greedy(model, prompt, 30, eos=eos)
    assert ref_eos[-1] == eos and len(ref_eos) <= 8
    target = Target(model, [])
    res = SpeculativeEngine(target, ModelProposer(model, 4)).generate(prompt, max_new_tokens=30, eos_token_ids=[eos])
    target.close()
    assert res.token_ids == ref_eos and res.finish_reason == "stop"


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "random", "scripted-1"])
def test_stories260k(stories260k, mode, kind):
    model, tok = stories260k
    prompt = torch.tensor(tok("Once upon a time", add_special_tokens=True)["input_ids"])
    ref = hf_greedy(model, prompt, 60)
    d = init_drafter(model, seed=2)
    target = Target(model, d.config.aux_layer_ids)
    prop = proposer(model, kind, mode, ref, model.config.vocab_size)
    res = SpeculativeEngine(target, prop, tok).generate(prompt, max_new_tokens=60,
                                                        eos_token_ids=eos_token_ids(model, tok))
    target.close()
    assert res.token_ids == ref
    assert res.text == tok.decode(ref, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "random"])
def test_smollm2_chat(smollm2, mode, kind):
    from eagle3.runtime import encode_prompt

    model, tok = smollm2
    prompt = torch.tensor(encode_prompt(tok, chat="Write a haiku about the sea."))
    eos = eos_token_ids(model, tok)
    ref = hf_greedy(model, prompt, 48, eos=eos)
    d = init_drafter(model, draft_vocab_size=4096, seed=3)
    target = Target(model, d.config.aux_layer_ids)
    prop = proposer(model, kind, mode, ref, model.config.vocab_size)
    res = SpeculativeEngine(target, prop, tok).generate(prompt, max_new_tokens=48, eos_token_ids=eos)
    target.close()
    assert res.token_ids == ref
