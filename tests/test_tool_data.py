"""Tool-call traces in the data pipeline and in `eagle3 eval`: `prepare` keeps tool-call and tool-result turns
(rendered by a template that takes tools, or in the server's Hermes layout) and supervises exactly the assistant
turns, calls included; `regenerate` puts the tools in the target's prompt and keeps the target's own calls; the
opt-in `bfcl` eval set gives 80 prompts with valid JSON-schema tools.

The tokenizer is stories260k's (real SentencePiece vocabulary) with ChatML special tokens added; templates are
hand-written: one that takes `tools` (Qwen2.5-like), and plain ChatML (no tools: the Hermes fallback). The BFCL
tests need the bfcl-eval wheel (`pip install --no-deps bfcl-eval==2026.3.23`) and skip without it.

Run: pytest tests/test_tool_data.py -q
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from eagle3.cli import main
from eagle3.config import ConfigError
from eagle3.models import load_tokenizer
from eagle3.training.backends import Generation, LocalBackend
from eagle3.training.data import BadRow, conversation_tools, normalize_conversation
from eagle3.training.endpoint import EndpointBackend
from eagle3.training.prepare import PreparedDataset, prepare
from eagle3.training.regenerate import regenerate
from eagle3.training.render import TURN_TOOL_CALL, ChatRenderer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2.5-like: the tools in the system turn, calls as <tool_call> blocks after the content, results as `tool`
# turns. Text goes through expressions only (HF renders with trim_blocks, which eats a newline after a tag).
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n<tools>' }}{% for t in tools %}{{ '\n' + (t | tojson) }}{% endfor %}"
    "{{ '\n</tools><|im_end|>\n' }}"
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' + (m['content'] or '') }}"
    "{% for c in m['tool_calls'] or [] %}{{ '<tool_call>' + (c['function'] | tojson) + '</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif m['role'] != 'system' %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"name": "get_time", "description": "The time in a zone.",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}


def call(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# OpenAI rows: arguments as a JSON string (and content null), then as objects with parallel calls and text
OPENAI_ROW = {"tools": [{"type": "function", "function": WEATHER}], "messages": [
    {"role": "system", "content": "You help with the weather."},
    {"role": "user", "content": "Is it warm in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [call("call_a", "get_weather", '{"city": "Paris"}')]},
    {"role": "tool", "tool_call_id": "call_a", "content": "24 C"},
    {"role": "assistant", "content": "Yes, it is 24 degrees in Paris."}]}
PARALLEL_ROW = {"tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}],
                "messages": [
    {"role": "user", "content": "Weather and time in Rome?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        call("c1", "get_weather", {"city": "Rome"}), call("c2", "get_time", {"zone": "Europe/Rome"})]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
    {"role": "assistant", "content": "Sunny, and it is ten."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."}]}
# ShareGPT with LLaMA-Factory's tool roles, the tools as a JSON string of bare functions
SHAREGPT_ROW = {"tools": json.dumps([WEATHER]), "conversations": [
    {"from": "human", "value": "Weather in Oslo?"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
    {"from": "observation", "value": "snow"},
    {"from": "gpt", "value": "It is snowing in Oslo."}]}
ROWS = [OPENAI_ROW, PARALLEL_ROW, SHAREGPT_ROW]
RESULTS = ("24 C", "sunny", "10:00", "snow")


def expected_runs(hermes: bool) -> list[list[str]]:
    """The supervised text of each row: its assistant turns, calls included, each with its <|im_end|>."""
    def calls(*pairs):
        blocks = [json.dumps({"name": n, "arguments": a}) for n, a in pairs]
        if hermes:
            return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
        return "".join(f"<tool_call>{b}</tool_call>" for b in blocks)

    end = "<|im_end|>"
    text_then_calls = "Let me check." + ("\n" if hermes else "") + calls(
        ("get_weather", {"city": "Rome"}), ("get_time", {"zone": "Europe/Rome"}))
    return [
        [calls(("get_weather", {"city": "Paris"})) + end, "Yes, it is 24 degrees in Paris." + end],
        [text_then_calls + end, "Sunny, and it is ten." + end, "You are welcome." + end],
        [calls(("get_weather", {"city": "Oslo"})) + end, "It is snowing in Oslo." + end],
    ]


@pytest.fixture(scope="module")
def tok():
    tok = load_tokenizer("stories260k")[0]
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.pad_token = "<|im_end|>"
    return tok


def masked_runs(tok, input_ids, loss_mask) -> list[str]:
    """Each contiguous run of mask=1 tokens, decoded."""
    runs, cur = [], []
    for t, m in zip([*input_ids, -1], [*loss_mask, 0], strict=True):
        if m:
            cur.append(int(t))
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------
# prepare: tool turns kept, rendered with the tools, assistant turns (calls included) supervised
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, CHATML], ids=["template-takes-tools", "hermes-fallback"])
def test_prepare_keeps_tool_turns_and_supervises_the_assistant(tok, tmp_path, template):
    hermes = template == CHATML
    src = write_jsonl(tmp_path / "tools.jsonl", ROWS)
    report = prepare(tok, [src], tmp_path / "out", max_length=4096, draft_vocab_size=64, progress=False,
                     chat_template=template)
    assert report.rows_kept == 3 and report.rows_dropped == 0, report.dropped
    assert report.turns["supervised"] == 7
    assert report.turns.get(TURN_TOOL_CALL, 0) == (0 if hermes else 3)
    ds = PreparedDataset(tmp_path / "out")
    assert [masked_runs(tok, ds[i]["input_ids"].tolist(), ds[i]["loss_mask"].tolist()) for i in range(3)] == \
        expected_runs(hermes)

    renderer = ChatRenderer(tok, chat_template=template)
    for row in ROWS:
        text = renderer.supervised_spans(normalize_conversation(row), conversation_tools(row)).text
        assert '"name": "get_weather"' in text and '"description": "The weather in a city."' in text  # the tools
        assert ("<tool_response>" in text) == hermes and ("<|im_start|>tool\n" in text) == (not hermes)
        assert any(r in text for r in RESULTS)
    rendered = renderer.supervised_spans(normalize_conversation(PARALLEL_ROW), conversation_tools(PARALLEL_ROW))
    supervised = "".join(rendered.text[a:b] for a, b in rendered.spans)
    assert not any(r in supervised for r in RESULTS) and "Rome?" not in supervised  # results, user turns: no


def test_normalised_tool_messages():
    msgs = normalize_conversation(SHAREGPT_ROW)
    assert msgs[1] == {"role": "assistant", "content": "",
                       "tool_calls": [call("call_0", "get_weather", {"city": "Oslo"})]}
    assert msgs[2] == {"role": "tool", "content": "snow", "tool_call_id": "call_0", "name": "get_weather"}
    assert conversation_tools(SHAREGPT_ROW) == [{"type": "function", "function": WEATHER}]
    # results after the last call are dropped (nothing to supervise after them); the call stays
    cut = {"messages": OPENAI_ROW["messages"][1:4]}
    assert [m["role"] for m in normalize_conversation(cut)] == ["user", "assistant"]


@pytest.mark.parametrize(("messages", "reason"), [
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}],
     "not_alternating"),  # a result with no call before it
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                          "tool_calls": [call("x", "f", "[1, 2]")]}], "bad_tool_call"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                          "tool_calls": [call("x", "f", "{not json")]}], "bad_tool_call"),
])
def test_bad_tool_rows(messages, reason):
    with pytest.raises(BadRow) as e:
        normalize_conversation({"messages": messages})
    assert e.value.reason == reason


# ------------------------------------------------------------------------------------------------
# regenerate: the tools reach the target's prompt; its own calls are kept
# ------------------------------------------------------------------------------------------------
class ScriptedBackend:
    """Answers from a script, in order, and records every prompt."""

    def __init__(self, answers: list[str]):
        self.answers, self.prompts = list(answers), []

    def describe(self) -> str:
        return "scripted"

    def generate(self, prompts, temperature, max_new_tokens, batch_size):
        self.prompts += prompts
        return [Generation(text=self.answers.pop(0), num_tokens=5) for _ in prompts]


def test_regenerate_answers_with_the_tools_and_keeps_its_calls(tok, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [OPENAI_ROW])
    same_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    backend = ScriptedBackend([same_call, "It is warm: 24 degrees."])
    regenerate(src, tmp_path / "out.jsonl", backend, progress=False)
    first, second = backend.prompts
    assert first[0]["role"] == "system" and "<tools>" in first[0]["content"] and "get_weather" in first[0]["content"]
    assert first[-1] == {"role": "user", "content": "Is it warm in Paris?"}
    assert second[-2]["content"] == same_call  # the target's call, then the dataset's result for it
    assert second[-1] == {"role": "user", "content": "<tool_response>\n24 C\n</tool_response>"}
    (record,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert record["tools"] == OPENAI_ROW["tools"]
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert record["messages"][2]["content"] is None
    assert record["messages"][2]["tool_calls"] == [call("call_a", "get_weather", '{"city": "Paris"}')]
    assert record["messages"][4]["content"] == "It is warm: 24 degrees."
    # prepare reads the output back: the target's call is a supervised turn
    report = prepare(tok, [tmp_path / "out.jsonl"], tmp_path / "prep", max_length=4096, draft_vocab_size=64,
                     progress=False, chat_template=CHATML)
    assert report.rows_kept == 1 and report.turns["supervised"] == 2

    # another call than the dataset's: its result is unknown, so the conversation ends with the target's call
    backend = ScriptedBackend(['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'])
    regenerate(src, tmp_path / "other.jsonl", backend, progress=False)
    (record,) = [json.loads(line) for line in (tmp_path / "other.jsonl").read_text().splitlines()]
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
    assert json.loads(record["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Lyon"}


def test_regenerate_local_backend_prompt_holds_the_tools(tok, tmp_path):
    """A tiny random Llama on the stories260k tokenizer: the prompt it is given renders the tools."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)).eval()
    backend = LocalBackend(model, tok, chat_template=CHATML, engine="hf")
    seen = []
    encode = backend.encode
    backend.encode = lambda messages: seen.append(tok.decode(encode(messages))) or encode(messages)
    regenerate(write_jsonl(tmp_path / "in.jsonl", [SHAREGPT_ROW]), tmp_path / "out.jsonl", backend,
               max_new_tokens=4, progress=False)
    assert seen and "<tools>" in seen[0] and '"name": "get_weather"' in seen[0] and "Weather in Oslo?" in seen[0]
    (record,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert record["tools"] == [{"type": "function", "function": WEATHER}]
    assert [m["role"] for m in record["messages"]][:2] == ["user", "assistant"]


def tiny_llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)).eval()


