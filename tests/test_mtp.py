"""`--draft mtp`: targets drafting with their own multi-token-prediction layer (`eagle3.decoding.mtp`).

Tiny random DeepSeek-V3 checkpoints (fp32, CPU) with `num_nextn_predict_layers=1`, their MTP module stored in the
safetensors under the published names (`model.layers.{L}.enorm/hnorm/eh_proj/shared_head.*/embed_tokens` and the
decoder layer's own per-expert names), loaded through `eagle3.models.load_target`:

- random MTP weights: greedy output equals HF `generate(do_sample=False)` token for token (chain and tree), sampled
  output equals plain sampling with the same seed; tau is measured (near 1 with random weights);
- a "copying" checkpoint: every attention and MLP output projection of the target is zero, so the target predicts
  from the current token alone (lm_head(norm(embed(x)))), and the MTP module is set to compute the same function of
  its input token (eh_proj = [I | 0], its block's output projections zero): its drafts are the target's own
  predictions, so they are accepted (tau > 1);
- a checkpoint without MTP tensors gives `eagle3: error: ...` naming what is missing;
- Qwen3-Next (hybrid linear attention), its MTP stored as `mtp.*` and declared as `mtp_num_hidden_layers`: greedy
  chains equal HF `generate`, sampled chains plain sampling, the copying checkpoint's drafts are accepted, trees
  are refused and no shape flag gives a chain.
Run: pytest tests/test_mtp.py
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from eagle3.cli import main
from eagle3.config import ConfigError, DraftShape, SamplingConfig
from eagle3.decoding.engine import SpeculativeEngine
from eagle3.decoding.mtp import mtp_proposer
from eagle3.decoding.proposers import NoDraftProposer
from eagle3.models import STORIES260K_DIR, load_target
from eagle3.runtime import load_runtime
from eagle3.target import Target

NEW = 20
L = 4  # decoder layers of the tiny target; the MTP module is layer L in the checkpoint
# vocab 512: the bundled stories260K tokenizer (the CLI test encodes text) has 512 tokens
_CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=1024, initializer_range=0.3, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, tie_word_embeddings=False,
)
SAMPLED = SamplingConfig(temperature=0.9, top_p=0.95, top_k=50, seed=7)


def _zero_outputs(model) -> None:
    """Zero every attention and MLP output projection: each decoder layer then adds nothing to the residual."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.zero_()


