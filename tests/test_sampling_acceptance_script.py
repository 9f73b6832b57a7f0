"""`scripts/sampling_acceptance.py`: the first draft's acceptance per drafting rule and temperature, on stories260K
with a random drafter, is a well-formed run record whose numbers obey the rules' invariants."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

KS = (1, 4, 10)


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sampling_acceptance_script_record_obeys_the_rules_invariants(tmp_path, capsys):
    mod = script("sampling_acceptance")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n{"prompt": "Lily had a dog"}\n')
    out = tmp_path / "sacc.json"
    assert mod.main(["--target", "stories260k", "--drafter", "random", "--prompts", str(prompts), "--limit", "2",
                     "--max-new-tokens", "12", "--temperatures", "0", "0.7", "1.0", "--samples", "8",
                     "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["kind"] == "sampling_acceptance" and rec["argv"][1:3] == ["--target", "stories260k"]
    assert list(rec["results"]) == ["T=0", "T=0.7", "T=1"]
    eps = 1e-3  # rounding to 4 decimals
    for t, r in rec["results"].items():
        assert 0 < r["positions"] <= 2 * 11  # answer tokens after the first
        probs = ["TV", "spec_sampling", "replay", *(f"{rule}_top{k}" for rule in ("point", "coupled", "oracle")
                                                     for k in KS)]
        assert all(-eps <= r[key]["mean"] <= 1 + eps for key in probs), t
        assert r["H_p"]["mean"] >= 0 and r["H_q"]["mean"] >= 0
        for rule in ("point", "coupled", "oracle"):
            rates = [r[f"{rule}_top{k}"]["mean"] for k in KS]
            assert rates == sorted(rates), (t, rule, rates)  # more drafts never accept less
        assert r["point_top1"]["mean"] <= r["oracle_top1"]["mean"] + eps
        assert abs(r["spec_sampling"]["mean"] - (1 - r["TV"]["mean"])) <= eps
        assert r["replay"]["mean"] == 1.0  # the answer's own seed redraws the answer: positions line up
        qs = r["TV"]["quantiles"]
        assert qs["p10"] <= qs["p50"] <= qs["p90"]
        shares = [g["share"] for g in r["by_target_entropy"].values()]
        assert abs(sum(shares) - 1) <= eps
    greedy = rec["results"]["T=0"]
    assert greedy["H_p"]["mean"] == 0 and greedy["oracle_top1"]["mean"] == 1
    assert all(greedy[f"coupled_top{k}"]["mean"] == greedy[f"point_top{k}"]["mean"] for k in KS)  # noise plays no part at T=0
    assert greedy["spec_sampling"]["mean"] == greedy["point_top1"]["mean"]  # one-hot p and q: 1-TV = p(argmax q)
    assert "(c) coupled top-1" in capsys.readouterr().out
