"""`eagle3 bench` on CPU with tiny settings: every method runs, the JSON run record and chart are written, greedy
answers are compared with plain decoding; `--overhead --tiny` measures the per-cycle breakdown.
Run: pytest tests/test_bench.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from eagle3.bench import METHODS, add_bench_parser, parse_methods, run_bench
from eagle3.config import ConfigError
from eagle3.defaults import native_bf16


def script(name: str):
    """`scripts/<name>.py` imported as a module (the scripts are not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="eagle3")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def test_bench_cpu_writes_a_record_with_every_method(tmp_path, capsys):
    rc = bench(["--target", "stories260k", "--drafter", "random", "--limit", "2", "--max-new-tokens", "16",
                "--device", "cpu", "--tree", "4,3,8", "--chain", "3", "--ngram-tokens", "4", "--out", str(tmp_path),
                "--dtype", "float32"])  # fp32: HF's own decoding rounds like ours, so every method is compared
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
    assert not by["tree"]["drafting_compiled"]  # compiled drafting is the CUDA default only
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
    assert rec["options"]["compile_drafting"] is None  # auto: the device's (compiled on CUDA only)
    assert rec["options"]["graph_prefill"] is False  # graph_prefill auto on a CPU: what ran
    assert rec["options"]["target_attention"] == "sdpa"  # target_attention auto on a CPU
    # the variants are `run_bench`'s keywords (no longer `eagle3 bench` flags)
    rec = run_bench("stories260k", limit=1, max_new_tokens=8, device="cpu", methods=["plain"],
                    compile_drafting=False, echo=lambda _line: None)
    assert rec["options"]["compile_drafting"] is False
    with pytest.raises(ConfigError, match="need --drafter"):  # only drafter methods, and no drafter
        bench(["--target", "stories260k", "--limit", "1", "--device", "cpu", "--methods", "tree",
               "--out", str(tmp_path / "none")])


def test_bench_times_several_trees_against_one_plain_run(tmp_path, capsys):
    """`--tree A B`: one row per shape, named by its shape, in the same run as plain decoding; each equals plain."""
    rc = bench(["--target", "stories260k", "--drafter", "random", "--limit", "2", "--max-new-tokens", "12",
                "--device", "cpu", "--methods", "plain,tree", "--tree", "4,3,8", "2,2,3", "--out", str(tmp_path)])
    assert rc == 0
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert [s["method"] for s in rec["summary"]] == ["plain", "tree-4,3,8", "tree-2,2,3"]
    assert rec["methods"] == ["plain", "tree-4,3,8", "tree-2,2,3"]
    assert rec["spec"]["trees"] == [[4, 3, 8], [2, 2, 3]] and rec["spec"]["tree"] == [4, 3, 8]
    for s in rec["summary"][1:]:
        assert s["identical"] == 2 and s["letter"] == "g" and "speedup_vs_plain" in s
    assert {r["method"] for r in rec["rows"]} == {"plain", "tree-4,3,8", "tree-2,2,3"}
    table = capsys.readouterr().out
    assert "(g) EAGLE-3 tree 4,3,8 (fast path)" in table and "(g) EAGLE-3 tree 2,2,3 (fast path)" in table
    with pytest.raises(ConfigError, match="given twice"):
        bench(["--target", "stories260k", "--drafter", "random", "--device", "cpu", "--methods", "tree",
               "--tree", "4,3,8", "4,3,8", "--out", str(tmp_path)])


def test_bench_samples_with_one_seed_per_prompt(tmp_path):
    """`--temperature`: every eagle3 method draws prompt i with seed --seed + i, so their sampled answers are the
    same tokens (compared with plain decoding as for greedy runs), and the record says how it sampled."""
    argv = ["--target", "stories260k", "--drafter", "random", "--limit", "2", "--max-new-tokens", "16",
            "--device", "cpu", "--methods", "plain,chain,tree", "--chain", "3", "--tree", "4,3,8"]
    assert bench([*argv, "--temperature", "0.9", "--seed", "5", "--out", str(tmp_path)]) == 0
    sampled = json.loads((tmp_path / "bench.json").read_text())
    assert (sampled["temperature"], sampled["seed"]) == (0.9, 5)
    assert all(s["identical"] == 2 for s in sampled["summary"])
    with pytest.raises(ConfigError, match="temperature"):
        bench([*argv, "--temperature", "-1", "--out", str(tmp_path / "x")])


