"""Gemma-4 and MLA targets (DeepSeek-V3, Kimi-K2.5) decode losslessly, get drafters shaped like published ones, and load
from their multimodal checkpoints (tiny random fp32 models on the CPU, as tests/test_lossless.py).

- gemma4: Gemma-4 text with sliding windows the prompt crosses, per-layer head sizes (`global_head_dim`),
  per-layer inputs and KV-shared layers (`num_kv_shared_layers`, whose rows transformers drops at prefill when
  asked for one logit: `eagle3.target.Target` keeps them); gemma4_moe: its MoE blocks.
- deepseek_v3: MLA attention and routed experts; kimi_k25: a Kimi-K2.5-style multimodal checkpoint (`Kimi_K25Config`
  holding a DeepSeek-V3 `text_config`, text weights under `language_model.model.*` as published), loaded through
  `eagle3.models.load_target`, which reduces it to its text model.

Greedy output equals HF `generate(do_sample=False)` and sampled output equals plain sampling with the same seed, with
always-right, random and scripted drafters, as chains and trees. A drafter saved without `embed_tokens` (as published
EAGLE-3 drafters are) takes the target's embedding, as vLLM does (`vllm/v1/spec_decode/eagle.py` `load_model`; newer
`vllm/v1/worker/gpu/spec_decode/eagle/utils.py` `load_eagle_model`).
Run: pytest tests/test_families_mla_gemma.py
"""

from __future__ import annotations

import logging
import shutil
from functools import cache

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import TINY_SLIDING_WINDOW
from doubles import proposer
from eagle3.config import ConfigError, DrafterConfig, DraftShape, SamplingConfig
from eagle3.decoding.drafters import Eagle3Proposer
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.formats import load_drafter, save_drafter
from eagle3.models import STORIES260K_DIR, load_target
from eagle3.runtime import drafter_for, init_drafter, load_runtime
from eagle3.target import Target

NEW = 16
PROMPT_LEN = TINY_SLIDING_WINDOW * 2 + 3  # crosses Gemma-4's sliding window twice
FAMILIES = ["gemma4", "gemma4_moe", "deepseek_v3", "kimi_k25"]

_COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
_GEMMA4 = dict(
    head_dim=16, global_head_dim=32, sliding_window=TINY_SLIDING_WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=300,
    tie_word_embeddings=False,  # tied + scaled embeddings make random greedy output repeat one token
)
_DEEPSEEK = dict(
    num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1,
)


def gemma4_config(**kw) -> transformers.Gemma4TextConfig:
    return transformers.Gemma4TextConfig(**{**_COMMON, **_GEMMA4, **kw})


def deepseek_config(**kw) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(**{**_COMMON, **_DEEPSEEK, **kw})


def _frozen(model):
    model = model.to(torch.float32).eval()
    model.requires_grad_(False)
    return model


def _with_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(STORIES260K_DIR / name, folder)
    return folder


