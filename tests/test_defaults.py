"""One set of decoding defaults per device (`eagle3.defaults`), a tuned choice replacing them, and `eagle3 tune`
end to end on the bundled stories260K: it stores a choice that `generate` then drafts with."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from eagle3.cli import main
from eagle3.config import DraftShape
from eagle3.defaults import CPU_BF16_CHAIN_STOP, decoding_dtype, decoding_for


@pytest.fixture
def llama(stories260k):
    return copy.deepcopy(stories260k[0])


def test_cpu_dtype_follows_native_bf16_and_the_family(llama, tiny_target, monkeypatch):
    monkeypatch.setattr("eagle3.fast.target.cpu_has_bf16", lambda: True)
    assert decoding_dtype(llama, "cpu") == torch.bfloat16
    assert decoding_dtype(tiny_target("gemma3_text"), "cpu") == torch.float32  # no fast engine: fp32 is exact
    assert decoding_dtype(llama, "cpu", "float32") == torch.float32
    monkeypatch.setattr("eagle3.fast.target.cpu_has_bf16", lambda: False)
    assert decoding_dtype(llama, "cpu") == torch.float32


def test_cpu_defaults(llama, tiny_target):
    fp32 = decoding_for(llama, "eagle3")
    assert (fp32.engine, fp32.shape, fp32.chain_stop, fp32.guard) == ("generic", DraftShape.chain(2), None, True)
    bf16 = decoding_for(llama.to(torch.bfloat16), "eagle3")
    assert (bf16.engine, bf16.shape, bf16.chain_stop, bf16.guard) == ("fast", DraftShape.chain(6),
                                                                      CPU_BF16_CHAIN_STOP, True)
    assert decoding_for(tiny_target("gemma3_text").to(torch.bfloat16), "eagle3").engine == "generic"
    flags = decoding_for(llama, "eagle3", shape=DraftShape(4, 2, 6))
    assert (flags.shape, flags.source) == (DraftShape(4, 2, 6), "flags")
    assert not decoding_for(llama, "none").guard


def test_a_tuned_choice_replaces_the_device_default(llama):
    tuned = {"choice": {"shape": DraftShape.chain(4).to_dict(), "chain_stop": None}, "path": "x/tuning.json"}
    d = decoding_for(llama.to(torch.bfloat16), "eagle3", tuned=tuned)
    assert (d.shape, d.chain_stop, d.speculate) == (DraftShape.chain(4), None, True)
    assert "tuned" in d.source
    off = decoding_for(llama, "eagle3", tuned={"choice": {"shape": None}, "path": "x"})
    assert not off.speculate and "plain decoding" in off.describe()


def test_tune_stores_a_choice_that_generate_uses(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    drafter = tmp_path / "d"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(drafter), "--draft-vocab-size", "256"]) == 0
    assert main(["tune", "--target", "stories260k", "--drafter", str(drafter), "--dtype", "float32", "--limit", "1",
                 "--max-new-tokens", "8", "--max-chain", "2", "--trees", "2,2,3", "--out", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "chain 2" in out and "tree 2,2,3" in out
    stored = json.loads((drafter / "tuning.json").read_text())
    (entry,) = stored["entries"]
    choice = entry["choices"]["0.0"]
    record = json.loads((tmp_path / "t" / "tune.json").read_text())
    assert record["kind"] == "tune" and record["entry"]["choice"] == choice and "versions" in record
    measured = {r["shape"]: r["measured_tok_s"] for r in entry["table"]}
    best = max(measured, key=measured.get)
    assert (choice["shape"] is None) == (best == "plain")

    assert main(["generate", "--target", "stories260k", "--drafter", str(drafter), "--dtype", "float32",
                 "--prompt", "Once upon a time", "--max-new-tokens", "8", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "tuned" in ran["drafting"] or choice["shape"] is None
    if choice["shape"] is not None:
        assert ran["spec"] == choice["shape"]
    # another dtype is another entry: the device defaults again
    assert main(["generate", "--target", "stories260k", "--drafter", str(drafter), "--dtype", "bfloat16",
                 "--prompt", "Once upon a time", "--max-new-tokens", "8", "--json"]) == 0
    assert "device defaults" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["drafting"]


def test_tune_times_only_the_default_and_the_best_predicted(tmp_path, capsys):
    """With `--confirm N` (a GPU's default, where each shape compiles its drafting), every shape's acceptance is
    measured and predicted, but only the device's default and the best predicted are timed; the choice is the
    fastest by measurement where timed, else by prediction scaled to the default's measurement (or plain
    decoding)."""
    drafter = tmp_path / "d"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(drafter), "--draft-vocab-size", "256"]) == 0
    assert main(["tune", "--target", "stories260k", "--drafter", str(drafter), "--dtype", "float32", "--limit", "1",
                 "--max-new-tokens", "8", "--max-chain", "3", "--trees", "2,2,3", "--confirm", "2", "--dry-run",
                 "--out", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    entry = json.loads((tmp_path / "t" / "tune.json").read_text())["entry"]
    rows = {r["shape"]: r for r in entry["table"]}
    assert set(rows) == {"plain", "chain 1", "chain 2", "chain 3", "tree 2,2,3"}
    assert all(r["predicted_tok_s"] > 0 for r in rows.values())
    timed = {k for k, r in rows.items() if r["measured_tok_s"] is not None}
    assert {"plain", "chain 2"} <= timed and len(timed) <= 3  # plain, the device's default (chain 2), one more
    scale = rows["chain 2"]["measured_tok_s"] / rows["chain 2"]["predicted_tok_s"]
    for k, r in rows.items():  # untimed: the prediction, scaled as the default's measurement is to its prediction
        want = r["measured_tok_s"] if k in timed else r["predicted_tok_s"] * scale
        assert r["estimated_tok_s"] == pytest.approx(want, rel=1e-3, abs=0.02)
    best = max(rows, key=lambda k: rows[k]["estimated_tok_s"])
    choice = entry["choices"]["0.0"]
    assert choice["shape"] == (None if best == "plain" else rows[best]["spec"])
    assert choice["measured"] == (best in timed)
    assert entry["timed_shapes"] == 2 and " - " in out  # untimed shapes print no measurement
    assert set(entry["phase_seconds"]) == {"load", "acceptance", "costs", "timing"}


@pytest.mark.slow
def test_generate_with_no_flags_is_plain_decoding(capsys, smollm2):
    """The device's defaults (bf16 on the fast engine on CPUs with native bf16, else fp32) give the text plain
    decoding gives in the same dtype."""
    prompt = ["generate", "--target", "smollm2", "--chat", "Name three colours.", "--max-new-tokens", "48", "--json"]
    assert main([*prompt, "--draft", "none"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    drafter = str(files_drafter())
    assert main([*prompt, "--drafter", drafter]) == 0
    eagle = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert eagle["token_ids"] == plain["token_ids"] and eagle["dtype"] == plain["dtype"]
    assert eagle["tau"] > 1.5 and "device defaults" in eagle["drafting"]


def files_drafter():
    from eagle3.demo import bundled_drafter

    return bundled_drafter()


def test_export_writes_the_shape_tuned_on_a_gpu(tmp_path, capsys):
    """`eagle3 export` writes the tuned draft length (an entry measured on a GPU before any other) and prints the
    matching vLLM and SGLang flags."""
    from eagle3.tuning.cache import drafter_store

    drafter = tmp_path / "d"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(drafter), "--draft-vocab-size", "256"]) == 0
    store = drafter_store(drafter)
    for device, shape, when in (("cpu:EPYC:2 threads", DraftShape.chain(2), "2026-12-05T02:00:00Z"),
                                ("cuda:NVIDIA H200", DraftShape.chain(4), "2026-12-05T01:00:00Z")):
        store.store({"key": {"device": device}, "measured_utc": when,
                     "choices": {"0.0": {"shape": shape.to_dict(), "chain_stop": None, "speedup": 2.0}}})
    out = tmp_path / "out"
    assert main(["export", "--drafter", str(drafter), "--format", "speculators", "--out", str(out),
                 "--target", "stories260k"]) == 0
    printed = capsys.readouterr().out
    assert '"num_speculative_tokens": 4' in printed and "--speculative-num-steps 4" in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4


@pytest.mark.parametrize("device,dtype,shape,warned", [
    ("cpu:EPYC:2 threads", "bfloat16", DraftShape(3, 2, 6), True),
    ("cpu:EPYC:2 threads", "bfloat16", DraftShape.chain(5), False),
    ("cpu:EPYC:2 threads", "float32", DraftShape(3, 2, 6), False),
    ("cuda:NVIDIA H100 80GB HBM3", "bfloat16", DraftShape(), False),
])
def test_tune_says_when_its_choice_is_a_bf16_tree_on_a_cpu(tmp_path, capsys, monkeypatch, device, dtype, shape,
                                                           warned):
    """A bf16 tree on a CPU is not guaranteed plain decoding's answers: `tune` says so where it chooses one."""
    from eagle3.tuning import command

    choice = {"shape": shape.to_dict(), "chain_stop": None, "speedup": 2.0}
    entry = {"key": {"device": device, "dtype": dtype}, "choices": {"0.0": choice}, "choice": choice, "table": [],
             "costs": {"plain_s": 0.03, "draft_step_s": {"1": 0.002}}}
    monkeypatch.setattr(command, "run_tune", lambda *a, **k: {"entry": entry, "stored": None, "seconds": 1.0})
    (tmp_path / "d").mkdir()
    assert main(["tune", "--target", "t", "--drafter", str(tmp_path / "d"), "--out", str(tmp_path / "o")]) == 0
    assert ("near-ties" in capsys.readouterr().out) == warned
