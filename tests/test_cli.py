"""The `eagle3` command line end to end on the bundled stories260K: generate (every draft kind), init-drafter,
export, and clear errors (exit code 2, a message naming the problem) for bad input."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch
from safetensors.torch import load_file

from eagle3.cli import main
from eagle3.config import DraftShape

# fp32: every engine and draft kind rounds alike (the device's dtype is `tests/test_defaults.py`'s)
PROMPT = ["--target", "stories260k", "--prompt", "Once upon a time", "--max-new-tokens", "24", "--dtype", "float32"]


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", *PROMPT, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def random_drafter(tmp_path_factory):
    out = tmp_path_factory.mktemp("d") / "drafter"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(out), "--draft-vocab-size", "256"]) == 0
    return out


def test_generate_every_draft_kind_gives_the_same_text(capsys, random_drafter):
    plain = run_json(capsys, "--draft", "none")
    assert plain["text"].startswith(", there was a little girl named Lily")
    assert plain["tau"] == 1.0 and plain["new_tokens"] == 24
    for args in (["--draft", "ngram"], ["--drafter", str(random_drafter)],
                 ["--drafter", str(random_drafter), "--chain", "3"], ["--draft-model", "stories260k"]):
        out = run_json(capsys, *args)
        assert out["token_ids"] == plain["token_ids"], args
        assert {"text", "token_ids", "tau", "acceptance_per_position", "tokens_per_s"} <= set(out)
    for engine in ("fast", "generic", "auto"):  # auto is the generic engine on a CPU
        out = run_json(capsys, "--drafter", str(random_drafter), "--engine", engine)
        assert out["token_ids"] == plain["token_ids"], engine
    # the target drafting for itself is always right: a chain of 5 emits 6 tokens per target pass
    selfd = run_json(capsys, "--draft-model", "stories260k", "--chain", "5")
    assert selfd["acceptance_per_position"] == [1.0] * 5 and selfd["tau"] > 5


def test_no_graphs_on_the_generic_engine_warns_and_fast_variants_keep_the_text(capsys, caplog, monkeypatch,
                                                                               random_drafter):
    """`--no-graphs` says so when the generic engine runs (auto on a CPU), and changes nothing; the fast path's
    variants (library options: `FastOptions.graph_prefill`) emit the same tokens."""
    from dataclasses import replace

    import eagle3.runtime

    caplog.clear()
    plain = run_json(capsys, "--drafter", str(random_drafter), "--engine", "generic")
    assert "no effect" not in caplog.text
    out = run_json(capsys, "--drafter", str(random_drafter), "--no-graphs")
    assert out["token_ids"] == plain["token_ids"]
    assert "--no-graphs has no effect" in caplog.text
    real = eagle3.runtime.decoder
    for variant in ({"graph_prefill": True},):  # prompts padded into fixed prefill buckets
        caplog.clear()
        monkeypatch.setattr(eagle3.runtime, "decoder",
                            lambda rt, d, options=None, v=variant: real(rt, d, options and replace(options, **v)))
        out = run_json(capsys, "--drafter", str(random_drafter), "--engine", "fast")
        assert out["token_ids"] == plain["token_ids"] and "no effect" not in caplog.text, variant


def test_export_both_formats_and_generate_from_them(capsys, random_drafter, tmp_path):
    ref = run_json(capsys, "--drafter", str(random_drafter))
    for fmt in ("speculators", "eagle"):
        out = tmp_path / fmt
        assert main(["export", "--drafter", str(random_drafter), "--format", fmt, "--out", str(out)]) == 0
        cfg = json.loads((out / "config.json").read_text())
        assert ("speculators_config" in cfg) == (fmt == "speculators")
        capsys.readouterr()
        assert run_json(capsys, "--drafter", str(out))["token_ids"] == ref["token_ids"]



def test_export_in_bf16_without_the_embedding(capsys, random_drafter, tmp_path):
    """The compact form the bundled drafter ships in: bf16 weights, no embedding (taken from the target)."""
    ref = run_json(capsys, "--drafter", str(random_drafter))
    out = tmp_path / "compact"
    assert main(["export", "--drafter", str(random_drafter), "--format", "speculators", "--out", str(out),
                 "--dtype", "bfloat16", "--no-embedding"]) == 0
    tensors = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in tensors and tensors["fc.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    capsys.readouterr()
    assert run_json(capsys, "--drafter", str(out))["token_ids"] == ref["token_ids"]

@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tree", "6,10"], "DEPTH,TOPK,TOTAL"),
        (["--tree", "0,10,60"], "must all be >= 1"),
        (["--temperature", "-1"], "temperature"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--draft", "eagle3"], "--drafter"),
        (["--draft", "model"], "--draft-model"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, args, needle):
    assert main(["generate", *PROMPT, *args]) == 2
    assert needle in capsys.readouterr().err


def test_draft_shape_reads_flags_and_stored_profiles():
    """`--tree D,K,N` and `--chain K` give one `DraftShape`; its JSON form is the profile's `spec`, and the profiles
    drafters already carry (the bundled one stores the CPU default: a chain of up to 6 stopping below 0.2) read
    back."""
    assert DraftShape.from_flags(None, None) is None and DraftShape.from_flags("6,10,60") == DraftShape()
    assert DraftShape.from_flags(chain=5) == DraftShape(5, 1, 5) and str(DraftShape.chain(5)) == "chain 5"
    assert DraftShape.parse("2,2,100").text == "2,2,6"  # the expansion records 2 + 2·2 nodes
    bundled = json.loads((resources.files("eagle3") / "assets/smollm2-drafter/config.json").read_text())
    profile = bundled["eagle3"]["acceptance_profile"]
    stored = profile["spec"]
    assert stored == {"mode": "chain", "chain_length": 6} and DraftShape.from_dict(stored) == DraftShape.chain(6)
    assert profile["chain_stop"] == 0.2
    tree = {"mode": "tree", "depth": 4, "top_k": 3, "total_tokens": 12}
    assert DraftShape.from_dict(tree) == DraftShape(4, 3, 12) and DraftShape(4, 3, 12).to_dict() == tree


def test_drafter_for_another_target_is_refused(capsys, tmp_path, tiny_target):
    # a drafter shaped for a tiny Llama (hidden 64, vocab 300) cannot drive stories260K (hidden 64, vocab 512)
    from eagle3.formats import save_drafter
    from eagle3.runtime import init_drafter

    model = tiny_target("llama")
    model.config._name_or_path = "tiny-llama"
    save_drafter(init_drafter(model), tmp_path / "d")
    assert main(["generate", *PROMPT, "--drafter", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "vocab" in err and "300" in err and "512" in err


def test_train_flags_take_their_defaults_from_train_config():
    from eagle3.cli import build_parser
    from eagle3.training.config import TrainConfig

    args = build_parser().parse_args(["train", "--target", "t", "--data", "d", "--out", "o"])
    cfg = TrainConfig(target="t", data="d", out="o")
    for name in ("ttt_steps", "lr", "warmup_ratio", "epochs", "grad_accum", "max_length", "seed", "save_every",
                 "log_every", "features", "noise", "max_steps", "time_budget", "intermediate_size", "label_temperature",
                 "step_decay", "align_top_k"):
        assert getattr(args, name) == getattr(cfg, name), name


def test_eval_reports_each_prompt_and_tau_by_category(capsys, random_drafter, tmp_path):
    """`eagle3 eval` on a JSONL with MT-bench-style categories: a JSON report whose run keeps one row per prompt
    (tokens, cycles, tau) and tau per category, consistent with the run's own counts; the same file without
    categories gets rows but no categories."""
    rows = [("Once upon a time", "story"), ("Lily went to", "story"), ("The cat", "animal")]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"turns": [p], "category": c}) + "\n" for p, c in rows))
    out = tmp_path / "eval"
    assert main(["eval", "--target", "stories260k", "--drafter", str(random_drafter), "--datasets", str(data),
                 "--max-new-tokens", "12", "--chain", "3", "--temperatures", "0", "--out", str(out)]) == 0
    assert "by category: story" in capsys.readouterr().out
    report = json.loads((out / "eval.json").read_text())
    # what ran is in the record: the device's defaults, bf16 on the fast engine where a CPU has native bf16
    assert report["engine_settings"]["engine"] == report["engine"] == ("fast" if report["dtype"] == "bfloat16"
                                                                       else "generic")
    run = report["runs"][0]
    per = run["per_prompt"]
    assert [r["category"] for r in per] == ["story", "story", "animal"] and run["prompts"] == 3
    assert sum(r["cycles"] for r in per) == run["cycles"] and sum(r["new_tokens"] for r in per) == run["new_tokens"]
    assert run["tau"] == round(sum(r["cycle_tokens"] for r in per) / run["cycles"], 4)
    story = per[:2]
    assert run["tau_by_category"] == {
        "story": round(sum(r["cycle_tokens"] for r in story) / sum(r["cycles"] for r in story), 4),
        "animal": round(per[2]["cycle_tokens"] / per[2]["cycles"], 4)}
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _ in rows))
    assert main(["eval", "--target", "stories260k", "--drafter", str(random_drafter), "--datasets", str(data),
                 "--max-new-tokens", "12", "--chain", "3", "--temperatures", "0", "--limit", "2", "--out", str(out)]) == 0
    run = json.loads((out / "eval.json").read_text())["runs"][0]
    assert "tau_by_category" not in run and len(run["per_prompt"]) == 2 and "category" not in run["per_prompt"][0]
