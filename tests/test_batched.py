"""`eagle3.fast.batched.BatchedGenerator` (continuous-batching plain decoding) and the regenerate backend on it."""

from __future__ import annotations

import pytest
import torch

from eagle3.config import ConfigError, SamplingConfig
from eagle3.fast.batched import BatchedGenerator
from eagle3.fast.engine import FastEngine

FAST_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]


@torch.inference_mode()
def _greedy(model, prompt: list[int], n: int, stops: set[int]) -> tuple[list[int], str]:
    ids, out = list(prompt), []
    for _ in range(n):
        tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if tok in stops:
            return out, "stop"
        out.append(tok)
        ids.append(tok)
    return out, "length"


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", FAST_ARCHS)
def test_greedy_equals_plain_decoding_with_refills(tiny_target, arch):
    """7 prompts of different lengths through 3 rows: rows are refilled mid-run; every answer is plain greedy."""
    model = tiny_target(arch)
    prompts = _prompts(model.config.vocab_size, [5, 17, 3, 30, 9, 12, 1])
    budgets = 11
    gen = BatchedGenerator(model, rows=3, max_seq_len=48, prefill_tokens=40)
    outs = gen.generate(prompts, max_new_tokens=budgets, eos_token_ids=[])
    for p, o in zip(prompts, outs, strict=True):
        assert (o.tokens, o.finish_reason) == _greedy(model, p, budgets, set())


def test_stops_at_eos_and_on_the_first_token(tiny_target):
    model = tiny_target("llama")
    prompts = _prompts(model.config.vocab_size, [6, 8, 4, 10], seed=1)
    plain = [_greedy(model, p, 9, set())[0] for p in prompts]
    # stop on the 4th token of answer 0 and on the 1st token of answer 1
    stops = {plain[0][3], plain[1][0]}
    gen = BatchedGenerator(model, rows=2, max_seq_len=32)
    outs = gen.generate(prompts, max_new_tokens=9, eos_token_ids=sorted(stops))
    for p, o in zip(prompts, outs, strict=True):
        assert (o.tokens, o.finish_reason) == _greedy(model, p, 9, stops)
    assert outs[1].tokens == [] and outs[1].finish_reason == "stop"
    one = gen.generate(prompts[2:], max_new_tokens=1, eos_token_ids=[])
    assert [(o.tokens, o.finish_reason) for o in one] == [(pl[:1], "length") for pl in plain[2:]]


def test_sampling_is_seeded_and_cold_temperature_is_greedy(tiny_target):
    model = tiny_target("qwen3")
    prompts = _prompts(model.config.vocab_size, [4, 7, 9])
    gen = BatchedGenerator(model, rows=2, max_seq_len=32)
    greedy = gen.generate(prompts, max_new_tokens=8, eos_token_ids=[])
    cold = gen.generate(prompts, max_new_tokens=8, eos_token_ids=[], temperature=1e-4)
    assert [o.tokens for o in cold] == [o.tokens for o in greedy]
    torch.manual_seed(3)
    a = gen.generate(prompts, max_new_tokens=8, eos_token_ids=[], temperature=1.5)
    torch.manual_seed(3)
    b = gen.generate(prompts, max_new_tokens=8, eos_token_ids=[], temperature=1.5)
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.tokens for o in a] != [o.tokens for o in greedy]  # a hot random model does not stay greedy


def test_sampled_answers_are_the_one_samplers_draws(tiny_target):
    """Prompt i with `seed` s samples what any engine samples for it with seed s + i (`eagle3.decoding.sampling`):
    the same text as `FastEngine` decoding it alone, whatever rows it shares a cycle with."""
    model = tiny_target("llama")
    prompts = _prompts(model.config.vocab_size, [4, 11, 6])
    gen = BatchedGenerator(model, rows=2, max_seq_len=32)
    outs = gen.generate(prompts, max_new_tokens=8, eos_token_ids=[], temperature=0.9, seed=40)
    alone = FastEngine(model)
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        ref = alone.generate(p, max_new_tokens=8, sampling=SamplingConfig(temperature=0.9, seed=40 + i))
        assert o.tokens == ref.token_ids
    other = gen.generate(prompts, max_new_tokens=8, eos_token_ids=[], temperature=0.9, seed=41)
    assert [o.tokens for o in other] != [o.tokens for o in outs]  # the seed matters


def test_sampling_follows_the_softmax(tiny_target):
    """The first sampled token of one prompt, 600 draws: frequencies match softmax(logits / T) (chi-square)."""
    model = tiny_target("llama", vocab_size=8)
    prompt = [1, 2, 3]
    with torch.inference_mode():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / 0.7, -1)
    gen = BatchedGenerator(model, rows=50, max_seq_len=8)
    torch.manual_seed(0)
    draws = []
    for _ in range(12):
        draws += [o.tokens[0] for o in gen.generate([prompt] * 50, 1, [], temperature=0.7)]
    counts = torch.bincount(torch.tensor(draws), minlength=8).double()
    expected = probs.double() * len(draws)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


def test_bad_inputs_are_refused(tiny_target):
    model = tiny_target("llama")
    gen = BatchedGenerator(model, rows=2, max_seq_len=16)
    with pytest.raises(ConfigError, match="prompt 1 has 14 tokens"):
        gen.generate([[5, 6], [7] * 14], max_new_tokens=4, eos_token_ids=[])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        gen.generate([[5]], max_new_tokens=0, eos_token_ids=[])
    with pytest.raises(ConfigError, match="fast path"):
        BatchedGenerator(tiny_target("gemma3_text"), rows=2, max_seq_len=16)
