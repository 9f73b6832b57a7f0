"""Your own model, end to end: a base model (the bundled stories260K, no chat template) goes from a text file to
a trained drafter with the CLI alone; completion rows and `--chat-template`; and every command stops on bad
input (exit 2, `eagle3: error:` saying what it expected) before it loads a model or writes anything."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import eagle3.models
import eagle3.runtime
from eagle3.cli import main
from eagle3.config import ConfigError
from eagle3.models import load_tokenizer
from eagle3.training.data import PLAIN, iter_rows
from eagle3.training.inputs import CHATML, resolve_chat_template
from eagle3.training.prepare import PreparedDataset, prepare
from eagle3.training.render import ChatRenderer

STORIES = "Once upon a time, there was a little dog.\n\nTom and Sue went to the park.\nThey saw a big tree.\n\n\n" \
          "Lily liked to play with her red ball.\n"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stories_tok():
    return load_tokenizer("stories260k")[0]


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model (or its tokenizer, or a runtime) fails the test: validation must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    for module, name in ((eagle3.models, "load_target"), (eagle3.models, "load_tokenizer"),
                         (eagle3.runtime, "load_runtime")):
        monkeypatch.setattr(module, name, refuse)


# ------------------------------------------------------------------------------------------------
# Completion rows and templates
# ------------------------------------------------------------------------------------------------


def test_text_file_is_one_row_per_blank_line_separated_block(tmp_path):
    path = tmp_path / "stories.txt"
    path.write_text(STORIES, encoding="utf-8")
    assert list(iter_rows(path)) == [{"text": "Once upon a time, there was a little dog."},
                                     {"text": "Tom and Sue went to the park.\nThey saw a big tree."},
                                     {"text": "Lily liked to play with her red ball."}]


def test_completion_rows_train_on_the_completion_as_raw_text(stories_tok):
    """prompt+completion: the loss on the completion only; text: on all of it; tokens as a raw prompt (BOS)."""
    renderer = ChatRenderer(stories_tok, require_template=False)
    prompt, completion = "Once upon a time", ", there was a cat."
    row = renderer.encode({"prompt": prompt, "completion": completion})
    assert row.input_ids.tolist() == stories_tok(prompt + completion)["input_ids"]
    trained = stories_tok.decode(row.input_ids[row.loss_mask.astype(bool)])
    assert trained == completion.strip() and not row.loss_mask[:4].any()
    whole = renderer.encode({"text": prompt})
    assert whole.loss_mask.tolist() == [0, 1, 1, 1, 1]  # all but the BOS
    with pytest.raises(Exception, match="no_chat_template"):  # a conversation needs a template
        renderer.encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_plain_template_reads_a_conversation_as_raw_text(stories_tok):
    renderer = ChatRenderer(stories_tok, chat_template=PLAIN)
    row = renderer.encode([{"role": "user", "content": "Once upon a time"},
                           {"role": "assistant", "content": ", there was a cat."}])
    assert row.input_ids.tolist() == stories_tok("Once upon a time, there was a cat.")["input_ids"]
    assert stories_tok.decode(row.input_ids[row.loss_mask.astype(bool)]) == ", there was a cat."


def test_chat_template_names_and_files(tmp_path):
    assert resolve_chat_template(None) is None
    assert resolve_chat_template("plain") == PLAIN and resolve_chat_template("chatml") == CHATML
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert resolve_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"
    with pytest.raises(ConfigError, match="chatml, plain"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


def test_a_template_chosen_at_prepare_time_is_not_the_targets_own(tmp_path, stories_tok):
    """`prepare --chat-template` is a choice train respects: the data's template need not be the tokenizer's."""
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "Hi there"},
                                                               {"role": "assistant", "content": "Once upon"}]}])
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}</s>"
                "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    prepare(stories_tok, data, tmp_path / "p", draft_vocab_size=64, progress=False, chat_template=template)
    ds = PreparedDataset(tmp_path / "p")
    assert ds.report.chat_template_source == "given"
    ds.check_tokenizer(stories_tok)  # no template of its own: nothing to compare
    tok = load_tokenizer("stories260k")[0]
    tok.chat_template = "{{ messages[0]['content'] }}"
    ds.check_tokenizer(tok)  # its own template differs, but the data's was chosen on purpose


# ------------------------------------------------------------------------------------------------
# The CLI: a base model end to end
# ------------------------------------------------------------------------------------------------


def test_base_model_text_file_to_trained_drafter_with_the_cli(tmp_path, capsys):
    """stories260K continues the .txt prompts (regenerate), prepare trains on the continuations, train writes a
    drafter, and eval reads the .txt prompts as raw text."""
    (tmp_path / "stories.txt").write_text(STORIES, encoding="utf-8")
    regen, prep, out = tmp_path / "regen.jsonl", tmp_path / "prep", tmp_path / "run"
    assert main(["regenerate", "--target", "stories260k", "--data", str(tmp_path / "stories.txt"), "--out",
                 str(regen), "--max-new-tokens", "24", "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in regen.read_text().splitlines()]
    assert len(rows) == 3 and all(set(r) >= {"prompt", "completion"} for r in rows)
    tok = load_tokenizer("stories260k")[0]
    for r in rows:  # the completion continues the prompt's text exactly (its leading space kept)
        assert r["completion"].strip() and r["prompt"].startswith(("Once", "Tom", "Lily"))
        full = tok.decode(tok(r["prompt"] + r["completion"])["input_ids"], skip_special_tokens=True)
        assert full == r["prompt"] + r["completion"]
    assert main(["prepare", "--target", "stories260k", "--data", str(regen), "--out", str(prep)]) == 0
    report = json.loads((prep / "report.json").read_text())
    assert report["rows_kept"] == 3 and report["chat_template_source"] == "none"
    assert report["draft_vocab_size"] == 512  # the default is capped at the target's vocabulary
    assert main(["train", "--target", "stories260k", "--data", str(prep), "--out", str(out), "--max-steps", "2",
                 "--batch-size", "3", "--save-every", "0", "--ttt-steps", "2", "--device", "cpu"]) == 0
    assert (out / "drafter" / "config.json").is_file()
    assert main(["eval", "--target", "stories260k", "--drafter", str(out / "drafter"), "--datasets",
                 str(tmp_path / "stories.txt"), "--max-new-tokens", "8", "--chain", "2", "--out",
                 str(tmp_path / "eval"), "--chat-template", "plain"]) == 0
    capsys.readouterr()
    runs = json.loads((tmp_path / "eval" / "eval.json").read_text())["runs"]
    assert runs[0]["dataset"] == "stories" and runs[0]["prompts"] == 3


def test_prepare_conversations_for_a_base_model_with_the_plain_template(tmp_path, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": [{"from": "human", "value": "Once upon a time"},
                                                                    {"from": "gpt", "value": ", a cat sat."}]}])
    assert main(["prepare", "--target", "stories260k", "--data", str(data), "--out", str(tmp_path / "p")]) == 2
    assert "--chat-template plain" in capsys.readouterr().err  # what to do, not a traceback
    assert not (tmp_path / "p").exists()
    assert main(["prepare", "--target", "stories260k", "--data", str(data), "--out", str(tmp_path / "p"),
                 "--chat-template", "plain"]) == 0
    assert json.loads((tmp_path / "p" / "report.json").read_text())["rows_kept"] == 1


# ------------------------------------------------------------------------------------------------
# Bad input: reported first, nothing written
# ------------------------------------------------------------------------------------------------

QA_ROWS = [{"question": "What is 2+2?", "answer": "4"}, {"question": "Capital of France?", "answer": "Paris"}]


def test_regenerate_rows_in_no_known_format_is_an_error_before_the_model_loads(tmp_path, capsys, no_model):
    data = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)
    out = tmp_path / "out.jsonl"
    assert main(["regenerate", "--target", "stories260k", "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eagle3: error:") and "found fields: question, answer" in err
    assert "`conversations`" in err and "`prompt`" in err  # the fields it expected
    assert not out.exists()


def test_prepare_rows_in_no_known_format_is_an_error_before_the_tokenizer_loads(tmp_path, capsys, no_model):
    data = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)
    assert main(["prepare", "--target", "stories260k", "--data", str(data), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "found fields: question, answer" in err and "`completion`" in err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(("args", "needle"), [
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
    (["--batch-size", "0"], "--batch-size 0 must be >= 1"),
    (["--temperature", "-1"], "--temperature"),
    (["--chat-template", "nonesuch"], "--chat-template nonesuch"),
])
def test_regenerate_flags_are_checked_before_the_model_loads(tmp_path, capsys, no_model, args, needle):
    (tmp_path / "s.txt").write_text(STORIES)
    assert main(["regenerate", "--target", "stories260k", "--data", str(tmp_path / "s.txt"), "--out",
                 str(tmp_path / "o.jsonl"), *args]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_regenerate_conversations_for_a_base_model_need_a_template_before_the_model_loads(tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setattr(eagle3.models, "load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}])
    assert main(["regenerate", "--target", "stories260k", "--data", str(data), "--out",
                 str(tmp_path / "o.jsonl")]) == 2
    assert "--chat-template plain" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "needle"), [
    (["--datasets", "missing.jsonl"], "no benchmark set or file"),
    (["--limit", "0"], "--limit 0 must be >= 1"),
    (["--chat-template", "nonesuch"], "--chat-template nonesuch"),
])
def test_eval_inputs_are_checked_before_the_model_loads(tmp_path, capsys, no_model, args, needle):
    assert main(["eval", "--target", "stories260k", "--out", str(tmp_path / "e"), *args]) == 2
    assert needle in capsys.readouterr().err


def test_train_with_bad_data_creates_no_output_folder(tmp_path, capsys, no_model):
    not_prepared = tmp_path / "raw"
    not_prepared.mkdir()
    out = tmp_path / "run"
    assert main(["train", "--target", "stories260k", "--data", str(not_prepared), "--out", str(out),
                 "--device", "cpu"]) == 2
    assert "eagle3 prepare" in capsys.readouterr().err
    assert not out.exists()
    (tmp_path / "file").write_text("x")
    assert main(["train", "--target", "stories260k", "--data", str(not_prepared), "--out", str(tmp_path / "file"),
                 "--device", "cpu"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_check_data_names_a_missing_file_and_an_empty_one(tmp_path):
    from eagle3.training.inputs import check_data

    with pytest.raises(ConfigError, match="no such file"):
        check_data([tmp_path / "nope.jsonl"], "prepare")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ConfigError, match="no rows"):
        check_data([tmp_path / "empty.txt"], "prepare")
    (tmp_path / "s.txt").write_text(STORIES)
    assert check_data([tmp_path / "s.txt"], "regenerate") == Counter({"completion": 1})