def kimi_k25_folder(folder, seed: int = 3):
    """A Kimi-K2.5-layout checkpoint: `Kimi_K25Config` around a DeepSeek-V3 text config, text weights named
    `language_model.model.*` / `language_model.lm_head.*` (the published layout; transformers
    `conversion_mapping.py` "kimi_k25" renames them on load). Returns (folder, the text model it holds)."""
    torch.manual_seed(seed)
    text = _frozen(transformers.DeepseekV3ForCausalLM(deepseek_config()))
    text.save_pretrained(folder)
    weights = folder / "model.safetensors"
    save_file({f"language_model.{k}": v for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  pos_emb_height=4, pos_emb_width=4)
    transformers.Kimi_K25Config(text_config=text.config.to_dict(), vision_config=vision, projection_hidden_size=32,
                                tie_word_embeddings=False).save_pretrained(folder)
    return _with_tokenizer(folder), text


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    folder, text = kimi_k25_folder(tmp_path_factory.mktemp("kimi_k25"))
    return folder, text


@pytest.fixture(scope="module")
def models(kimi):
    torch.manual_seed(0)
    g4 = _frozen(transformers.Gemma4ForCausalLM(gemma4_config(num_kv_shared_layers=2)))
    torch.manual_seed(1)
    g4moe = _frozen(transformers.Gemma4ForCausalLM(
        gemma4_config(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)))
    torch.manual_seed(2)
    ds = _frozen(transformers.DeepseekV3ForCausalLM(deepseek_config()))
    km, _ = load_target(kimi[0])
    return {"gemma4": g4, "gemma4_moe": g4moe, "deepseek_v3": ds, "kimi_k25": km}


def prompt_for(family: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(FAMILIES.index(family))
    return torch.randint(3, 300, (PROMPT_LEN,), generator=g)


@cache
def _hf_greedy(family: str, model_id: int, model) -> tuple[int, ...]:
    out = model.generate(prompt_for(family)[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return tuple(out[0, PROMPT_LEN:].tolist())


def hf_greedy(models, family):
    return list(_hf_greedy(family, id(models[family]), models[family]))




def generate(model, family: str, prop, sampling=None):
    target = Target(model, init_drafter(model, seed=1).config.aux_layer_ids)
    try:
        return SpeculativeEngine(target, prop).generate(prompt_for(family), max_new_tokens=NEW, eos_token_ids=[2],
                                                        sampling=sampling)
    finally:
        target.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "random", "scripted-2"])
def test_greedy_matches_hf_generate(models, family, mode, kind):
    model = models[family]
    ref = hf_greedy(models, family)
    res = generate(model, family, proposer(model, kind, mode, ref))
    assert res.token_ids == ref
    if kind == "self":
        assert res.stats.tau > 2.5, "an always-right drafter must be accepted"
    if kind.startswith("scripted"):
        assert all(a == 2 for a in res.stats.accepted_per_cycle[:-1])


SAMPLED = SamplingConfig(temperature=0.9, top_p=0.95, top_k=50, seed=7)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("mode", "kind"), [("chain", "random"), ("tree", "scripted-2")])
def test_sampled_equals_plain_sampling_with_the_same_seed(models, family, mode, kind):
    model = models[family]
    plain = generate(model, family, NoDraftProposer(), SAMPLED)
    assert plain.token_ids != hf_greedy(models, family)  # the sampled run does sample
    res = generate(model, family, proposer(model, kind, mode, plain.token_ids), SAMPLED)
    assert res.token_ids == plain.token_ids


def test_kv_shared_layers_are_tapped_on_every_row(models):
    """Gemma-4 KV-shared layers would run one row at a one-logit prefill; taps there must still see every row."""
    model = models["gemma4"]
    assert model.config.num_kv_shared_layers == 2
    target = Target(model, [1, 3, 5])  # 4 and 5 share KV
    try:
        cache = target.new_cache()
        logits, aux = target.forward(prompt_for("gemma4")[None], cache, logits_to_keep=1)
        assert logits.shape == (1, 1, 300) and aux.shape == (1, PROMPT_LEN, 3 * 64)
        feats, _ = target.features(prompt_for("gemma4")[None], with_logits=False)
        assert feats.shape == (1, PROMPT_LEN, 3 * 64)
        full = model(prompt_for("gemma4")[None]).logits[:, -1:]
        torch.testing.assert_close(logits, full.float())
    finally:
        target.close()


# -- drafter shapes ------------------------------------------------------------------------------------------------
def _shape(cfg: DrafterConfig) -> tuple[int, int, int]:
    return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim


def test_mla_drafters_are_shaped_like_published_ones():
    """Kimi-K2.5 (DeepSeek-V3-shaped, 64 heads, v_head_dim 128): 64 heads of 128 and 64 KV heads, as
    sgl-project/SpecForge `configs/kimi-k25-eagle3.json`; HF's `head_dim` (the 64-wide RoPE part) is not used."""
    kimi_text = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, qk_nope_head_dim=128,
                     qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512, q_lora_rank=1536, vocab_size=163840,
                     intermediate_size=18432, num_hidden_layers=61)
    text = transformers.DeepseekV3Config(**kimi_text)
    assert text.head_dim == 64  # what the old rule took: 128 heads of 64 for DeepSeek-V3
    cfg = DrafterConfig.for_target(text)
    assert _shape(cfg) == (64, 64, 128) and cfg.hidden_size == 7168 and cfg.intermediate_size == 18432
    wrapped = transformers.Kimi_K25Config(text_config=kimi_text)
    assert _shape(DrafterConfig.for_target(wrapped)) == (64, 64, 128)
    assert _shape(DrafterConfig.for_target(transformers.DeepseekV3Config())) == (128, 128, 128)


