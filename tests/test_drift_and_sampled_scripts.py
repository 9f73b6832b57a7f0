"""`scripts/sampled_drafting.py`, `scripts/policy_drift.py` and `scripts/captured_drafting_acceptance.py` on
stories260K with a few steps: well-formed run records whose numbers obey their invariants (sampled answers
identical to plain sampling; taus of at least 1; constrained answers alike with either drafting masks)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from eagle3.cli import main as eagle3


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sampled_drafting_compares_both_rules_against_plain_decoding(tmp_path):
    drafter = tmp_path / "d"
    assert eagle3(["init-drafter", "--target", "stories260k", "--out", str(drafter), "--device", "cpu"]) == 0
    out = tmp_path / "s.json"
    assert script("sampled_drafting").main(["--target", "stories260k", "--drafter", str(drafter), "--device", "cpu",
                                            "--limit", "2", "--max-new-tokens", "12", "--temperatures", "0", "1",
                                            "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["temperature"], r["drafts"]) for r in rows] == [
        (0.0, "top-k drafts"), (0.0, "coupled drafts"), (1.0, "top-k drafts"), (1.0, "coupled drafts")]
    assert all(r["identical"] == r["prompts"] == 2 and r["tau"] >= 1.0 and r["speedup"] > 0 for r in rows)


def test_policy_drift_runs_the_loop_and_records_every_tau(tmp_path):
    out = tmp_path / "drift.json"
    assert script("policy_drift").main(["--first-steps", "3", "--budget", "2", "--policy-steps", "3",
                                        "--max-new-tokens", "12", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    taus = [rec[k] for k in ("tau_old_on_v1", "tau_old_on_v2", "tau_adapted_on_v2", "tau_scratch_on_v2")]
    assert all(t >= 1.0 for t in taus) and rec["steps"] == {"first": 3, "adapted": 2, "scratch": 2}
    assert rec["recovered"] == round(rec["tau_adapted_on_v2"] / rec["tau_old_on_v1"], 3)


def test_captured_drafting_acceptance_compares_both_masks(tmp_path):
    drafter = tmp_path / "d"
    assert eagle3(["init-drafter", "--target", "stories260k", "--out", str(drafter), "--device", "cpu"]) == 0
    out = tmp_path / "c.json"
    assert script("captured_drafting_acceptance").main(["--target", "stories260k", "--drafter", str(drafter),
                                                        "--limit", "2", "--max-new-tokens", "16",
                                                        "--shapes", "3", "2,2,4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["chain 3", "tree 2,2,4"]
    assert all(r["same_answers"] == r["prompts"] == 2 for r in rows)
    assert all(r["tau_forced_path"] >= r["tau_next_token_only"] >= 1.0 for r in rows)
