"""`eagle3 bench` on CPU with tiny settings: every method runs, the JSON run record and chart are written, greedy
answers are compared with plain decoding; `--overhead --tiny` measures the per-cycle breakdown.
Run: pytest tests/test_bench.py
"""

from __future__ import annotations

import argparse
import json

import pytest

from eagle3.bench import METHODS, add_bench_parser, parse_methods
from eagle3.config import ConfigError


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="eagle3")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def test_bench_cpu_writes_a_record_with_every_method(tmp_path, capsys):
    rc = bench(["--target", "stories260k", "--drafter", "random", "--limit", "2", "--max-new-tokens", "16",
                "--device", "cpu", "--tree", "4,3,8", "--chain", "3", "--ngram-tokens", "4", "--out", str(tmp_path)])
    assert rc == 0
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert rec["kind"] == "bench" and rec["git_sha"] is not None and rec["argv"]
    assert [s["method"] for s in rec["summary"]] == list(METHODS)
    assert len(rec["rows"]) == 2 * len(METHODS)
    by = {s["method"]: s for s in rec["summary"]}
    for s in rec["summary"]:
        assert s["tokens_per_s_median"] > 0 and s["tau"] >= 1.0
        assert s["identical"] == 2, f"{s['method']} differs from plain decoding"
    assert by["plain"]["fast_path"] and by["tree"]["fast_path"] and not by["hf"]["fast_path"]
    assert by["plain"]["tau"] == 1.0
    b = rec["bandwidth"]
    assert b["copy_bandwidth_gbs"] > 0 and b["floor_tokens_per_s"] > 0 and b["plain_fraction_of_floor"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "(g) EAGLE-3 tree" in table and "bandwidth floor" in table


def test_bench_methods_subset_and_no_drafter(tmp_path):
    rc = bench(["--target", "stories260k", "--limit", "1", "--max-new-tokens", "8", "--device", "cpu",
                "--methods", "d,tree,hf", "--out", str(tmp_path)])
    assert rc == 0
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert [s["method"] for s in rec["summary"]] == ["hf", "plain"]  # tree skipped: no drafter given


def test_overhead_tiny(tmp_path, capsys):
    assert bench(["--overhead", "--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "overhead.json").read_text())
    assert rec["kind"] == "bench-overhead" and rec["shape"] == "tiny-llama"
    kinds = [(r["kind"], r["tokens"]) for r in rec["rows"]]
    assert kinds == [("chain", 1), ("chain", 2), ("chain", 3), ("tree", 8), ("tree", 16)]
    for r in rec["rows"]:
        assert r["cycle_units"] > 0 and r["verify_units"] > 0 and r["draft_units"] > 0
    assert rec["target_step_ms"] > 0 and rec["plain_bandwidth_gbs"] > 0
    assert "target steps" in capsys.readouterr().out


def test_parse_methods():
    assert parse_methods("all") == list(METHODS)
    assert parse_methods("g,a,plain") == ["hf", "plain", "tree"]
    with pytest.raises(ConfigError, match="unknown method"):
        parse_methods("fastest")


def test_run_record_takes_the_exported_sha_where_there_is_no_checkout(monkeypatch):
    from eagle3.record import run_record

    monkeypatch.setenv("EAGLE3_GIT_SHA", "9fcc9e6")  # what a copy of the tree on a GPU machine gets
    assert run_record("bench")["git_sha"] == "9fcc9e6"
