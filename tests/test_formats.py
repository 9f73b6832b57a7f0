"""Checkpoint formats: speculators (vLLM) and native EAGLE-3 (SGLang) round trips, conversions and validation.

Run: `pytest tests/test_formats.py -q`. Drafters are tiny (hidden 64) and random; targets are fake
`transformers.LlamaConfig`s, so nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle3.config import ConfigError, DrafterConfig
from eagle3.drafter import DrafterKV, Eagle3Drafter
from eagle3.formats import (
    cast_drafter,
    config_from_dict,
    export_drafter,
    load_drafter,
    native_aux_ids_to_vllm,
    native_config_dict,
    save_drafter,
    speculators_config_dict,
    validate_against_target,
)

V, H, L = 128, 64, 8
FLAGS = {
    "plain": {},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_before_residual": {"norm_before_residual": True},
}


def make_cfg(draft_vocab: int = V, **kw) -> DrafterConfig:
    base = dict(
        hidden_size=H,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=V,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=[2, 4, 5],
        target_num_layers=L,
        verifier_name_or_path="tiny/llama",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=3,
    )
    base.update(kw)
    return DrafterConfig(**base)


def random_drafter(cfg: DrafterConfig, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    if cfg.uses_draft_vocab:
        drafter.set_vocab_mapping(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values)
    return drafter.eval()


def target(**kw) -> LlamaConfig:
    base = dict(
        vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0,
    )  # fmt: skip
    base.update(kw)
    return LlamaConfig(**base)


@torch.no_grad()
def two_step_logits(drafter: Eagle3Drafter, seed: int = 1, t: int = 7) -> torch.Tensor:
    """Draft logits of a first step from target features and a second step from the drafter's own output."""
    g = torch.Generator().manual_seed(seed)
    ht = drafter.config.resolved_target_hidden_size
    dt = drafter.fc.weight.dtype
    aux = torch.randn(1, t, 3 * ht, generator=g).to(dt)  # [1, T, 3Ht]
    ids = torch.randint(0, drafter.config.vocab_size, (1, t + 1), generator=g)
    pos = torch.arange(t)[None]
    cache = DrafterKV()
    out0 = drafter(drafter.combine(aux), ids[:, :t], pos, cache=cache)  # [1, T, H]
    # second TTT step: causal over step-0 keys plus each row's own new key
    mask = torch.cat([torch.ones(t, t, dtype=torch.bool).tril(), torch.eye(t, dtype=torch.bool)], dim=1)[
        None, None
    ]
    out1 = drafter(drafter.feedback(out0), ids[:, 1:], pos + 1, mask=mask, cache=cache)
    return torch.cat([drafter.logits(out0), drafter.logits(out1)], dim=1).float()  # [1, 2T, Vd]


def read_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def write_json(path: Path, config: dict) -> None:
    (path / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
@pytest.mark.parametrize("draft_vocab", [V, 96])
@pytest.mark.parametrize("flags", list(FLAGS))
def test_round_trip_keeps_logits_and_config(tmp_path, fmt, draft_vocab, flags):
    cfg = make_cfg(draft_vocab, **FLAGS[flags])
    drafter = random_drafter(cfg)
    save_drafter(drafter, tmp_path / "ckpt", fmt)
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in (tmp_path / "ckpt").iterdir())  # servers run as others
    loaded = load_drafter(tmp_path / "ckpt", target_config=target())
    assert loaded.config.to_dict() == cfg.to_dict()
    torch.testing.assert_close(two_step_logits(loaded), two_step_logits(drafter), rtol=0, atol=0)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)


def test_norm_output_round_trips_in_speculators_and_is_refused_natively(tmp_path):
    drafter = random_drafter(make_cfg(96, norm_output=True))
    save_drafter(drafter, tmp_path / "spec", "speculators")
    loaded = load_drafter(tmp_path / "spec")
    assert loaded.config.norm_output
    torch.testing.assert_close(two_step_logits(loaded), two_step_logits(drafter), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="norm_output"):
        save_drafter(drafter, tmp_path / "native", "eagle")