def test_bench_keeps_the_prompts_measured_before_a_failure(tmp_path, monkeypatch):
    """A run stopped part way (here the tree fails on the second prompt; on a device, a time limit) leaves the
    record of the prompts every method ran before it, marked incomplete; a finished run's record says complete."""
    import eagle3.bench as bench_mod

    real, made = bench_mod._engine_runner, []

    def failing(*args, **kwargs):
        made.append(1)
        run = real(*args, **kwargs)
        if len(made) == 1:
            return run
        calls = []

        def stops(ids, seed, schema=None):  # the warm-up and the first prompt run, the second stops
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("stopped")
            return run(ids, seed, schema)
        return stops

    monkeypatch.setattr(bench_mod, "_engine_runner", failing)
    argv = ["--target", "stories260k", "--drafter", "random", "--limit", "3", "--max-new-tokens", "8",
            "--device", "cpu", "--methods", "plain,tree", "--tree", "4,3,8", "--out", str(tmp_path)]
    with pytest.raises(RuntimeError, match="stopped"):
        bench(argv)
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert rec["complete"] is False and rec["bandwidth"] is None
    assert [s["method"] for s in rec["summary"]] == ["plain", "tree"] and rec["methods"] == ["plain", "tree"]
    assert [s["prompts"] for s in rec["summary"]] == [1, 1] and len(rec["rows"]) == 2
    assert rec["summary"][1]["tokens_per_s_median"] > 0
    monkeypatch.setattr(bench_mod, "_engine_runner", real)
    assert bench(argv) == 0
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert rec["complete"] is True and [s["prompts"] for s in rec["summary"]] == [3, 3]


def test_bench_methods_take_turns_on_each_prompt(tmp_path, monkeypatch):
    """The methods run prompt by prompt, each in turn, the first method rotating: a device that slows down
    during the run slows every method alike, where timing one method after another would charge it to the last."""
    import eagle3.bench as bench_mod

    real, order = bench_mod._engine_runner, []

    def logged(engine, *args, **kwargs):
        run, name = real(engine, *args, **kwargs), engine.mode

        def log(ids, seed, schema=None):
            order.append((name, seed))
            return run(ids, seed, schema)
        return log

    monkeypatch.setattr(bench_mod, "_engine_runner", logged)
    assert bench(["--target", "stories260k", "--drafter", "random", "--limit", "3", "--max-new-tokens", "4",
                  "--device", "cpu", "--methods", "plain,ngram,tree", "--tree", "4,3,8", "--warmup", "1",
                  "--out", str(tmp_path)]) == 0
    timed = order[3:]  # after one warm-up each
    assert [m for m, _ in order[:3]] == ["none", "host", "eagle3"]  # n-grams: a host proposer
    assert timed == [("none", 0), ("host", 0), ("eagle3", 0), ("host", 1), ("eagle3", 1), ("none", 1),
                     ("eagle3", 2), ("none", 2), ("host", 2)]


