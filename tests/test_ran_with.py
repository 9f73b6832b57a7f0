"""`generate`, `eval` and `bench` say which engine, dtype and device ran (a text line and JSON fields), and a
drafter saved in fp32 loads into a bf16 run without a warning the user cannot act on. Stories260k on CPU."""

from __future__ import annotations

import json
import logging

import pytest

from eagle3.cli import main
from eagle3.fast.target import cpu_has_bf16
from test_bench import bench

# the device's defaults (`eagle3.defaults`): bf16 on the fast engine where the CPU has native bf16, else fp32
AUTO = ("fast", "bfloat16") if cpu_has_bf16() else ("generic", "float32")
AUTO_DTYPE = AUTO[1]

PROMPT = ["--target", "stories260k", "--prompt", "Once upon a time", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def fp32_drafter(tmp_path_factory):
    out = tmp_path_factory.mktemp("d") / "drafter"
    assert main(["init-drafter", "--target", "stories260k", "--out", str(out), "--draft-vocab-size", "256"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    return out


def test_generate_says_which_engine_dtype_and_device_ran(capsys, fp32_drafter):
    assert main(["generate", *PROMPT, "--drafter", str(fp32_drafter), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["engine"], out["dtype"], out["device"]) == (*AUTO, "cpu")
    assert main(["generate", *PROMPT, "--drafter", str(fp32_drafter), "--engine", "fast"]) == 0
    cap = capsys.readouterr()
    assert f"eagle3 generate: fast engine, {AUTO_DTYPE} on cpu" in cap.err
    assert "engine" not in cap.out  # the streamed text stays clean


def test_an_fp32_drafter_in_a_bf16_run_is_cast_without_a_warning(capsys, caplog, fp32_drafter):
    with caplog.at_level(logging.WARNING):
        assert main(["generate", *PROMPT, "--drafter", str(fp32_drafter), "--dtype", "bfloat16", "--json"]) == 0
    assert "torch_dtype" not in caplog.text and "float32" not in caplog.text
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dtype"] == "bfloat16"


def test_eval_reports_engine_dtype_and_device(capsys, fp32_drafter, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"turns": ["Once upon a time"]}) + "\n")
    out = tmp_path / "eval"
    assert main(["eval", "--target", "stories260k", "--drafter", str(fp32_drafter), "--datasets", str(data),
                 "--max-new-tokens", "8", "--chain", "3", "--out", str(out)]) == 0
    assert f"eagle3 eval: {AUTO[0]} engine, {AUTO[1]} on cpu" in capsys.readouterr().out
    report = json.loads((out / "eval.json").read_text())
    assert (report["engine"], report["dtype"], report["device"]["torch_device"]) == (*AUTO, "cpu")


def test_bench_reports_engine_dtype_and_device(tmp_path, capsys):
    assert bench(["--target", "stories260k", "--drafter", "random", "--limit", "1", "--max-new-tokens", "8",
                  "--device", "cpu", "--methods", "hf,plain,chain", "--chain", "3", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"eagle3 bench: fast engine, {AUTO_DTYPE} on cpu" in text and "ready on the fast engine" in text
    rec = json.loads((tmp_path / "bench.json").read_text())
    assert (rec["engine"], rec["dtype"], rec["device"]["torch_device"]) == ("fast", AUTO_DTYPE, "cpu")
    assert {s["method"]: s["engine"] for s in rec["summary"]} == {"hf": "hf", "plain": "fast", "chain": "fast"}
