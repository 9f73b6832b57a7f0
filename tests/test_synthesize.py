"""`eagle3 synthesize`: prompts written by the target from its chat template's user-turn header.

Run: pytest tests/test_synthesize.py -q     (about 20 s on 2 cores: SmolLM2 writes a dozen short prompts twice)
"""

from __future__ import annotations

import json

import pytest

from eagle3.config import ConfigError
from eagle3.training.backends import Generation, LocalBackend
from eagle3.training.regenerate import normalise_conversation
from eagle3.training.synthesize import MAX_BARREN_ROUNDS, synthesize, user_turn_prefix


def test_smollm2_writes_unique_prompts_and_a_rerun_resumes(smollm2, tmp_path):
    """SmolLM2 continues its own user-turn header with prompts; they are unique, finished and readable by
    regenerate; a second run with a larger count keeps the first rows and adds only new ones."""
    model, tok = smollm2
    backend = LocalBackend(model, tok, engine="hf")
    out = tmp_path / "prompts.jsonl"
    first = synthesize(backend, 3, out, max_new_tokens=48, batch_size=6, seed=1, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and first.kept == 3 and first.resumed == 0
    assert first.prefix.endswith("<|im_start|>user\n")  # SmolLM2's ChatML header after its default system turn
    again = synthesize(backend, 5, out, max_new_tokens=48, batch_size=6, seed=1, progress=False)
    rows2 = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows2[:3] == rows and len(rows2) == 5 and again.resumed == 3 and again.kept == 2
    texts = [r["conversations"][0]["value"] for r in rows2]
    assert len({" ".join(t.lower().split()) for t in texts}) == 5
    assert all(len(t) >= 16 and t == t.strip() for t in texts)
    for r in rows2:
        assert normalise_conversation(r) == [{"role": "user", "content": r["conversations"][0]["value"]}]
    report = json.loads((tmp_path / "prompts.jsonl.report.json").read_text())
    assert report["resumed"] == 3 and report["kept"] == 2 and report["generated"] >= 2


class _Tokenizer:
    """A ChatML-like template without jinja, and one token per character."""

    chat_template = "chatml"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, chat_template=None):
        return "".join(f"<{m['role']}>{m['content']}</>" for m in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


class _Scripted:
    """A backend that answers round after round from a script of Generations."""

    chat_template = None

    def __init__(self, rounds):
        self.tokenizer, self.rounds, self.prefixes = _Tokenizer(), list(rounds), []

    def describe(self):
        return "scripted"

    def complete(self, prefixes, temperature, max_new_tokens, batch_size):
        self.prefixes.append(prefixes[0])
        gens = self.rounds.pop(0) if self.rounds else []
        return (gens + [Generation(text="", finish_reason="stop")] * len(prefixes))[: len(prefixes)]


def _g(text, finish="stop"):
    return Generation(text=text, finish_reason=finish)


def test_drops_are_counted_and_a_repeating_model_stops(tmp_path):
    """Cut, empty, short, failed and repeated samples are dropped and counted; the prefix is the template up to
    the user's message (with --system); a model that keeps repeating itself ends the run with a reason."""
    q = "What should I pack for a week of hiking in the Alps?"
    backend = _Scripted([[_g(q), _g(q.upper() + "  "), _g("Tell me how", "length"), _g("  "), _g("Hi?"),
                          Generation(finish_reason="error", error="boom"), _g("How do tides work, and why twice a day?")]])
    out = tmp_path / "p.jsonl"
    report = synthesize(backend, 4, out, system="Be brief.", batch_size=7, progress=False)
    assert "".join(map(chr, backend.prefixes[0])) == "<system>Be brief.</><user>"
    assert [json.loads(x)["conversations"][0]["value"] for x in out.read_text().splitlines()] == [
        q, "How do tides work, and why twice a day?"]
    # round 1 draws 8 (the script's 7 and one empty); each barren round after it draws 7 empty ones
    assert report.dropped == {"duplicate": 1, "cut_at_limit": 1, "empty": 2 + 7 * MAX_BARREN_ROUNDS,
                              "too_short": 1, "error": 1}
    assert report.rounds == 1 + MAX_BARREN_ROUNDS and report.kept == 2
    assert report.stopped_early and "raise --temperature" in report.stopped_early


def test_resume_cuts_a_torn_line_and_refuses_foreign_files(tmp_path):
    out = tmp_path / "p.jsonl"
    row = {"id": "synth-0-0", "conversations": [{"from": "human", "value": "How do I start running at 40?"}]}
    out.write_text(json.dumps(row) + "\n" + '{"id": "synth-0-1", "conv')  # killed mid-write
    backend = _Scripted([[_g("How do I start running at 40?"), _g("Which houseplants survive a dark flat?")]])
    report = synthesize(backend, 2, out, batch_size=2, progress=False)
    lines = out.read_text().splitlines()
    assert report.resumed == 1 and report.dropped == {"duplicate": 1} and len(lines) == 2
    assert json.loads(lines[1])["conversations"][0]["value"] == "Which houseplants survive a dark flat?"
    other = tmp_path / "other.jsonl"
    other.write_text('{"messages": []}\n')
    with pytest.raises(ConfigError, match="not a synthesized prompt"):
        synthesize(_Scripted([]), 2, other, progress=False)


def test_bad_settings_and_templates_stop_at_once(tmp_path):
    for kw, msg in (({"count": 0}, "count must be >= 1"), ({"temperature": 0.0}, "greedy decoding writes one"),
                    ({"batch_size": 0}, "must be >= 1")):
        args = {"count": 2, **kw}
        with pytest.raises(ConfigError, match=msg):
            synthesize(_Scripted([]), args.pop("count"), tmp_path / "x.jsonl", progress=False, **args)

    class NoTemplate(_Tokenizer):
        chat_template = None

    with pytest.raises(ConfigError, match="no chat template"):
        user_turn_prefix(NoTemplate())

    class Hides(_Tokenizer):
        def apply_chat_template(self, messages, **kw):
            return "<s>"

    with pytest.raises(ConfigError, match="does not show the user's message"):
        user_turn_prefix(Hides())


def test_cli_writes_prompts_and_refuses_a_bad_setting(smollm2, tmp_path, capsys):
    from eagle3.cli import main

    out = tmp_path / "p.jsonl"
    assert main(["synthesize", "--target", "smollm2", "--device", "cpu", "--count", "2", "--out", str(out),
                 "--max-new-tokens", "48", "--batch-size", "4", "--engine", "hf"]) == 0
    assert len(out.read_text().splitlines()) == 2
    assert main(["synthesize", "--target", "smollm2", "--device", "cpu", "--count", "2", "--out",
                 str(tmp_path / "q.jsonl"), "--temperature", "0"]) == 2
    assert "greedy decoding writes one prompt only" in capsys.readouterr().err
    assert not (tmp_path / "q.jsonl").exists()


def test_eval_reads_synthesized_prompts(tmp_path):
    """`eagle3 eval --datasets FILE` (load_prompts) takes ShareGPT rows such as synthesize writes: the first human
    turn becomes the user message; a row without one is refused with its line number."""
    from eagle3.evaluate import load_prompts

    path = tmp_path / "synth.jsonl"
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "Plan a three-day trip to Lisbon."}]},
            {"id": "b", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "Explain tides."}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_prompts(str(path)) == ("synth", [[{"role": "user", "content": "Plan a three-day trip to Lisbon."}],
                                                 [{"role": "user", "content": "Explain tides."}]])
    path.write_text(json.dumps({"conversations": [{"from": "gpt", "value": "only an answer"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"synth\.jsonl:1: 'conversations' holds no human turn"):
        load_prompts(str(path))


def test_fast_engine_writes_prompts_too(smollm2, tmp_path):
    """The continuous-batching engine (the GPU default) continues the same header; on CPU here, without graphs."""
    model, tok = smollm2
    out = tmp_path / "fast.jsonl"
    report = synthesize(LocalBackend(model, tok, engine="fast"), 2, out, max_new_tokens=48, batch_size=4,
                        progress=False)
    assert report.kept == 2 and "engine fast" in report.backend and len(out.read_text().splitlines()) == 2
