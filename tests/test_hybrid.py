"""Hybrid linear-attention targets (Qwen3-Next): lossless chains, refused trees, refused batched serving.

A tiny seeded random Qwen3-Next (fp32, hidden 64, vocab 300): 4 layers alternating Gated DeltaNet linear attention
(conv + recurrent state) and full attention, MoE after the first layer. Greedy chain drafting equals HF
`generate(do_sample=False)` for drafters that are always right, almost never right and right exactly k times a cycle
(the recurrent state must roll back to the last accepted token: `eagle3.target.RecurrentCache`); plain decoding does
too; sampled output equals plain sampling with the same seed. Trees, the batched server and the fast path are
refused with a ConfigError (with no shape given, a chain is drafted); `load_target`, `init-drafter` and `load_runtime` take the family.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from doubles import ScriptedProposer, SelfTreeProposer
from eagle3.config import ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import ModelProposer, NoDraftProposer
from eagle3.runtime import init_drafter
from eagle3.target import RecurrentCache, Target

NEW = 20
PROMPTS = (3, 21)  # shorter than the conv kernel (4), and longer than a few cycles
CONFIG = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.3, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    mlp_only_layers=[0],
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(31)
    m = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**CONFIG)).to(torch.float32).eval()
    m.requires_grad_(False)
    return m


def prompt_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


def hf_greedy(model, prompt: torch.Tensor, new: int = NEW) -> list[int]:
    return model.generate(prompt[None], max_new_tokens=new, do_sample=False, pad_token_id=0)[0, prompt.numel():].tolist()


def chain_proposer(model, kind: str, reference: list[int]):
    if kind == "self":
        return ModelProposer(model, 4)
    if kind == "random":
        return Eagle3Proposer(init_drafter(model, draft_vocab_size=200, seed=1), DraftShape.chain(4))
    return ScriptedProposer(reference, k=int(kind.split("-")[1]), length=4, vocab_size=300)


def run(model, proposer, prompt, aux=True, **kw):
    target = Target(model, init_drafter(model, seed=1).config.aux_layer_ids if aux else [])
    try:
        return SpeculativeEngine(target, proposer).generate(prompt, eos_token_ids=[2], **kw)
    finally:
        target.close()


def test_hybrid_target_shape(model):
    target = Target(model, [1, 2, 3])
    assert target.recurrent_layers == [0, 2]
    cache = target.new_cache()
    assert isinstance(cache, RecurrentCache)
    target.forward(prompt_of(5, 0)[None], cache)
    assert cache.get_seq_length() == 5  # an int read from an attention layer, though layer 0 is linear
    target.close()


@pytest.mark.parametrize("n", PROMPTS)
@pytest.mark.parametrize("kind", ["self", "random", "scripted-0", "scripted-2"])
def test_greedy_chain_matches_hf_generate(model, n, kind):
    prompt = prompt_of(n, seed=n)
    ref = hf_greedy(model, prompt)
    res = run(model, chain_proposer(model, kind, ref), prompt, max_new_tokens=NEW)
    assert res.token_ids == ref
    if kind == "self":
        assert res.stats.tau > 2.5
    if kind.startswith("scripted"):  # partial acceptance: the recurrent state rolls back every cycle
        assert all(a == int(kind[-1]) for a in res.stats.accepted_per_cycle[:-1])


def test_plain_decoding_matches_hf_generate(model):
    prompt = prompt_of(PROMPTS[1], seed=2)
    res = run(model, NoDraftProposer(), prompt, aux=False, max_new_tokens=NEW)
    assert res.token_ids == hf_greedy(model, prompt) and res.stats.tau == 1.0


def test_max_new_tokens_mid_cycle(model):
    prompt = prompt_of(7, seed=11)
    ref = hf_greedy(model, prompt, 13)
    for n in (1, 2, 6, 7, 13):  # an always-right chain of 4 emits 5 a cycle: these stop mid-cycle
        res = run(model, ModelProposer(model, 4), prompt, aux=False, max_new_tokens=n)
        assert res.token_ids == ref[:n] and res.finish_reason == "length"


def test_rollback_is_what_keeps_it_lossless(model, monkeypatch):
    """Without rewinding the linear layers to the last accepted token, rejected drafts leak into later tokens."""
    prompt = prompt_of(PROMPTS[1], seed=PROMPTS[1])
    ref = hf_greedy(model, prompt)
    keep = RecurrentCache.rewind
    monkeypatch.setattr(RecurrentCache, "rewind", lambda self, tokens: keep(self, 0))
    res = run(model, ScriptedProposer(ref, k=2, length=4, vocab_size=300), prompt, max_new_tokens=NEW)
    assert res.token_ids != ref


SAMPLED = SamplingConfig(temperature=0.9, top_p=0.95, top_k=50, seed=7)


@pytest.mark.parametrize("kind", ["self", "random", "scripted-2"])
def test_sampled_equals_plain_sampling_with_the_same_seed(model, kind):
    prompt = prompt_of(PROMPTS[1], seed=5)
    plain = run(model, NoDraftProposer(), prompt, max_new_tokens=NEW, sampling=SAMPLED)
    greedy = run(model, NoDraftProposer(), prompt, max_new_tokens=NEW)
    assert plain.token_ids != greedy.token_ids  # the sampled run does sample
    res = run(model, chain_proposer(model, kind, plain.token_ids), prompt, max_new_tokens=NEW, sampling=SAMPLED)
    assert res.token_ids == plain.token_ids
    if kind.startswith("scripted"):
        assert all(a == 2 for a in res.stats.accepted_per_cycle[:-1])


# -- refusals ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["self-tree", "eagle3-tree", "scripted-tree"])
def test_trees_are_refused(model, kind):
    prompt = prompt_of(9, seed=3)
    if kind == "self-tree":
        prop = SelfTreeProposer(model, 3)
    elif kind == "eagle3-tree":
        prop = Eagle3Proposer(init_drafter(model, draft_vocab_size=200, seed=1), DraftShape(3, 2, 6))
    else:
        prop = ScriptedProposer(hf_greedy(model, prompt), k=1, length=3, vocab_size=300, tree=True)
    with pytest.raises(ConfigError, match=r"Qwen3Next keeps a recurrent state .* token tree cannot fork; use --chain K"):
        run(model, prop, prompt, max_new_tokens=NEW)


def test_batched_server_refuses_hybrid_targets(model):
    from eagle3.serving.server import build_scheduler

    target = Target(model, [])
    with pytest.raises(ConfigError, match=r"linear-attention layers .* the server cannot batch it"):
        build_scheduler(target, None, [2])
    target.close()


def test_fast_path_declines_hybrid_targets(model):
    from eagle3.fast.families import fast_support

    assert "qwen3_next" in fast_support(model)  # the generic engine runs it


# -- loading -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    from eagle3.models import STORIES260K_DIR

    out = tmp_path_factory.mktemp("qwen3_next")
    model.save_pretrained(out)
    for f in STORIES260K_DIR.iterdir():  # any tokenizer will do for loading
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def test_load_target_init_drafter_and_runtime(model, folder, tmp_path, capsys):
    from eagle3.cli import main
    from eagle3.models import load_target
    from eagle3.runtime import load_runtime

    loaded, _ = load_target(folder)
    assert loaded.config._attn_implementation == "sdpa" and loaded.config.layer_types == CONFIG["layer_types"]
    drafter = tmp_path / "drafter"
    assert main(["init-drafter", "--target", str(folder), "--out", str(drafter)]) == 0
    prompt = prompt_of(PROMPTS[1], seed=4)
    ref = hf_greedy(model, prompt)

    rt = load_runtime(str(folder), drafter=drafter, spec=DraftShape.chain(3), device="cpu")
    assert rt.target.aux_layer_ids and rt.engine.generate(prompt, max_new_tokens=NEW).token_ids == ref
    rt.target.close()
    with pytest.raises(ConfigError, match="use --chain K"):
        load_runtime(str(folder), drafter=drafter, spec=DraftShape(4, 3, 12), device="cpu")
    rt = load_runtime(str(folder), drafter=drafter, device="cpu")  # no shape given: a chain, not the default tree
    assert rt.spec.is_chain
    rt.target.close()
    assert main(["generate", "--target", str(folder), "--drafter", str(drafter), "--prompt", "hi",
                 "--device", "cpu", "--tree", "4,3,12"]) == 2
    err = capsys.readouterr().err
    assert "eagle3: error: Qwen3Next keeps a recurrent state" in err and "Traceback" not in err