def make_checkpoint(folder, mtp: str | None, seed: int = 0):
    """A DeepSeek-V3 checkpoint folder; `mtp` None (no MTP tensors), "random" or "copy" (module docstring)."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**_CONFIG, num_nextn_predict_layers=1)
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    if mtp == "copy":
        _zero_outputs(model)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(STORIES260K_DIR / name, folder)
    if mtp is None:
        return folder
    weights = folder / "model.safetensors"
    sd = load_file(weights)
    h, p = config.hidden_size, f"model.layers.{L}."
    g = torch.Generator().manual_seed(seed + 1)
    # the MTP block is an MoE decoder layer stored with the published per-expert names, as layer 1 is
    block = {k.replace("model.layers.1.", p): v.clone() for k, v in sd.items() if k.startswith("model.layers.1.")}
    if mtp == "random":
        block = {k: torch.randn(v.shape, generator=g) * 0.3 if v.dim() > 1 else v for k, v in block.items()}
    extra = {
        p + "enorm.weight": torch.ones(h),
        p + "hnorm.weight": torch.ones(h),
        p + "shared_head.norm.weight": sd["model.norm.weight"].clone(),
        p + "shared_head.head.weight": sd["lm_head.weight"].clone(),
        p + "embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
    }
    if mtp == "random":
        extra[p + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.2
    else:  # u = enorm(embed(x)): the block adds nothing, so out = norm(embed(x)) as the target computes
        extra[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    save_file({**sd, **block, **extra}, weights, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {kind: make_checkpoint(tmp_path_factory.mktemp(f"ds_{kind}"), None if kind == "plain" else kind)
            for kind in ("random", "copy", "plain")}


@pytest.fixture(scope="module")
def targets(folders):
    return {kind: load_target(folders[kind])[0] for kind in ("random", "copy")}


def prompt(n: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed))


def run(model, spec: DraftShape, sampling: SamplingConfig | None = None, draft: bool = True):
    target = Target(model, [L])
    try:
        prop = mtp_proposer(model, spec) if draft else NoDraftProposer()
        return SpeculativeEngine(target, prop).generate(prompt(), max_new_tokens=NEW, sampling=sampling)
    finally:
        target.close()


CHAIN = DraftShape.chain(4)
TREE = DraftShape(4, 3, 12)


@pytest.mark.parametrize("kind", ["random", "copy"])
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_matches_hf_generate(targets, kind, spec):
    model = targets[kind]
    ids = prompt()
    ref = model.generate(ids[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, ids.numel():].tolist()
    res = run(model, spec)
    print(f"mtp {kind} {spec}: tau {res.stats.tau:.2f}, accepted per cycle {res.stats.accepted_per_cycle}")
    assert res.token_ids == ref
    if kind == "copy":  # the drafts are the target's own predictions
        assert res.stats.tau > 3.0


@pytest.mark.parametrize("kind", ["random", "copy"])
def test_sampled_equals_plain_sampling_with_the_same_seed(targets, kind):
    model = targets[kind]
    plain = run(model, CHAIN, SAMPLED, draft=False)
    res = run(model, CHAIN, SAMPLED)
    assert res.token_ids == plain.token_ids
    print(f"mtp {kind} sampled: tau {res.stats.tau:.2f}")
    if kind == "copy":  # drafts coupled to the target's draws at the drafted positions (one off: tau 1.27)
        assert res.stats.tau > 3.0


def test_runtime_and_cli(folders, capsys):
    rt = load_runtime(str(folders["random"]), draft="mtp", spec=CHAIN)
    assert rt.draft == "mtp" and rt.target.aux_layer_ids == [L]
    assert main(["generate", "--target", str(folders["copy"]), "--draft", "mtp", "--chain", "3", "--prompt", "Once",
                 "--max-new-tokens", "8", "--json"]) == 0
    assert '"draft": "mtp"' in capsys.readouterr().out


def test_a_target_without_mtp_weights_is_refused(folders, capsys):
    with pytest.raises(ConfigError, match=r"no multi-token-prediction \(MTP\) weights.*model\.layers\.4\.\*"):
        load_runtime(str(folders["plain"]), draft="mtp", spec=CHAIN)
    assert main(["generate", "--target", str(folders["plain"]), "--draft", "mtp", "--prompt", "Once"]) == 2
    err = capsys.readouterr().err
    assert "eagle3: error:" in err and "Traceback" not in err


def test_the_first_row_equals_transformers_mtp_model(targets):
    """The MTP output of the prompt's last row, from the tapped final-norm input, equals transformers' own
    `MtpModel.forward_layer` given the target's `hidden_states[-1]` (post-norm) and its `MtpCache`: same hidden
    state, token pairing and positions."""
    from transformers.cache_utils import MtpCache

    model, ids = targets["random"], prompt()
    prop = mtp_proposer(model, CHAIN)
    target = Target(model, [L])
    try:
        with torch.inference_mode():
            out = model(ids[None], output_hidden_states=True)
            first = int(out.logits[0, -1].argmax())
            x = torch.cat([ids[1:], torch.tensor([first])])[None]  # x_1..x_T
            ref = prop.drafter.mtp.forward_layer(0, out.hidden_states[-1], torch.arange(1, ids.numel() + 1)[None],
                                                 MtpCache(config=model.config.get_mtp_config()), input_ids=x)
            _, aux = target.forward(ids[None], target.new_cache(), logits_to_keep=1)
            prop.begin(ids, aux, first)
    finally:
        target.close()
    torch.testing.assert_close(prop.last_out, ref[:, -1], rtol=1e-5, atol=1e-5)


# -- Qwen3-Next: MTP stored as `mtp.*`, declared as `mtp_num_hidden_layers`, on a hybrid target (chains) --------
QWEN_NEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.3, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    mlp_only_layers=[], tie_word_embeddings=False,
)


def make_qwen_next_checkpoint(folder, mtp: str, seed: int = 0):
    """A Qwen3-Next checkpoint with the published MTP layout: `mtp_num_hidden_layers: 1` in config.json and the
    tensors `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (a full-attention
    MoE layer, per-expert names) and `mtp.norm`; `mtp` "random" or "copy" (as `make_checkpoint`: every output
    projection of the target zero, the MTP module computing the same function of its input token)."""
    import json

    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**QWEN_NEXT)).to(torch.float32).eval()
    if mtp == "copy":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
                    p.zero_()
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1  # as Qwen/Qwen3-Next-80B-A3B-Instruct's config.json declares it
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(STORIES260K_DIR / name, folder)
    weights = folder / "model.safetensors"
    sd = load_file(weights)
    h = QWEN_NEXT["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)
    block = {k.replace("model.layers.1.", "mtp.layers.0."): v.clone() for k, v in sd.items()
             if k.startswith("model.layers.1.")}  # layer 1 is a full-attention MoE layer
    if mtp == "random":
        block = {k: torch.randn(v.shape, generator=g) * 0.3 if v.dim() > 1 else v for k, v in block.items()}
    extra = {  # zero-centred norms (weight 0: scale 1)
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(h),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(h),
        "mtp.norm.weight": sd["model.norm.weight"].clone(),
        "mtp.fc.weight": (torch.randn(h, 2 * h, generator=g) * 0.2 if mtp == "random"
                          else torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)),
    }
    save_file({**sd, **block, **extra}, weights, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def qwen_next(tmp_path_factory):
    return {kind: load_target(make_qwen_next_checkpoint(tmp_path_factory.mktemp(f"qn_{kind}"), kind))[0]
            for kind in ("random", "copy")}


@pytest.mark.parametrize("kind", ["random", "copy"])
def test_qwen3_next_mtp_chains_match_hf_generate(qwen_next, kind):
    """Greedy chains drafted by Qwen3-Next's own MTP layer equal HF `generate`, the recurrent state rolled back to
    the last accepted token each cycle; the copying checkpoint's drafts are accepted. Sampled chains equal plain
    sampling with the same seed."""
    model = qwen_next[kind]
    layers = QWEN_NEXT["num_hidden_layers"]
    ids = prompt()
    ref = model.generate(ids[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, ids.numel():].tolist()
    target = Target(model, [layers])
    try:
        res = SpeculativeEngine(target, mtp_proposer(model, CHAIN)).generate(ids, max_new_tokens=NEW)
        plain = SpeculativeEngine(target, NoDraftProposer()).generate(ids, max_new_tokens=NEW, sampling=SAMPLED)
        sampled = SpeculativeEngine(target, mtp_proposer(model, CHAIN)).generate(ids, max_new_tokens=NEW,
                                                                              sampling=SAMPLED)
    finally:
        target.close()
    print(f"qwen3-next mtp {kind}: tau {res.stats.tau:.2f}, accepted per cycle {res.stats.accepted_per_cycle}")
    assert res.token_ids == ref
    assert sampled.token_ids == plain.token_ids
    if kind == "copy":
        assert res.stats.tau > 3.0


def test_qwen3_next_mtp_weights_land_where_the_published_names_say(qwen_next):
    """`mtp.fc` is the projection over [embedding, hidden] (in that order), `pre_fc_norm_embedding` /
    `pre_fc_norm_hidden` the norms before it, `mtp.norm` the one after the block; the block is a full-attention
    layer whatever the target's layer types."""
    from eagle3.decoding.mtp import load_mtp

    model = qwen_next["random"]
    layer = load_mtp(model).layers[0]
    assert model.config.num_mtp_layers == 1 and model.config.mtp_layer_types == ["full_attention"]
    assert layer.eh_proj.weight.shape == (64, 128) and not torch.equal(layer.eh_proj.weight[:, :64],
                                                                       layer.eh_proj.weight[:, 64:])
    assert hasattr(layer.mtp_block, "self_attn") and not hasattr(layer.mtp_block, "linear_attn")
    torch.testing.assert_close(layer.post_norm.weight, model.model.norm.weight)
    assert not layer.enorm.weight.any() and not layer.hnorm.weight.any()


def test_qwen3_next_mtp_trees_are_refused(qwen_next, capsys):
    """Trees would need the recurrent state forked per branch: refused with what to do."""
    with pytest.raises(ConfigError, match="chain"):
        target = Target(qwen_next["random"], [QWEN_NEXT["num_hidden_layers"]])
        try:
            SpeculativeEngine(target, mtp_proposer(qwen_next["random"], TREE)).generate(prompt(), max_new_tokens=4)
        finally:
            target.close()


def test_qwen3_next_mtp_with_no_shape_flag_drafts_a_chain(tmp_path, capsys):
    """With no --tree or --chain, a hybrid target gets a chain (the default tree would be refused)."""
    folder = make_qwen_next_checkpoint(tmp_path / "qn", "copy")
    rt = load_runtime(str(folder), draft="mtp")
    assert rt.spec.is_chain
    assert main(["generate", "--target", str(folder), "--draft", "mtp", "--prompt", "Once", "--max-new-tokens", "8",
                 "--json"]) == 0
    assert '"mode": "chain"' in capsys.readouterr().out


def test_served_mtp_rows_answer_as_plain_serving(folders, capsys):
    """`eagle3 serve --draft mtp`: the target's MTP layer drafts for a batch of rows (one `Eagle3BatchDrafter` on
    the HF rows); 8 concurrent greedy clients get plain serving's answers, and the copying MTP layer's drafts are
    accepted. The fast rows draft EAGLE-3 only: asking for them with MTP is refused."""
    import argparse
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from eagle3.serving.cli import add_serve_parser, load_server
    from eagle3.serving.server import ServerThread

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    prompts = ["Once upon a time", "Lily", "The dog ran", "Tom had a ball", "One day", "Sam and Mia", "A cat",
               "The end"]
    answers, accepted = {}, {}
    for kind, extra in (("plain", ["--no-spec"]), ("mtp", ["--draft", "mtp", "--chain", "3"])):
        sched, app = load_server(parser.parse_args(["serve", "--target", str(folders["copy"]), "--device", "cpu",
                                                    *extra]))
        srv = ServerThread(app, shutdown_timeout=10).start()
        try:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

            def one(p, c=c, name=sched.config.model_name):
                return c.completions.create(model=name, prompt=p, max_tokens=12, temperature=0).choices[0].text

            with ThreadPoolExecutor(len(prompts)) as pool:
                answers[kind] = list(pool.map(one, prompts, timeout=120))
            snap = sched.metrics.snapshot()
            accepted[kind] = snap.get("eagle3_accepted_tokens_total", 0)
            assert snap["eagle3_batch_size_sum"] > snap["eagle3_batch_size_count"]  # rows decoded together
        finally:
            srv.stop()
    assert answers["mtp"] == answers["plain"]
    assert accepted["plain"] == 0 and accepted["mtp"] > len(prompts)
    assert main(["serve", "--target", str(folders["copy"]), "--device", "cpu", "--draft", "mtp",
                 "--fast-rows", "on"]) == 2
    assert "eagle3: error: --draft mtp drafts on the HF rows" in capsys.readouterr().err
