"""Losslessness on more target families (fp32, CPU): Llama-4 text, gpt-oss, Phi-3 and GLM-4-MoE.

Tiny seeded random configs of the tests/conftest.py shape (6 layers, hidden 64, vocab 300), each with what makes the
family differ: Llama-4's chunked attention (chunks of 8, prompts crossing several), NoPE layers and their query
temperature (floor_scale 4, so tree nodes straddle its steps), MoE every other layer; gpt-oss's attention sinks,
alternating sliding/full layers (window 8) and MoE, on eager attention (it has no sdpa); Phi-3's sliding window and
fused qkv; GLM-4-MoE's partial RoPE, shared expert and first dense layer. Greedy speculative output equals HF
`generate(do_sample=False)` and sampled output equals plain sampling with the same seed, for the drafters of
tests/test_lossless.py. Also: `load_target` picks eager for gpt-oss, and `--trust-remote-code`.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch
import transformers

from conftest import _COMMON
from doubles import proposer
from eagle3.config import ConfigError, SamplingConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.hf_batch import batched_forward, prefill
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.runtime import init_drafter
from eagle3.target import Target

CHUNK = 8  # Llama-4 attention_chunk_size and gpt-oss / Phi-3 sliding window: prompts below cross it several times

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        head_dim=16, attention_chunk_size=CHUNK,
        floor_scale=4, attn_scale=2.0,  # Maverick: 8192 and 0.1; small and large so trees straddle floor steps
        intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        tie_word_embeddings=False,  # no_rope_layers default: every 4th layer NoPE (full attention), others chunked
    )),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, sliding_window=CHUNK, layer_types=["sliding_attention", "full_attention"] * 3,
        num_local_experts=4, num_experts_per_tok=2,
    )),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=CHUNK)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        n_group=1, topk_group=1,
    )),
}
NAMES = list(FAMILIES)
NEW = 20
LONG = 3 * CHUNK + 5


def build(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    config_name, model_name, kwargs = FAMILIES[name]
    config = getattr(transformers, config_name)(**{**_COMMON, **kwargs})
    torch.manual_seed(seed * 1000 + 100 + NAMES.index(name))
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def models():
    return {n: build(n) for n in NAMES}


def prompt_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))




def test_families_load_as_expected(models):
    assert models["gpt_oss"].config._attn_implementation == "eager"  # no sdpa: sinks live in the eager path
    assert {models[n].config._attn_implementation for n in ("llama4", "phi3", "glm4_moe")} == {"sdpa"}
    cfg = models["llama4"].config
    assert "chunked_attention" in cfg.layer_types and 0 in cfg.no_rope_layers and cfg.attn_temperature_tuning


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "random", "scripted-0", "scripted-2"])
def test_greedy_matches_hf_generate(models, name, mode, kind):
    model = models[name]
    for n in ((5, LONG) if kind == "self" else (LONG,)):
        prompt = prompt_of(n, seed=len(name) + n)
        ref = model.generate(prompt[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, n:].tolist()
        target = Target(model, init_drafter(model, seed=1).config.aux_layer_ids)
        try:
            res = SpeculativeEngine(target, proposer(model, kind, mode, ref)).generate(
                prompt, max_new_tokens=NEW, eos_token_ids=[2])
        finally:
            target.close()
        assert res.token_ids == ref, (name, n)
        if kind == "self":
            assert res.stats.tau > 2.5
        if kind.startswith("scripted"):
            assert all(a == int(kind[-1]) for a in res.stats.accepted_per_cycle[:-1])


@pytest.mark.parametrize("name", NAMES)
def test_plain_decoding_matches_hf_generate(models, name):
    """`--draft none`: one token per verification forward, through eagle3's masks (what Llama-4 got wrong)."""
    model = models[name]
    prompt = prompt_of(LONG, seed=2)
    ref = model.generate(prompt[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, LONG:].tolist()
    target = Target(model, [])
    res = SpeculativeEngine(target, NoDraftProposer()).generate(prompt, max_new_tokens=NEW, eos_token_ids=[2])
    target.close()
    assert res.token_ids == ref


SAMPLED = SamplingConfig(temperature=0.9, top_p=0.95, top_k=50, seed=7)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "random", "scripted-2"])
def test_sampled_equals_plain_sampling_with_the_same_seed(models, name, mode, kind):
    model = models[name]
    prompt = prompt_of(LONG, seed=len(name) + 1)
    target = Target(model, init_drafter(model, seed=1).config.aux_layer_ids)
    try:
        plain = SpeculativeEngine(target, NoDraftProposer()).generate(prompt, max_new_tokens=NEW, sampling=SAMPLED)
        greedy = SpeculativeEngine(target, NoDraftProposer()).generate(prompt, max_new_tokens=NEW)
        res = SpeculativeEngine(target, proposer(model, kind, mode, plain.token_ids)).generate(
            prompt, max_new_tokens=NEW, sampling=SAMPLED)
    finally:
        target.close()
    assert plain.token_ids != greedy.token_ids
    assert res.token_ids == plain.token_ids


