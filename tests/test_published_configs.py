"""Published drafter config layouts, scaled down: each loads, runs against a target of its real depth, and exports
to both formats (`eagle3 export --target`) with its unknown keys, layer count and aux ids intact.

Run: `pytest tests/test_published_configs.py -q`. Dimensions are tiny (hidden 64) and weights random; only the
layer counts and aux ids are the published ones. Where each layout's keys come from:

* `safeailab_llama31_8b`: SafeAILab/EAGLE `eagle/traineagle3/config.json` (the config the official Llama-3.1-8B
  EAGLE-3 drafter is trained with): flat, no aux ids, no flags; 32-layer target.
* `modelopt_maverick`: NVIDIA ModelOpt's export template (`export_spec_ckpt_config` / `llama_eagle_template_config`
  in NVIDIA/TensorRT-Model-Optimizer `modelopt/torch/export/plugins/hf_spec_export.py`) with the `eagle_config`
  flags; ids [1, 23, 44] = ModelOpt's default `[1, L//2-1, L-4]` for Maverick's 48 layers.
* `speculators_maverick`: RedHat's speculators copy of that drafter, made with speculators' `Eagle3Converter` and
  `eagle_aux_hidden_state_layer_ids=[1, 23, 44]` (Red Hat Developer, "Speculators: Standardized, production-ready
  speculative decoding", 2025-11-19). Its keys follow eagle3's speculators writer (checked against speculators
  0.9 by tests/test_oracle.py) plus `auto_map`, an example of a key eagle3 does not interpret.
* The other three are named generically (their exact published keys are not known here): a speculators config
  without aux ids for a 32-layer Llama-3.1-8B-shaped target; one for a 36-layer gpt-oss-120B-shaped target whose
  ids [2, 18, 34] are the EAGLE-3 default of 37 layers; one with `norm_before_residual` for a 36-layer
  Qwen3-8B-shaped target.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from eagle3.cli import main
from eagle3.drafter import DrafterKV, Eagle3Drafter
from eagle3.formats import config_from_dict, drafter_state_dict, load_drafter, read_checkpoint
from eagle3.formats import configs as formats_configs

V, VD, H = 128, 96, 64
TINY_LAYER = {"hidden_size": H, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": V}  # fmt: skip


def _speculators(ids: list[int] | None, verifier: str, extra_top: dict, **flags) -> dict:
    config = {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "draft_vocab_size": VD,
        "norm_before_residual": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": verifier},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0",
        "target_hidden_size": None,
        "torch_dtype": "bfloat16",
        "transformer_layer_config": {
            **TINY_LAYER, "attention_bias": False, "attention_dropout": 0.0, "head_dim": 16, "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 2048, "mlp_bias": False, "model_type": "llama",
            "num_hidden_layers": 1, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "use_cache": True,
        },
        "transformers_version": "4.53.2",
        **extra_top,
        **flags,
    }
    if ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = ids
    return config


SAFEAILAB = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 2048, "model_type": "llama", "num_hidden_layers": 1,
    "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.28.1", "use_cache": True, **TINY_LAYER, "draft_vocab_size": VD,
}  # fmt: skip
MODELOPT_FLAGS = {"use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "use_mtp_layernorm": False,
                  "next_layer_regular": True, "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1}  # fmt: skip
MODELOPT = {
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 2048, "model_type": "llama", "num_hidden_layers": 1,
    "pad_token_id": None, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, **TINY_LAYER, "draft_vocab_size": VD, "rope_scaling": None,
    "attention_bias": False, "attention_dropout": 0.0, "head_dim": 16, "mlp_bias": False, "pretraining_tp": 1,
    "rope_theta": 500000.0,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 23, 44], "use_aux_hidden_state": True, **MODELOPT_FLAGS},
}  # fmt: skip

# name: (config, format, target depth, expected ids in vLLM convention, unknown keys {"top"/"layer": [...]})
SPEC_KEEP = {"top": ["auto_map", "transformers_version"],
             "layer": ["attention_dropout", "initializer_range", "pretraining_tp", "use_cache"]}  # fmt: skip
FIXTURES = {
    "safeailab_llama31_8b": (SAFEAILAB, "eagle", 32, [2, 16, 29],
                             {"top": [], "layer": ["initializer_range", "transformers_version"]}),
    "speculators_no_aux_ids_llama31_8b": (_speculators(None, "meta-llama/Llama-3.1-8B-Instruct", {}), "speculators",
                                          32, [2, 16, 29], SPEC_KEEP),
    "speculators_maverick": (_speculators([1, 23, 44], "meta-llama/Llama-4-Maverick-17B-128E-Instruct", {}),
                             "speculators", 48, [2, 24, 45], SPEC_KEEP),
    "modelopt_maverick": (MODELOPT, "eagle", 48, [2, 24, 45],
                          {"top": ["eagle_config"], "layer": ["attention_dropout", "initializer_range",
                                                              "pretraining_tp", "transformers_version"]}),
    "speculators_36_layers_gpt_oss_120b_shaped": (
        _speculators([2, 18, 34], "openai/gpt-oss-120b", {"base_model_ep_plan": None}, norm_before_fc=True),
        "speculators", 36, [2, 18, 34], {"top": [*SPEC_KEEP["top"], "base_model_ep_plan"], "layer": SPEC_KEEP["layer"]}),
    "speculators_qwen3_8b_shaped": (
        _speculators([2, 18, 33], "Qwen/Qwen3-8B", {}, norm_before_residual=True), "speculators", 36, [2, 18, 33],
        SPEC_KEEP),
}  # fmt: skip


def target_config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0)  # fmt: skip


def make_checkpoint(folder: Path, config: dict, fmt: str, num_layers: int) -> torch.Tensor:
    """Write `config` and random weights of its shapes to `folder`; returns the target embedding [V, H]."""
    torch.manual_seed(0)
    cfg = config_from_dict(copy.deepcopy(config), fmt, target_config(num_layers))
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    drafter.set_vocab_mapping(torch.randperm(V)[:VD].sort().values)
    folder.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file(drafter_state_dict(drafter, fmt, include_embedding=False), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return drafter.embed_tokens.weight.detach().clone()


@torch.no_grad()
def decode_steps(drafter: Eagle3Drafter, steps: int = 3, t: int = 5) -> torch.Tensor:
    """Draft logits of `steps` chained drafting steps (first from target features, then from its own output)."""
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, t, 3 * drafter.config.resolved_target_hidden_size, generator=g)  # [1, T, 3H]
    ids = torch.randint(0, V, (1, t + steps), generator=g)
    cache, out, logits = DrafterKV(), None, []
    for k in range(steps):
        pos = torch.arange(t)[None] + k
        mask = None
        if k:  # causal over step-0 keys plus each row's own keys of the later steps
            mask = torch.cat([torch.ones(t, t, dtype=torch.bool).tril()]
                             + [torch.eye(t, dtype=torch.bool)] * k, dim=1)[None, None]  # fmt: skip
        hidden = drafter.combine(aux) if k == 0 else drafter.feedback(out)
        out = drafter(hidden, ids[:, k:k + t], pos, mask=mask, cache=cache)
        logits.append(drafter.logits(out))
    return torch.cat(logits, dim=1).float()  # [1, steps*T, Vd]


def _kept_in(config: dict, fmt: str, source: dict, source_fmt: str, keep: dict) -> None:
    """Every unknown key of `source` is in the exported `config`, with its value, where `fmt` keeps it."""
    src_layer = source.get("transformer_layer_config", source) if source_fmt == "speculators" else source
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    for k in keep["layer"]:
        assert layer[k] == src_layer[k], k
    for k in keep["top"]:
        if k == "eagle_config":
            have = config["eagle_config"]
            assert {f: have[f] for f in MODELOPT_FLAGS} == MODELOPT_FLAGS
        else:
            assert config[k] == source[k], k


@pytest.mark.parametrize("name", list(FIXTURES))
def test_published_layout_loads_decodes_and_exports_with_its_keys(tmp_path, name, capsys):
    config, fmt, num_layers, ids, keep = FIXTURES[name]
    embedding = make_checkpoint(tmp_path / "src", config, fmt, num_layers)
    target_dir = tmp_path / "target"
    target_config(num_layers).save_pretrained(target_dir)

    loaded = load_drafter(tmp_path / "src", target_config=target_config(num_layers), target_embedding=embedding)
    assert (loaded.config.aux_layer_ids, loaded.config.target_num_layers) == (ids, num_layers)
    logits = decode_steps(loaded)
    assert logits.shape == (1, 15, VD) and torch.isfinite(logits).all()

    for out_fmt in ("speculators", "eagle"):
        out = tmp_path / out_fmt
        assert main(["export", "--drafter", str(tmp_path / "src"), "--format", out_fmt, "--out", str(out),
                     "--target", str(target_dir)]) == 0, capsys.readouterr().err  # fmt: skip
        exported = json.loads((out / "config.json").read_text())
        assert exported["eagle3"]["target_num_layers"] == num_layers
        written = (exported["eagle_aux_hidden_state_layer_ids"] if out_fmt == "speculators"
                   else exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"])  # fmt: skip
        assert written == ids
        _kept_in(exported, out_fmt, config, fmt, keep)
        # the export reloads with no target at all, to the same drafter
        again = load_drafter(out, target_embedding=embedding)
        assert (again.config.aux_layer_ids, again.config.target_num_layers) == (ids, num_layers)
        assert again.config.norm_before_residual == loaded.config.norm_before_residual
        torch.testing.assert_close(decode_steps(again), logits, rtol=0, atol=0)


def test_unknown_keys_survive_a_second_conversion(tmp_path):
    """ModelOpt -> speculators -> native: flags and Llama keys the speculators hop interprets come back."""
    make_checkpoint(tmp_path / "src", MODELOPT, "eagle", 48)
    target_dir = tmp_path / "target"
    target_config(48).save_pretrained(target_dir)
    assert main(["export", "--drafter", str(tmp_path / "src"), "--format", "speculators", "--out",
                 str(tmp_path / "spec"), "--target", str(target_dir)]) == 0  # fmt: skip
    assert main(["export", "--drafter", str(tmp_path / "spec"), "--format", "eagle", "--out",
                 str(tmp_path / "back")]) == 0  # fmt: skip
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    for k, v in MODELOPT.items():
        if k not in ("eagle_config", "architectures", "torch_dtype") and v is not None:  # None ids: not written
            assert back[k] == v, k
    assert {f: back["eagle_config"][f] for f in MODELOPT_FLAGS} == MODELOPT_FLAGS


def test_one_maverick_drafter_reads_the_same_layers_from_both_files():
    """NVIDIA's native file and RedHat's speculators copy both say [1, 23, 44] (ModelOpt's 'output of layer X')."""
    native = config_from_dict(copy.deepcopy(MODELOPT), target_config=target_config(48))
    spec = config_from_dict(copy.deepcopy(FIXTURES["speculators_maverick"][0]), target_config=target_config(48))
    assert native.aux_layer_ids == spec.aux_layer_ids == [2, 24, 45]
    assert native.target_num_layers == spec.target_num_layers == 48


def test_layer_count_comes_from_the_target_not_the_ids(tmp_path, capsys):
    """[2, 18, 34] are the EAGLE-3 default of 37 layers; the gpt-oss-120B-shaped target has 36."""
    config, fmt, _, _, _ = FIXTURES["speculators_36_layers_gpt_oss_120b_shaped"]
    make_checkpoint(tmp_path / "src", config, fmt, 36)
    assert read_checkpoint(tmp_path / "src")[0].target_num_layers == 37  # loading alone can only guess
    assert main(["export", "--drafter", str(tmp_path / "src"), "--format", "eagle", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagle3: error:") and "--target" in err and not (tmp_path / "x").exists()


def test_export_without_ids_or_target_says_to_pass_target(tmp_path, capsys):
    make_checkpoint(tmp_path / "src", SAFEAILAB, "eagle", 32)
    assert main(["export", "--drafter", str(tmp_path / "src"), "--format", "speculators", "--out",
                 str(tmp_path / "x")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("eagle3: error:") and "pass --target MODEL" in err


def test_export_refuses_a_target_of_another_depth(tmp_path, capsys):
    make_checkpoint(tmp_path / "src", MODELOPT, "eagle", 48)
    target_config(32).save_pretrained(tmp_path / "target")
    assert main(["export", "--drafter", str(tmp_path / "src"), "--format", "speculators", "--out",
                 str(tmp_path / "x"), "--target", str(tmp_path / "target")]) == 2  # fmt: skip
    assert "eagle3: error:" in capsys.readouterr().err


def test_ignored_flags_are_named_once(monkeypatch, caplog):
    monkeypatch.setattr(formats_configs, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="eagle3.formats"):
        config_from_dict(copy.deepcopy(MODELOPT), target_config=target_config(48))
        config_from_dict(copy.deepcopy(MODELOPT), target_config=target_config(48))
    warned = [r.getMessage() for r in caplog.records if "not interpreted" in r.getMessage()]
    assert len(warned) == 1
    for flag in MODELOPT_FLAGS:
        assert f"eagle_config.{flag}" in warned[0]
    assert "initializer_range" not in warned[0] and "transformers_version" not in warned[0]  # metadata: silent