def test_speculators_layout(tmp_path):
    drafter = random_drafter(make_cfg(96, rope_theta=500000.0))
    save_drafter(drafter, tmp_path / "ckpt", "speculators", dtype=torch.bfloat16)
    config = read_json(tmp_path / "ckpt")
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # always written: vLLM defaults a missing key to True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle3"]["target_num_layers"] == L
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["head_dim"]) == ("llama", 1, 16)
    assert (layer["rope_theta"], layer["torch_dtype"], layer["tie_word_embeddings"]) == (
        500000.0,
        "bfloat16",
        False,
    )
    method = config["speculators_config"]["proposal_methods"][0]
    assert method == {
        "proposal_type": "greedy",
        "speculative_tokens": 3,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": "tiny/llama",
        "architectures": ["LlamaForCausalLM"],
    }
    sd = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in sd and not any(k.startswith("midlayer.") for k in sd)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert sd["fc.weight"].dtype == torch.bfloat16 and "embed_tokens.weight" in sd
    assert not list(tmp_path.glob(".ckpt*")), "temporary directories left behind"


def test_native_layout_without_draft_vocab(tmp_path):
    drafter = random_drafter(make_cfg(V))
    save_drafter(drafter, tmp_path / "ckpt", "eagle", include_embedding=False)
    config = read_json(tmp_path / "ckpt")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "use_aux_hidden_state": True,
    }
    assert config["norm_before_residual"] is False and "norm_output" not in config
    sd = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert "midlayer.hidden_norm.weight" in sd and not any(k.startswith("layers.") for k in sd)
    assert not {"d2t", "t2d", "embed_tokens.weight"} & set(sd)


def test_target_hidden_size_round_trips(tmp_path):
    cfg = make_cfg(96, target_hidden_size=32)
    drafter = random_drafter(cfg)
    for fmt in ("speculators", "eagle"):
        save_drafter(drafter, tmp_path / fmt, fmt)
        loaded = load_drafter(tmp_path / fmt, target_config=target(hidden_size=32))
        torch.testing.assert_close(two_step_logits(loaded), two_step_logits(drafter), rtol=0, atol=0)


def test_pytorch_model_bin_and_fp16_load(tmp_path):
    drafter = random_drafter(make_cfg(96))
    save_drafter(drafter, tmp_path / "ckpt", "eagle", dtype="float16")
    sd = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    torch.save(sd, tmp_path / "ckpt" / "pytorch_model.bin")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.fc.weight.dtype == torch.float16 and loaded.config.torch_dtype == "float16"
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32, "RoPE frequencies must stay fp32"
    expected = two_step_logits(cast_drafter(drafter, torch.float16))
    torch.testing.assert_close(two_step_logits(loaded), expected, rtol=0, atol=0)
    assert load_drafter(tmp_path / "ckpt", dtype=torch.float32).fc.weight.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# embedding rule
# ---------------------------------------------------------------------------------------------
def test_missing_embedding_needs_the_target_embedding(tmp_path):
    drafter = random_drafter(make_cfg(96))
    save_drafter(drafter, tmp_path / "ckpt", "speculators", include_embedding=False)
    with pytest.raises(ConfigError, match="target_embedding"):
        load_drafter(tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt", target_embedding=drafter.embed_tokens.weight.clone())
    torch.testing.assert_close(two_step_logits(loaded), two_step_logits(drafter), rtol=0, atol=0)
    module = torch.nn.Embedding(V, H)
    module.weight.data.copy_(drafter.embed_tokens.weight)
    assert torch.equal(
        load_drafter(tmp_path / "ckpt", target_embedding=module).embed_tokens.weight, module.weight
    )
    no_embedding = load_drafter(tmp_path / "ckpt", require_embedding=False)
    assert no_embedding.embed_tokens.weight.isnan().all()
    with pytest.raises(ConfigError, match="include_embedding=False"):
        save_drafter(no_embedding, tmp_path / "again")
    with pytest.raises(ConfigError, match="shape"):
        load_drafter(tmp_path / "ckpt", target_embedding=torch.zeros(V, H + 1))


# ---------------------------------------------------------------------------------------------
# reading other projects' configs
# ---------------------------------------------------------------------------------------------
def test_speculators_missing_norm_before_residual_means_true(tmp_path, caplog):
    save_drafter(random_drafter(make_cfg()), tmp_path / "ckpt", "speculators")
    config = read_json(tmp_path / "ckpt")
    del config["norm_before_residual"]
    write_json(tmp_path / "ckpt", config)
    with caplog.at_level(logging.WARNING, logger="eagle3.formats"):
        assert load_drafter(tmp_path / "ckpt").config.norm_before_residual is True
    assert "norm_before_residual" in caplog.text


def test_speculators_own_keys_are_read(tmp_path):
    """speculators 0.9 writes `rope_parameters`, `dtype` and `Eagle3DraftModel`; no eagle3 extras."""
    save_drafter(random_drafter(make_cfg(rope_theta=777.0)), tmp_path / "ckpt", "speculators")
    config = read_json(tmp_path / "ckpt")
    config["architectures"] = ["Eagle3DraftModel"]
    del config["eagle3"]
    layer = config["transformer_layer_config"]
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": layer.pop("rope_theta")}
    del layer["rope_scaling"]
    layer["dtype"] = layer.pop("torch_dtype")
    write_json(tmp_path / "ckpt", config)
    cfg = load_drafter(tmp_path / "ckpt", target_config=target(rope_theta=777.0)).config
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.target_num_layers) == (777.0, None, L)