def test_regenerate_local_backend_renders_tools_with_the_template(tok, tmp_path):
    """A template that takes tools gets them as `tools=`: its own tool block, no Hermes text; its calls are read
    with its parser and the dataset's result is rendered as its `tool` turn."""
    backend = LocalBackend(tiny_llama(tok), tok, chat_template=TOOLS_TEMPLATE, engine="hf")
    assert backend.takes_tools
    seen = []
    encode = backend.encode
    backend.encode = lambda messages: seen.append(tok.decode(encode(messages))) or encode(messages)
    answers = ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "Snowing."]
    backend._generate_batch = lambda batch, t, n: [Generation(text=answers.pop(0), num_tokens=3) for _ in batch]
    regenerate(write_jsonl(tmp_path / "in.jsonl", [SHAREGPT_ROW]), tmp_path / "out.jsonl", backend,
               max_new_tokens=4, progress=False)
    first, second = seen
    tool_block = "# Tools\n<tools>\n" + json.dumps({"type": "function", "function": WEATHER}) + "\n</tools>"
    for prompt in seen:
        assert tool_block in prompt and "You may call" not in prompt and "<tool_response>" not in prompt
    assert "Weather in Oslo?" in first
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in second
    assert "tool\nsnow" in second  # the dataset's result, as the template's `tool` turn
    (record,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert record["messages"][1]["tool_calls"] == [call("call_0", "get_weather", '{"city": "Oslo"}')]
    assert record["messages"][3]["content"] == "Snowing."


def test_local_backend_without_tool_template_keeps_the_hermes_layout(tok):
    backend = LocalBackend(tiny_llama(tok), tok, chat_template=CHATML, engine="hf")
    assert not backend.takes_tools


class CannedServer:
    """An OpenAI-compatible server (test_regenerate's canned handler); `answer(body)` gives (status, JSON body)."""

    def answer(self, body: dict) -> tuple[int, dict]:
        raise NotImplementedError

    def __enter__(self):
        from test_regenerate import _Handler

        outer = self

        class Handler(_Handler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                self._send(*outer.answer(body))

        self.requests: list[dict] = []
        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        return self

    def __exit__(self, *exc):
        self.srv.shutdown()
        self.srv.server_close()


def _message(message: dict) -> tuple[int, dict]:
    return 200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                 "usage": {"completion_tokens": 5}}


class ToolCallingServer(CannedServer):
    """A call for the first request, then text."""

    def answer(self, body):
        if len(self.requests) == 1:
            return _message({"role": "assistant", "content": None, "tool_calls": [
                {"id": "chatcmpl-tool-1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})
        return _message({"role": "assistant", "content": "It is 24 degrees."})


def test_regenerate_endpoint_sends_tools_and_reads_tool_calls(tmp_path):
    with ToolCallingServer() as server:
        backend = EndpointBackend(server.url, "tiny", concurrency=1, backoff_s=0.01)
        regenerate(write_jsonl(tmp_path / "in.jsonl", [OPENAI_ROW]), tmp_path / "out.jsonl", backend,
                   progress=False)
    first, second = server.requests
    assert first["tools"] == OPENAI_ROW["tools"] and second["tools"] == OPENAI_ROW["tools"]
    assert first["messages"] == OPENAI_ROW["messages"][:2]  # plain messages: no Hermes block in the system turn
    # the target's call (arguments as a JSON string, the dataset's id), then the dataset's result for it
    assert second["messages"][2]["tool_calls"] == [call("call_a", "get_weather", '{"city": "Paris"}')]
    assert second["messages"][3]["role"] == "tool" and second["messages"][3]["content"] == "24 C"
    (record,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert record["tools"] == OPENAI_ROW["tools"]
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert record["messages"][2]["content"] is None
    assert record["messages"][2]["tool_calls"] == [call("call_a", "get_weather", '{"city": "Paris"}')]
    assert record["messages"][4]["content"] == "It is 24 degrees."


class NoToolsServer(CannedServer):
    """A server without tool calling (vLLM without a tool-call parser): a 400 for any request with tools; the
    answer to the rest is a Hermes call written as text, then text."""

    def answer(self, body):
        if "tools" in body:
            return 400, {"error": {"message": "\"auto\" tool choice requires --enable-auto-tool-choice"}}
        answered = sum("tools" not in r for r in self.requests)
        text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                if answered == 1 else "It is 24 degrees.")
        return _message({"role": "assistant", "content": text})


def test_an_endpoint_that_refuses_tools_gets_them_as_prompt_text(tmp_path, caplog):
    with NoToolsServer() as server, caplog.at_level("WARNING"):
        backend = EndpointBackend(server.url, "tiny", concurrency=1, backoff_s=0.01)
        regenerate(write_jsonl(tmp_path / "in.jsonl", [OPENAI_ROW]), tmp_path / "out.jsonl", backend,
                   progress=False)
    # one refused request, then every request with the tools in a Hermes system turn and no `tools` field
    assert ["tools" in r for r in server.requests] == [True, False, False]
    assert "<tools>" in server.requests[1]["messages"][0]["content"]
    assert caplog.text.count("refused a request with tools") == 1
    (record,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert record["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"  # read from the text
    assert record["messages"][4]["content"] == "It is 24 degrees."


# ------------------------------------------------------------------------------------------------
# eval: the opt-in BFCL set
# ------------------------------------------------------------------------------------------------
needs_bfcl = pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None,
                                reason="bfcl-eval is not installed: pip install --no-deps bfcl-eval==2026.3.23")


@needs_bfcl
def test_bfcl_set_has_80_prompts_with_valid_tool_schemas():
    from jsonschema import validators

    from eagle3.evaluate import BENCH_SETS, load_prompt_rows, load_prompts

    name, prompts = load_prompts("bfcl")
    assert name == "bfcl" and len(prompts) == 80 and "bfcl" not in BENCH_SETS
    _, again, categories = load_prompt_rows("bfcl")
    assert again == prompts and [p.tools for p in again] == [p.tools for p in prompts]  # a fixed order
    assert categories[:3] == ["simple", "multiple", "parallel"]
    assert {c: categories.count(c) for c in set(categories)} == {"simple": 27, "multiple": 27, "parallel": 26}
    for p in prompts:
        assert p[-1]["role"] == "user" and p.tools
        for tool in p.tools:
            assert tool["type"] == "function" and re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", tool["function"]["name"])
            params = tool["function"]["parameters"]
            assert params["type"] == "object"
            validators.validator_for(params, default=validators.Draft202012Validator).check_schema(params)
    assert len(load_prompts("bfcl", limit=2)[1]) == 2


@needs_bfcl
def test_eval_runs_bfcl_on_stories260k(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "--target", "stories260k", "--draft", "ngram", "--datasets", "bfcl", "--limit", "2",
                 "--max-new-tokens", "4", "--chain", "2", "--chat-template", "chatml", "--out", str(out)]) == 0
    run = json.loads((out / "eval.json").read_text())["runs"][0]
    assert run["dataset"] == "bfcl" and run["prompts"] == 2
    assert [r["category"] for r in run["per_prompt"]] == ["simple", "multiple"]


@needs_bfcl
def test_bfcl_json_set_asks_for_arguments_under_their_schema():
    from jsonschema import validators

    from eagle3.evaluate import load_prompt_rows

    name, prompts, _ = load_prompt_rows("bfcl_json")
    assert name == "bfcl_json" and len(prompts) == 200 and len({p[0]["content"] for p in prompts}) == 200
    for p in prompts:
        assert p.schema["type"] == "object" and p.schema["additionalProperties"] is False and not p.tools
        validators.validator_for(p.schema, default=validators.Draft202012Validator).check_schema(p.schema)
        assert json.dumps(p.schema) in p[0]["content"]


@needs_bfcl
def test_eval_counts_valid_json_answers_on_bfcl_json(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "--target", "stories260k", "--draft", "ngram", "--datasets", "bfcl_json", "--limit", "2",
                 "--max-new-tokens", "6", "--chain", "2", "--temperatures", "0", "--chat-template", "chatml",
                 "--out", str(out)]) == 0
    run = json.loads((out / "eval.json").read_text())["runs"][0]
    assert run["dataset"] == "bfcl_json" and run["constrained"] == 2
    assert run["valid_json"] == sum(r["valid"] for r in run["per_prompt"]) == 0  # 6 tokens end no answer
    assert "valid JSON answers: 0/2" in capsys.readouterr().out


@needs_bfcl
def test_bench_times_constrained_answers_on_bfcl_json(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--target", "stories260k", "--drafter", "random", "--dataset", "bfcl_json", "--limit", "2",
                 "--max-new-tokens", "8", "--methods", "hf,plain,chain", "--chain", "3", "--out", str(out)]) == 0
    assert "skipping HF generate" in capsys.readouterr().out
    rec = json.loads((out / "bench.json").read_text())
    by = {s["method"]: s for s in rec["summary"]}
    assert set(by) == {"plain", "chain"} and rec["dataset"] == "bfcl_json"
    for s in by.values():
        assert s["valid_json"] == 0 and s["identical"] == 2  # 8 tokens end no answer; the same tokens
        assert s["masks_per_token"] >= 1 and s["mask_us_per_token"] > 0


def test_valid_answer_needs_an_ended_answer_that_follows_the_schema():
    from eagle3.decoding.engine import GenerationResult
    from eagle3.evaluate import valid_answer

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def answer(text, finish="stop"):
        return GenerationResult(token_ids=[], text=text, finish_reason=finish, stats=None)

    assert valid_answer(answer('{"a": 1}'), schema)
    assert not valid_answer(answer('{"a": 1}', "length"), schema)
    assert not valid_answer(answer('{"a": "x"}'), schema)
    assert not valid_answer(answer('{"a": 1'), schema)


def test_bfcl_without_the_wheel_says_how_to_install(monkeypatch):
    import eagle3.bfcl

    monkeypatch.setattr(eagle3.bfcl.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=re.escape("pip install --no-deps bfcl-eval==2026.3.23")):
        eagle3.bfcl.bfcl_prompts()