def _tree_vs_path_logits(model, past: int, disable_fix: bool = False) -> float:
    """Max |logit difference| between a tree's accepted path verified inside the tree and verified as a chain.

    The tree: root, four siblings at depth 1, a child of the last one at depth 2 (cache slot past+5, position
    past+2), so with floor_scale 4 the child's slot and position fall in different temperature steps."""
    target = Target(model, [])
    if disable_fix:
        target._query_scale = None
    prompt = prompt_of(past, seed=5)[None]
    toks = prompt_of(6, seed=6)[None]
    parents = [-1, 0, 0, 0, 0, 4]
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            mask[i, j], j = True, parents[j]
    kv, _, _ = prefill(target, [prompt[0].tolist()])
    in_tree, _ = batched_forward(target, toks, kv, mask[None], (mask.sum(1) - 1)[None])
    kv, _, _ = prefill(target, [prompt[0].tolist()])
    chain, _ = batched_forward(target, toks[:, [0, 4, 5]], kv, torch.ones(1, 3, 3, dtype=torch.bool).tril(),
                               torch.arange(3)[None])
    target.close()
    return (in_tree[0, [0, 4, 5]] - chain[0]).abs().max().item()


def test_llama4_nope_temperature_follows_positions_not_slots(models):
    """transformers scales Llama-4 NoPE queries by the cache slot (`Target._set_query_ratio` corrects tree nodes)."""
    model = models["llama4"]
    assert _tree_vs_path_logits(model, past=14) < 1e-4
    assert _tree_vs_path_logits(model, past=14, disable_fix=True) > 1e-3  # the correction is what matters


def test_batched_serving_forward_uses_row_positions(models):
    """The serving batch pads rows to one cache width; Llama-4's temperature must follow each row's positions."""
    model = models["llama4"]
    target = Target(model, [])
    prompts = [prompt_of(6, seed=8).tolist(), prompt_of(14, seed=9).tolist()]
    kv, _, _ = prefill(target, prompts)
    nxt = torch.tensor([[11], [12]])
    logits, _ = batched_forward(target, nxt, kv, torch.ones(2, 1, 1, dtype=torch.bool), torch.zeros(2, 1,
                                                                                                   dtype=torch.long))
    alone = model(torch.tensor([prompts[0] + [11]])).logits[0, -1]
    target.close()
    assert (logits[0, -1] - alone).abs().max().item() < 1e-4


# -- loading ------------------------------------------------------------------------------------------------------
def _save(model, folder) -> None:
    from eagle3.models import STORIES260K_DIR

    model.save_pretrained(folder)
    for f in STORIES260K_DIR.iterdir():  # any tokenizer will do for loading
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)


def test_load_target_falls_back_to_eager_for_gpt_oss(models, tmp_path):
    from eagle3.models import load_target

    _save(models["gpt_oss"], tmp_path)
    model, _ = load_target(tmp_path)
    assert model.config._attn_implementation == "eager"
    Target(model, [1, 3, 5]).close()


_REMOTE_CONFIG = '''from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
'''
_REMOTE_MODEL = '''from transformers import LlamaForCausalLM

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
'''


@pytest.fixture
def remote_code_folder(tmp_path, tiny_target):
    folder = tmp_path / "remote"
    _save(tiny_target("llama"), folder)
    (folder / "configuration_tiny.py").write_text(_REMOTE_CONFIG)
    (folder / "modeling_tiny.py").write_text(_REMOTE_MODEL)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"],
               auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig",
                         "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_remote_code_needs_the_flag(remote_code_folder):
    from eagle3.models import load_target

    with pytest.raises(ConfigError, match="--trust-remote-code"):
        load_target(remote_code_folder)
    model, _ = load_target(remote_code_folder, trust_remote_code=True)
    assert type(model).__name__ == "TinyRemoteForCausalLM"


def test_cli_trust_remote_code(remote_code_folder, tmp_path, capsys, monkeypatch):
    import eagle3.models
    from eagle3.cli import main

    monkeypatch.setattr(eagle3.models, "_TRUST_REMOTE_CODE", False)  # main sets the process default
    args = ["init-drafter", "--target", str(remote_code_folder), "--out", str(tmp_path / "d")]
    assert main(args) == 2
    assert "eagle3: error:" in capsys.readouterr().err
    assert main([*args, "--trust-remote-code"]) == 0