def test_rope_scaling_round_trips(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}  # fmt: skip
    drafter = random_drafter(make_cfg(rope_theta=500000.0, rope_scaling=scaling))
    for fmt in ("speculators", "eagle"):
        save_drafter(drafter, tmp_path / fmt, fmt)
        loaded = load_drafter(tmp_path / fmt)
        assert loaded.config.rope_scaling == scaling
        torch.testing.assert_close(two_step_logits(loaded), two_step_logits(drafter), rtol=0, atol=0)


def _native_without_extras(tmp_path: Path, ids: list[int] | None) -> Path:
    save_drafter(random_drafter(make_cfg()), tmp_path / "ckpt", "eagle")
    config = read_json(tmp_path / "ckpt")
    del config["eagle3"]
    if ids is None:
        del config["eagle_config"]
    else:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    write_json(tmp_path / "ckpt", config)
    return tmp_path / "ckpt"


def test_native_sglang_style_ids_are_shifted(tmp_path):
    sglang_style = [1, L // 2 - 1, L - 4]  # SpecForge default: outputs of layers 1, L//2-1, L-4
    assert native_aux_ids_to_vllm(sglang_style) == [2, L // 2, L - 3]
    assert native_aux_ids_to_vllm([2, 4, 5]) == [2, 4, 5]
    assert native_aux_ids_to_vllm([0, 3, 6]) == [0, 3, 6]
    path = _native_without_extras(tmp_path, sglang_style)
    cfg = load_drafter(path, target_config=target()).config
    assert cfg.aux_layer_ids == [2, 4, 5] and cfg.target_num_layers == L


def test_native_without_layer_count_infers_it_from_default_ids(tmp_path):
    cfg = load_drafter(_native_without_extras(tmp_path, [2, 16, 29])).config
    assert (cfg.aux_layer_ids, cfg.target_num_layers) == ([2, 16, 29], 32)


def test_native_missing_ids_use_the_default(tmp_path):
    path = _native_without_extras(tmp_path, None)
    assert load_drafter(path, target_config=target()).config.aux_layer_ids == [2, 4, 5]
    with pytest.raises(ConfigError, match="target_config"):
        load_drafter(path)


def test_official_eagle3_style_checkpoint(tmp_path):
    """A SafeAILab-style checkpoint: flat config, no eagle_config or flags, fp16 pytorch_model.bin, no embedding."""
    drafter = random_drafter(make_cfg(96))
    save_drafter(drafter, tmp_path / "ckpt", "eagle", include_embedding=False, dtype=torch.float16)
    config = read_json(tmp_path / "ckpt")
    for key in ("eagle3", "eagle_config", "norm_before_residual", "norm_before_fc", "fc_norm", "head_dim",
                "rope_theta", "rope_scaling", "mlp_bias"):  # fmt: skip
        del config[key]
    write_json(tmp_path / "ckpt", config)
    sd = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    del sd["t2d"]  # derived from d2t
    torch.save(sd, tmp_path / "ckpt" / "pytorch_model.bin")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    loaded = load_drafter(
        tmp_path / "ckpt", target_config=target(), target_embedding=drafter.embed_tokens.weight
    )
    assert loaded.config.norm_before_residual is False and loaded.config.aux_layer_ids == [2, 4, 5]
    assert torch.equal(loaded.t2d, drafter.t2d)
    torch.testing.assert_close(
        two_step_logits(loaded), two_step_logits(cast_drafter(drafter, torch.float16)), rtol=0, atol=0
    )


# ---------------------------------------------------------------------------------------------
# export between formats
# ---------------------------------------------------------------------------------------------
def test_export_between_formats(tmp_path):
    drafter = random_drafter(make_cfg(96, fc_norm=True))
    save_drafter(drafter, tmp_path / "spec", "speculators", include_embedding=False)
    export_drafter(tmp_path / "spec", "eagle", tmp_path / "native")
    export_drafter(tmp_path / "native", "speculators", tmp_path / "back")
    assert read_json(tmp_path / "back") == read_json(tmp_path / "spec")
    a = load_file(str(tmp_path / "spec" / "model.safetensors"))
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    native = load_drafter(tmp_path / "native", target_embedding=drafter.embed_tokens.weight)
    torch.testing.assert_close(two_step_logits(native), two_step_logits(drafter), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="include_embedding"):
        export_drafter(tmp_path / "spec", "eagle", tmp_path / "x", include_embedding=True)
    export_drafter(drafter, "eagle", tmp_path / "from_module")
    assert "embed_tokens.weight" in load_file(str(tmp_path / "from_module" / "model.safetensors"))


def test_save_replaces_a_checkpoint_but_not_other_directories(tmp_path):
    first, second = random_drafter(make_cfg(), seed=0), random_drafter(make_cfg(), seed=1)
    save_drafter(first, tmp_path / "ckpt")
    save_drafter(second, tmp_path / "ckpt")
    torch.testing.assert_close(two_step_logits(load_drafter(tmp_path / "ckpt")), two_step_logits(second))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"notes\.txt"):
        save_drafter(first, tmp_path / "run")
    assert (tmp_path / "run" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ConfigError, match="format"):
        save_drafter(first, tmp_path / "x", "gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "run"]


# ---------------------------------------------------------------------------------------------
# mismatches and unsupported flags
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target_kw", "field"),
    [
        ({"hidden_size": 128}, "hidden_size"),
        ({"vocab_size": 256}, "vocab_size"),
        ({"num_hidden_layers": 4}, "aux_layer_ids"),
        ({"num_hidden_layers": 12}, "target_num_layers"),
    ],
)
def test_target_mismatch_names_the_field(tmp_path, target_kw, field):
    save_drafter(random_drafter(make_cfg(96)), tmp_path / "ckpt")
    tc = target(**target_kw)
    with pytest.raises(ConfigError, match=field) as info:
        load_drafter(tmp_path / "ckpt", target_config=tc)
    assert str(next(iter(target_kw.values()))) in str(info.value), "message must show the target's value"
    with pytest.raises(ConfigError, match=field):
        validate_against_target(make_cfg(96), tc)


def test_validate_reads_target_config_dicts_and_text_config():
    validate_against_target(make_cfg(), {"text_config": target().to_dict()})
    with pytest.raises(ConfigError, match="vocab_size"):
        validate_against_target(make_cfg(), {**target().to_dict(), "vocab_size": 50})


def test_rope_differences_only_warn_and_dtype_differences_are_silent(caplog):
    # an fp32-saved drafter in a bf16 run is cast; a warning about it would give the user nothing to do
    with caplog.at_level(logging.WARNING, logger="eagle3.formats"):
        validate_against_target(make_cfg(), target(rope_theta=500000.0, dtype="bfloat16"))
    assert "rope_theta" in caplog.text and "dtype" not in caplog.text


def _vocab(d2t: torch.Tensor | None, t2d: torch.Tensor | None) -> None:
    validate_against_target(make_cfg(4, vocab_size=8), target(vocab_size=8), d2t=d2t, t2d=t2d)


def test_draft_vocab_mapping_checks():
    ids = torch.tensor([1, 3, 4, 7])
    d2t, t2d = ids - torch.arange(4), torch.zeros(8, dtype=torch.bool)
    t2d[ids] = True
    _vocab(d2t, t2d)
    _vocab(d2t, None)  # t2d is implied by d2t
    with pytest.raises(ConfigError, match="d2t is missing"):
        _vocab(None, t2d)
    with pytest.raises(ConfigError, match="strictly increasing"):
        _vocab(torch.tensor([1, 2, 1, 4]), None)  # target ids 1, 3, 3, 7
    with pytest.raises(ConfigError, match="outside"):
        _vocab(torch.tensor([1, 2, 2, 5]), None)  # target id 8
    with pytest.raises(ConfigError, match="d2t has shape"):
        _vocab(torch.zeros(5, dtype=torch.long), None)
    bad = t2d.clone()
    bad[0] = True
    with pytest.raises(ConfigError, match="t2d marks 5"):
        _vocab(d2t, bad)
    shifted = torch.zeros(8, dtype=torch.bool)
    shifted[[0, 3, 4, 7]] = True
    with pytest.raises(ConfigError, match="disagree"):
        _vocab(d2t, shifted)


def test_checkpoint_without_d2t_is_refused(tmp_path):
    save_drafter(random_drafter(make_cfg(96)), tmp_path / "ckpt")
    sd = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    del sd["d2t"]
    save_file(sd, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(ConfigError, match="d2t"):
        load_drafter(tmp_path / "ckpt")


def test_wrong_weight_shape_is_named(tmp_path):
    save_drafter(random_drafter(make_cfg()), tmp_path / "ckpt")
    config = read_json(tmp_path / "ckpt")
    config["transformer_layer_config"]["intermediate_size"] = 100
    write_json(tmp_path / "ckpt", config)
    with pytest.raises(ConfigError, match=r"mlp\.\w+_proj"):
        load_drafter(tmp_path / "ckpt")


def _speculators(edit) -> dict:
    config = speculators_config_dict(make_cfg())
    edit(config)
    return config


def _native(edit) -> dict:
    config = native_config_dict(make_cfg())
    edit(config)
    return config


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (_speculators(lambda c: c.update(speculators_model_type="medusa")), "speculators_model_type"),
        (
            _speculators(lambda c: c["transformer_layer_config"].update(num_hidden_layers=2)),
            "num_hidden_layers",
        ),
        (_speculators(lambda c: c["transformer_layer_config"].update(model_type="qwen3")), "model_type"),
        (
            _speculators(lambda c: c["transformer_layer_config"].update(tie_word_embeddings=True)),
            "tie_word_embeddings",
        ),
        (_speculators(lambda c: c["transformer_layer_config"].update(logit_scale=0.5)), "logit_scale"),
        (_speculators(lambda c: c["transformer_layer_config"].update(hidden_act="gelu")), "hidden_act"),
        (_speculators(lambda c: c.pop("transformer_layer_config")), "transformer_layer_config"),
        (_speculators(lambda c: c.update(norm_before_fc=True, fc_norm=True)), "fc_norm"),
        (_native(lambda c: c.update(num_hidden_layers=2)), "num_hidden_layers"),
        (_native(lambda c: c["eagle_config"].update(use_aux_hidden_state=False)), "use_aux_hidden_state"),
        (_native(lambda c: c.update(norm_output=False)), "norm_output"),
        (_native(lambda c: c.update(use_sliding_window=True)), "use_sliding_window"),
    ],
)
def test_unsupported_flags_raise(config, field):
    with pytest.raises(ConfigError, match=field):
        config_from_dict(config)


def test_unknown_format_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json"):
        load_drafter(tmp_path)
    write_json(tmp_path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="speculators_config"):
        load_drafter(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin"):
        load_drafter(tmp_path)


def test_speculators_save_warns_without_verifier_path(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="eagle3.formats"):
        save_drafter(random_drafter(make_cfg(verifier_name_or_path=None)), tmp_path / "ckpt")
    assert "verifier_name_or_path" in caplog.text
    assert read_json(tmp_path / "ckpt")["speculators_config"]["verifier"]["name_or_path"] is None
