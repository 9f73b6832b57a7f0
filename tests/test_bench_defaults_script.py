"""`scripts/bench_defaults.py`: every command with no decoding flags against plain decoding writes one run record
with each command's numbers (stories260K, a random drafter)."""

from __future__ import annotations

import json

from test_sampling_acceptance_script import script


def test_bench_defaults_script_writes_each_commands_speed(tmp_path, capsys):
    mod = script("bench_defaults")
    out = tmp_path / "defaults.json"
    assert mod.main_(["--target", "stories260k", "--drafters", "random", "--limit", "1", "--max-new-tokens", "8",
                      "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    r = rec["results"]["random"]
    assert rec["kind"] == "bench-defaults" and rec["git_sha"] and rec["argv"]
    assert r["generate"]["speedup_median"] > 0 and len(r["generate"]["plain_tok_s"]) == 1
    assert "device defaults" in r["generate"]["drafting"]
    assert r["eval"]["speedup"] > 0 and r["bench"]["chain"]["speedup_vs_plain"] > 0
    assert not r["check"]["ok"]  # a random drafter fails the check (tau near 1)
    assert "random:" in capsys.readouterr().out