def test_overhead_tiny(tmp_path, capsys):
    assert bench(["--overhead", "--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "overhead.json").read_text())
    assert rec["kind"] == "bench-overhead" and rec["shape"] == "tiny-llama"
    kinds = [(r["kind"], r["tokens"]) for r in rec["rows"]]
    assert kinds == [("chain", 1), ("chain", 2), ("chain", 3), ("tree", 8), ("tree", 16)]
    for r in rec["rows"]:
        assert r["cycle_units"] > 0 and r["verify_units"] > 0 and r["draft_units"] > 0
    assert rec["target_step_ms"] > 0 and rec["plain_bandwidth_gbs"] > 0
    assert rec["compile_drafting"] is False  # None resolves to CUDA only
    assert rec["complete"] is True and rec["target_attention"] == "sdpa"  # auto on a CPU
    assert "target steps" in capsys.readouterr().out


def test_overhead_keeps_the_rows_measured_before_a_failure(tmp_path, monkeypatch):
    """A run stopped part way (here the fourth row's timing fails; on a device, a time limit) leaves the record
    of the unit step and the rows before it, marked incomplete."""
    import eagle3.fast.overhead as overhead

    real, calls = overhead.time_step, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1 + 3 * 4:  # the unit step, then four timings per row: the fourth row fails
            raise RuntimeError("stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(overhead, "time_step", failing)
    with pytest.raises(RuntimeError, match="stopped"):
        bench(["--overhead", "--tiny", "--device", "cpu", "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "overhead.json").read_text())
    assert rec["complete"] is False and rec["shape"] == "tiny-llama" and rec["target_step_ms"] > 0
    assert [(r["kind"], r["tokens"]) for r in rec["rows"]] == [("chain", 1), ("chain", 2), ("chain", 3)]


def test_overhead_shapes():
    """`--shape` names the random model; SmolLM2's matches the real target's dimensions and draft vocabulary."""
    from eagle3.fast.overhead import SHAPES, run_overhead

    dims, draft_vocab = SHAPES["smollm2-135m"]
    assert (dims["hidden_size"], dims["num_hidden_layers"], dims["num_attention_heads"],
            dims["num_key_value_heads"], dims["vocab_size"], draft_vocab) == (576, 30, 9, 3, 49152, 12288)
    with pytest.raises(ValueError, match="unknown shape 'gpt-5'"):
        run_overhead("cpu", shape="gpt-5")
    with pytest.raises(SystemExit):
        bench(["--overhead", "--shape", "gpt-5", "--device", "cpu"])


def test_parse_methods():
    assert parse_methods("all") == list(METHODS)
    assert parse_methods("g,a,plain") == ["hf", "plain", "tree"]
    with pytest.raises(ConfigError, match="unknown method"):
        parse_methods("fastest")


def test_run_record_takes_the_exported_sha_where_there_is_no_checkout(monkeypatch):
    from eagle3.record import run_record

    monkeypatch.setenv("EAGLE3_GIT_SHA", "9fcc9e6")  # what a copy of the tree on a GPU machine gets
    assert run_record("bench")["git_sha"] == "9fcc9e6"


def test_bench_scheduler_script_writes_a_record(tmp_path, capsys):
    """`scripts/bench_scheduler.py` on stories260K with a random drafter: every mode runs and is recorded."""
    import copy

    from eagle3.formats import save_drafter
    from eagle3.models import load_target
    from eagle3.runtime import init_drafter

    model, _ = load_target("stories260k")
    save_drafter(init_drafter(copy.deepcopy(model), seed=0), tmp_path / "drafter")
    mod = script("bench_scheduler")
    out = tmp_path / "out"
    assert mod.main(["--target", "stories260k", "--drafter", str(tmp_path / "drafter"), "--device", "cpu",
                     "--clients", "1", "3", "--max-tokens", "8", "--prompts", "gsm8k", "--out", str(out),
                     "--max-prefill-tokens", "16"]) == 0  # 3 clients: one prompt per prefill, the rest join later
    rec = json.loads((out / "bench_scheduler.json").read_text())
    assert rec["kind"] == "bench_scheduler" and rec["git_sha"] is not None
    assert {(r["clients"], r["mode"]) for r in rec["results"]} == {
        (c, m) for c in (1, 3) for m in ("plain", "spec-gate", "spec-nogate")}
    assert all(r["tokens"] == 8 * r["clients"] for r in rec["results"])  # no EOS within 8 tokens here
    assert "speed vs plain" in capsys.readouterr().out


def test_bench_serving_script_writes_a_record(tmp_path, capsys):
    """`scripts/bench_serving.py` against its in-process server over HTTP, stories260K with a random drafter:
    both modes at two concurrency levels, no errors, a run record and a chart."""
    mod = script("bench_serving")
    out = tmp_path / "out"
    assert mod.main(["--target", "stories260k", "--random-drafter", "--device", "cpu", "--concurrency", "1", "3",
                     "--max-tokens", "8", "--min-requests", "3", "--rounds", "1", "--warmup", "1",
                     "--prompts", "gsm8k", "--out", str(out)]) == 0
    rec = json.loads((out / "bench_serving.json").read_text())
    assert rec["kind"] == "bench_serving" and rec["git_sha"] is not None and rec["argv"]
    levels = {(r["mode"], r["concurrency"]) for r in rec["results"]}
    assert levels == {(m, c) for m in ("plain", "spec") for c in (1, 3)}
    assert all(r["errors"] == 0 and r["requests"] >= 3 and r["output_tokens"] > 0 for r in rec["results"])
    # the wall time's split on the server: every level ran cycles, and the 3-client level prefilled in the batch
    assert all(r["cycles_s"] > 0 and r["idle_s"] >= 0 for r in rec["results"])
    assert all(r["prefills"] >= 1 and r["prefill_s"] > 0 for r in rec["results"] if r["concurrency"] == 3)
    # the per-cycle trace: one entry per decode cycle of the level, its tokens the level's output less the
    # first tokens (emitted by prefills), speculative cycles only on the speculative server (whose gate timed
    # them; with a random drafter it may have settled on plain cycles during the warm-up)
    path = "rows" if native_bf16("cpu") else "batch"  # the fast rows where the CPU decodes in bf16, else the HF rows
    for r in rec["results"]:
        cyc = r["cycles"]
        assert len(cyc["ms"]) == r["verify_steps"] and all(ms > 0 for ms in cyc["ms"])
        assert sum(cyc["tokens"]) == r["output_tokens"] - r["requests"]
        assert set(cyc["path"]) == {path}
        assert r["fast_rows"] == (path == "rows")  # what ran, beside the argv that asked
        spec_rates = [g["spec"] for g in r["gates"][path].values()]
        assert (r["mode"] == "spec") == (any(cyc["spec"]) or any(x is not None for x in spec_rates))
        assert r["mode"] == "spec" or not any(cyc["spec"])
    assert (out / "bench_serving.png").stat().st_size > 0
    assert "geometric-mean speedup" in capsys.readouterr().out
    assert rec["complete"] is True and all("texts" not in r for r in rec["results"])


def test_bench_serving_keeps_the_levels_measured_before_a_failure(tmp_path, monkeypatch):
    """The record is rewritten after every level: a run stopped in its speculative half (a time limit, a crash)
    leaves the plain levels on disk, marked incomplete."""
    mod = script("bench_serving")
    real = mod.run_mode

    def stopped(mode, *args, **kwargs):
        if mode == "spec":
            raise KeyboardInterrupt("stopped while the speculative server started")
        return real(mode, *args, **kwargs)

    monkeypatch.setattr(mod, "run_mode", stopped)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        mod.main(["--target", "stories260k", "--random-drafter", "--device", "cpu", "--concurrency", "1", "2",
                  "--max-tokens", "6", "--min-requests", "2", "--rounds", "1", "--warmup", "0", "--prompts", "gsm8k",
                  "--out", str(out)])
    rec = json.loads((out / "bench_serving.json").read_text())
    assert rec["complete"] is False
    assert [(r["mode"], r["concurrency"]) for r in rec["results"]] == [("plain", 1), ("plain", 2)]


def test_bench_rows_script_writes_a_record(tmp_path, capsys):
    """`scripts/bench_rows.py`, stories260K with a random drafter: two budgets x two batch sizes, both modes,
    a record whose shapes follow the serving policy (a larger budget gives B=4 a larger tree)."""
    mod = script("bench_rows")
    out = tmp_path / "out"
    assert mod.main(["--target", "stories260k", "--random-drafter", "--device", "cpu", "--batch", "1", "4",
                     "--budgets", "16", "64", "--cycles", "2", "--warmup", "1", "--seq-len", "512",
                     "--prompts", "gsm8k", "--out", str(out)]) == 0
    rec = json.loads((out / "bench_rows.json").read_text())
    assert rec["kind"] == "bench_rows" and rec["git_sha"] is not None
    rows = {(r["budget"], r["batch"]): r for r in rec["results"]}
    assert set(rows) == {(16, 1), (16, 4), (64, 1), (64, 4)}
    assert all(r["plain_tokens_per_row_cycle"] == 1.0 and r["spec_tokens_per_row_cycle"] >= 1.0
               for r in rows.values())
    assert rows[(16, 4)]["shape"] == "chain 3"
    assert rows[(64, 4)]["shape"] == "tree 6,3,15"
    assert all(r["feed_window"] == 32 and r["bare_ms_per_cycle"] > 0 for r in rows.values())
    assert "budget" in capsys.readouterr().out


def test_bench_batched_script_times_the_generator(tmp_path, capsys):
    """`scripts/bench_batched.py`, stories260K: every prompt answered, the same tokens in every round, a record."""
    mod = script("bench_batched")
    out = tmp_path / "out"
    assert mod.main(["--target", "stories260k", "--device", "cpu", "--dataset", "gsm8k", "--limit", "6",
                     "--rows", "3", "--max-prompt-tokens", "600", "--max-new-tokens", "8", "--rounds", "2",
                     "--out", str(out)]) == 0
    rec = json.loads((out / "bench_batched.json").read_text())
    assert rec["kind"] == "bench_batched" and rec["seq_len"] == 608 and rec["prompts"] == 6
    assert rec["identical_rounds"] is True and len(rec["rounds"]) == 2
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in rec["rounds"])
    assert "median tok/s" in capsys.readouterr().out


def test_bench_rows_compares_feed_windows(tmp_path):
    """`--feed-windows 0 4`: both ways of feeding the drafter, measured on the same rows, accept the same drafts."""
    mod = script("bench_rows")
    out = tmp_path / "out"
    assert mod.main(["--target", "stories260k", "--random-drafter", "--device", "cpu", "--batch", "2",
                     "--budgets", "64", "--feed-windows", "0", "4", "--cycles", "6", "--warmup", "1",
                     "--seq-len", "512", "--prompts", "gsm8k", "--out", str(out)]) == 0
    rows = json.loads((out / "bench_rows.json").read_text())["results"]
    assert [r["feed_window"] for r in rows] == [0, 4]
    assert rows[0]["spec_tokens_per_row_cycle"] == rows[1]["spec_tokens_per_row_cycle"]


def test_bench_rows_samples_at_a_temperature(tmp_path):
    """`--temperature 0.8`: the rows run the sampling cycle variants (seeded per row), plain cycles still emit one
    token per row, and the record says which temperature and whether the rows sampled."""
    mod = script("bench_rows")
    res = {}
    for t in ("0", "0.8"):
        out = tmp_path / t
        assert mod.main(["--target", "stories260k", "--random-drafter", "--device", "cpu", "--batch", "2",
                         "--budgets", "64", "--cycles", "4", "--warmup", "1", "--seq-len", "512",
                         "--prompts", "gsm8k", "--temperature", t, "--out", str(out)]) == 0
        res[t] = json.loads((out / "bench_rows.json").read_text())
    assert res["0.8"]["temperature"] == 0.8 and res["0"]["temperature"] == 0.0
    for t, rec in res.items():
        (row,) = rec["results"]
        assert row["sampled"] == (t != "0") and row["fused_sampling"] is False  # eager off CUDA
        assert row["plain_tokens_per_row_cycle"] == 1.0 and row["spec_tokens_per_row_cycle"] >= 1.0


def test_profile_step_script_groups_kernels(tmp_path, capsys):
    """`scripts/profile_step.py` on stories260K with a random drafter, on the CPU (operators stand in for
    kernels): a record with the plain step and the tree cycle, matmuls among the kinds, and `--by-source`'s
    (function, operator) pairs, with `--pieces` each piece of the cycle, and with `--all-kernels` every kernel
    (here: operator), which add up to the kinds' totals."""
    mod = script("profile_step")
    out = tmp_path / "out"
    assert mod.main(["--target", "stories260k", "--random-drafter", "--device", "cpu", "--context", "16",
                     "--tree", "3,2,4", "--reps", "2", "--by-source", "15", "--pieces", "--all-kernels",
                     "--out", str(out)]) == 0
    rec = json.loads((out / "profile_step.json").read_text())
    assert rec["kind"] == "profile_step" and set(rec["results"]) == {"plain_step", "tree_cycle", "pieces"}
    assert rec["drafting_compiled"] is False
    pieces = rec["results"].pop("pieces")  # each piece of the cycle on its own, the drafter's only in draft/commit
    assert set(pieces) == {"draft", "verify", "accept", "commit"}
    assert all(p["wall_us"] > 0 and p["launches"] > 0 for p in pieces.values())
    assert "matmul" in pieces["draft"]["kinds"] and "matmul" in pieces["verify"]["kinds"]
    for r in [*rec["results"].values(), *pieces.values()]:
        kernels = r["kernels"]
        assert kernels == sorted(kernels, key=lambda k: -k["us"]) and {k["kind"] for k in kernels} == set(r["kinds"])
        assert sum(k["us"] for k in kernels) == pytest.approx(r["kernel_us"], abs=0.1 + 0.01 * len(kernels))
        assert sum(k["launches"] for k in kernels) == pytest.approx(r["launches"], abs=1)
    for r in rec["results"].values():
        assert r["wall_us"] > 0 and r["launches"] > 0 and "matmul" in r["kinds"]
        assert len(r["sources"]) == 15 and r["sources"] == sorted(r["sources"], key=lambda x: -x["us"])
    # the target's and the drafter's functions are named, each operator under the function that called it
    plain_where = {x["where"].split("(")[0] for x in rec["results"]["plain_step"]["sources"]}
    cycle_where = {x["where"].split("(")[0] for x in rec["results"]["tree_cycle"]["sources"]}
    assert "fast/target.py" in plain_where and "fast/drafter.py" not in plain_where
    assert "fast/drafter.py" in cycle_where
    text = capsys.readouterr().out
    assert "tree cycle = " in text and "by eagle3 function" in text
    assert rec["residual_in_gemm"] is False and rec["target_attention"] == "sdpa"  # the CPU's defaults
    assert rec["target_norm"] == "torch"


def test_profile_step_experiments_reach_the_target(tmp_path):
    """`--residual-add gemm` and `--target-attention sdpa` set the target's switches, and the record says so;
    the residual then goes through Tensor.addmm_."""
    mod = script("profile_step")
    out = tmp_path / "out"
    assert mod.main(["--target", "stories260k", "--device", "cpu", "--context", "16", "--reps", "1",
                     "--residual-add", "gemm", "--target-attention", "sdpa", "--by-source", "40",
                     "--out", str(out)]) == 0
    rec = json.loads((out / "profile_step.json").read_text())
    assert rec["residual_in_gemm"] is True and rec["target_attention"] == "sdpa"
    ops = {(x["where"].split(" ")[-1], x["op"]) for x in rec["results"]["plain_step"]["sources"]}
    assert ("add_linear_norm", "aten::addmm_") in ops, ops


def test_position_accuracy_script_buckets_every_answer_token(tmp_path, capsys):
    """`scripts/position_accuracy.py` on stories260K (no chat template: raw prompts) with a random drafter: each
    bucket scores exactly the answer tokens inside it, accuracies are per TTT step, and a run record is written."""
    mod = script("position_accuracy")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n{"prompt": "Lily had a dog"}\n')
    out = tmp_path / "posacc.json"
    assert mod.main(["--target", "stories260k", "--drafter", "random", "--prompts", str(prompts), "--limit", "2",
                     "--max-new-tokens", "12", "--edges", "0", "4", "100", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["kind"] == "position_accuracy" and rec["git_sha"] is not None
    first, rest = rec["buckets"]["0-4"], rec["buckets"]["4-100"]
    assert first["tokens"] == 2 * 4  # two answers, their first four tokens
    assert 0 < rest["tokens"] <= 2 * 8  # the rest of answers of at most 12 tokens (EOS may end one early)
    assert all(len(b["acc_per_step"]) == 7 and all(0 <= a <= 1 for a in b["acc_per_step"])
               for b in (first, rest))
    assert "answer tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="increasing"):
        mod.main(["--edges", "10", "5", "--out", str(out)])
