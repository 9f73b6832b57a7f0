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
                                                     for k in KS), "rrs_top4", "rrs_top10"]
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
    assert all(greedy[f"rrs_top{k}"]["mean"] == greedy[f"point_top{k}"]["mean"] for k in KS[1:])
    assert "(c) coupled top-1" in capsys.readouterr().out


def test_recursive_rejection_acceptance_in_cases_with_known_answers():
    """One draft: 1 - TV(p, q), the speculative-sampling rate; q = p: always accepted; disjoint supports: never;
    p uniform on the q-ranked tokens and k drafts covering its support: always."""
    import torch

    mod = script("sampling_acceptance")
    g = torch.Generator().manual_seed(0)
    p = torch.randn(64, 50, generator=g).softmax(-1)
    q = (2 * torch.randn(64, 50, generator=g)).softmax(-1)
    one = mod.recursive_rejection(p, q, 1, g)
    # with one draft the coins integrate to sum_x q(x) min(1, p/q) = 1 - TV only in expectation over the draft
    mean = torch.stack([mod.recursive_rejection(p, q, 1, g) for _ in range(400)]).mean(0)
    torch.testing.assert_close(mean, 1 - 0.5 * (p - q).abs().sum(-1), atol=0.08, rtol=0)
    assert one.shape == (64,)
    assert torch.allclose(mod.recursive_rejection(p, p, 4, g), torch.ones(64))
    left = torch.zeros(2, 6)
    left[:, :3] = 1 / 3
    right = left.flip(-1)
    assert torch.equal(mod.recursive_rejection(left, right, 3, g), torch.zeros(2))
    assert torch.allclose(mod.recursive_rejection(left, left * 0.5 + right * 0.5, 6, g), torch.ones(2))
    # worked by hand: p = (.6, .4, 0), q = (.2, .2, .6), two drafts. The first is token 2 w.p. .6 and rejected;
    # then p' = (2/3, 1/3, 0), q' = (.5, .5, 0), accepted w.p. .5 + .5 * 2/3. In all .4 + .6 * 5/6 = .9
    # (without the residual update: .94)
    p3, q3 = torch.tensor([[0.6, 0.4, 0.0]]).expand(4000, -1), torch.tensor([[0.2, 0.2, 0.6]]).expand(4000, -1)
    assert abs(float(mod.recursive_rejection(p3, q3, 2, g).mean()) - 0.9) < 0.015