def test_gemma4_drafters_are_shaped_like_published_ones():
    """gemma-4-26B-A4B (16 heads of 256, `global_head_dim` 512 on full layers, 8 KV heads): 32 heads of 128 and 8
    KV heads, as sgl-project/SpecForge `configs/gemma4-26b-a4b-eagle3.json`. Reading `head_dim` from a Gemma-4
    config raised (`'head_dim' is a per-layer attribute`)."""
    text = dict(hidden_size=2816, num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                intermediate_size=2112, num_hidden_layers=30, vocab_size=262144)
    assert _shape(DrafterConfig.for_target(transformers.Gemma4TextConfig(**text))) == (32, 8, 128)
    assert _shape(DrafterConfig.for_target(transformers.Gemma4Config(text_config=text))) == (32, 8, 128)


@pytest.mark.parametrize("family", FAMILIES)
def test_init_drafter_on_tiny_targets(models, family):
    """Tiny targets keep their own split (a 64-wide query does not divide into 128-wide heads)."""
    d = init_drafter(models[family], seed=0)
    heads, kv, hd = _shape(d.config)
    assert heads * hd == 64 and heads % kv == 0
    assert hd == 16  # Gemma-4's sliding head size (not global_head_dim 32); MLA's v_head_dim (not qk_rope 8)


# -- published drafters without embed_tokens ----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma4", "kimi_k25"])
def test_drafter_without_embed_tokens_takes_the_targets(models, family, tmp_path):
    model = models[family]
    d = init_drafter(model, draft_vocab_size=200, seed=4)
    save_drafter(d, tmp_path / "d", format="eagle", include_embedding=False)
    with pytest.raises(ConfigError, match="no embed_tokens"):
        load_drafter(tmp_path / "d", target_config=model.config)
    loaded = drafter_for(model, tmp_path / "d")
    assert torch.equal(loaded.embed_tokens.weight, model.get_input_embeddings().weight)
    for mode in ("chain", "tree"):
        spec = DraftShape.chain(4) if mode == "chain" else DraftShape(4, 3, 12)
        res = generate(model, family, Eagle3Proposer(loaded, spec))
        assert res.token_ids == hf_greedy(models, family)


# -- multimodal checkpoints ---------------------------------------------------------------------------------------
def test_kimi_k25_loads_as_its_text_model(kimi, models, caplog):
    folder, text = kimi
    with caplog.at_level(logging.WARNING, logger="eagle3.models"):
        model, _ = load_target(folder)
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and model.config.vocab_size == 300
    assert "multimodal Kimi_K25Config; loading its text model only" in caplog.text
    for name, t in text.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert hf_greedy(models, "kimi_k25") == text.generate(
        prompt_for("kimi_k25")[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, PROMPT_LEN:].tolist()


def test_gemma4_multimodal_checkpoint_loads_as_its_text_model(tmp_path):
    """`Gemma4Config` has no `vocab_size`; `--draft model` on the checkpoint failed. Its text model decodes as the
    wrapper does on text."""
    torch.manual_seed(5)
    wrapper = _frozen(transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=gemma4_config(num_kv_shared_layers=2).to_dict(), vision_config=None, audio_config=None,
        tie_word_embeddings=False)))
    wrapper.save_pretrained(tmp_path / "g4")
    folder = _with_tokenizer(tmp_path / "g4")
    model, _ = load_target(folder)
    assert type(model).__name__ == "Gemma4ForCausalLM" and model.config.vocab_size == 300
    prompt = prompt_for("gemma4")[None]
    ref = wrapper.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    rt = load_runtime(str(folder), draft="model", draft_model=str(folder), spec=DraftShape.chain(4))
    try:
        res = rt.engine.generate(prompt[0], max_new_tokens=NEW, eos_token_ids=[2])
    finally:
        rt.target.close()
    assert res.token_ids == ref and res.stats.tau > 2.5


def test_multimodal_checkpoint_without_text_weights_is_refused(kimi, tmp_path):
    """Weights under an unknown prefix cannot be found: a ConfigError says so instead of a random text model."""
    folder = tmp_path / "odd"
    shutil.copytree(kimi[0], folder)
    weights = folder / "model.safetensors"
    save_file({k.replace("language_model.", "llm."): v for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="text model of this multimodal checkpoint did not load"):
        load_target(folder)
