"""Tool calls in the OpenAI-compatible server (`serving/protocol.py`, `serving/tools.py`, `serving/app.py`).

Validation (each 400 and the param it names), rendering (a template that takes tools, the Hermes fallback, the
forced start of `tool_choice`), the three parsers (several calls, malformed calls, text before a call) and the
stream (markers split across chunks: any cut of an answer gives the same content and calls). Then the whole flow
through a live server with the real `openai` client, driven by `CannedScheduler`, the real scheduler answering
canned token ids (tiny models cannot be relied on to call tools); and one SmolLM2 smoke test (slow) on the real
scheduler with a named `tool_choice`.
Run: pytest tests/test_tools.py
"""

from __future__ import annotations

import copy
import json
import random

import pytest

from eagle3.serving import protocol as P
from eagle3.serving import tools as T

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}}}}},
]
NAMES = {"get_weather", "add"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = {"role": "user", "content": "Weather in Paris?"}
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"  # no tools
# a template that renders tools, calls (arguments as objects) and results itself
TOOLS_TEMPLATE = (  # (transformers trims a newline after a block tag: newlines are written as expressions)
    "{% if messages[0].role == 'tool' %}{{ raise_exception('a tool result needs a call before it') }}{% endif %}"
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{{ t.function.parameters | tojson }}{% endfor %}"
    "{{ '\\n' }}{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}{% if m.role == 'tool' %} [{{ m.tool_call_id }}]{% endif %}{{ '\\n' }}"
    "{% endfor %}assistant:")


def chat(**body) -> P.ChatRequest:
    return P.parse_chat(json.dumps({"model": "m", **body}))


def bad_param(**body) -> str:
    with pytest.raises(P.RequestError) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.message
    return e.value.param


# -- validation ---------------------------------------------------------------------------------
def fn(name="get_weather", **extra) -> dict:
    return {"type": "function", "function": {"name": name, **extra}}


BAD = {
    "tools not an array": (dict(tools={"a": 1}), "tools"),
    "tool not an object": (dict(tools=["get_weather"]), "tools[0]"),
    "tool type": (dict(tools=[fn(), {"type": "retrieval", "function": {"name": "x"}}]), "tools[1].type"),
    "tool unknown key": (dict(tools=[{**fn(), "extra": 1}]), "tools[0].extra"),
    "function missing": (dict(tools=[{"type": "function"}]), "tools[0].function"),
    "name missing": (dict(tools=[{"type": "function", "function": {"description": "d"}}]), "tools[0].function.name"),
    "name pattern": (dict(tools=[fn(), fn("get weather!")]), "tools[1].function.name"),
    "name too long": (dict(tools=[fn("x" * 65)]), "tools[0].function.name"),
    "name duplicate": (dict(tools=[fn(), fn("add"), fn()]), "tools[2].function.name"),
    "function unknown key": (dict(tools=[fn(returns="str")]), "tools[0].function.returns"),
    "description type": (dict(tools=[fn(description=3)]), "tools[0].function.description"),
    "strict type": (dict(tools=[fn(strict="yes")]), "tools[0].function.strict"),
    "schema invalid": (dict(tools=[fn(parameters={"type": "objekt"})]), "tools[0].function.parameters"),
    "schema nested invalid": (dict(tools=[fn(), fn("add", parameters={"type": "object", "properties": {
        "a": {"type": "number", "minimum": "zero"}}})]), "tools[1].function.parameters"),
    "schema not an object": (dict(tools=[fn(parameters=[1])]), "tools[0].function.parameters"),
    "tool_choice unknown string": (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    "tool_choice type": (dict(tools=TOOLS, tool_choice=1), "tool_choice"),
    "tool_choice unknown function": (dict(tools=TOOLS, tool_choice=fn("nope")), "tool_choice.function.name"),
    "tool_choice no function": (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice.function"),
    "tool_choice no name": (dict(tools=TOOLS, tool_choice={"type": "function", "function": {}}),
                            "tool_choice.function.name"),
    "tool_choice object type": (dict(tools=TOOLS, tool_choice={"type": "tool", "function": {"name": "add"}}),
                                "tool_choice.type"),
    "tool_choice without tools": (dict(tool_choice="auto"), "tool_choice"),
    "tool_choice required, tools empty": (dict(tools=[], tool_choice="required"), "tool_choice"),
    "tool_choice named without tools": (dict(tool_choice=fn()), "tool_choice"),
    "parallel_tool_calls type": (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_tools_are_400_naming_the_param(case):
    body, param = BAD[case]
    assert bad_param(messages=[USER], **body) == param


def conversation(assistant: dict | None = None, tool: dict | None = None) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, USER, assistant or ASSISTANT_CALL, tool or TOOL_RESULT]


def call(**over) -> dict:
    c = copy.deepcopy(ASSISTANT_CALL["tool_calls"][0])
    for key, value in over.items():
        if key.startswith("function."):
            c["function"][key.split(".", 1)[1]] = value
        else:
            c[key] = value
    return {k: v for k, v in c.items() if v is not None}


BAD_MESSAGES = {
    "tool_call_id missing": (conversation(tool={"role": "tool", "content": "18 C"}), "messages[3].tool_call_id"),
    "tool_call_id type": (conversation(tool={**TOOL_RESULT, "tool_call_id": 7}), "messages[3].tool_call_id"),
    "tool content missing": (conversation(tool={"role": "tool", "tool_call_id": "call_1"}), "messages[3].content"),
    "tool unknown key": (conversation(tool={**TOOL_RESULT, "tool_calls": []}), "messages[3].tool_calls"),
    "tool_calls type": (conversation(assistant={"role": "assistant", "tool_calls": {}}), "messages[2].tool_calls"),
    "tool_calls on a user turn": ([{**USER, "tool_calls": []}], "messages[0].tool_calls"),
    "call id missing": (conversation({**ASSISTANT_CALL, "tool_calls": [call(id=None)]}),
                        "messages[2].tool_calls[0].id"),
    "call type": (conversation({**ASSISTANT_CALL, "tool_calls": [call(type="code")]}),
                  "messages[2].tool_calls[0].type"),
    "call unknown key": (conversation({**ASSISTANT_CALL, "tool_calls": [{**call(), "index": 0}]}),
                         "messages[2].tool_calls[0].index"),
    "call name missing": (conversation({**ASSISTANT_CALL, "tool_calls": [call(**{"function.name": None})]}),
                          "messages[2].tool_calls[0].function.name"),
    "arguments missing": (conversation({**ASSISTANT_CALL, "tool_calls": [call(**{"function.arguments": None})]}),
                          "messages[2].tool_calls[0].function.arguments"),
    "arguments not JSON": (conversation({**ASSISTANT_CALL, "tool_calls": [call(**{"function.arguments": "{city"})]}),
                           "messages[2].tool_calls[0].function.arguments"),
    "arguments not an object": (conversation({**ASSISTANT_CALL, "tool_calls": [call(**{"function.arguments": "[1]"})]}),
                                "messages[2].tool_calls[0].function.arguments"),
    "arguments an object": (conversation({**ASSISTANT_CALL, "tool_calls": [call(**{"function.arguments": {"a": 1}})]}),
                            "messages[2].tool_calls[0].function.arguments"),
    "assistant content null without calls": (conversation({"role": "assistant", "content": None}),
                                             "messages[2].content"),
}


@pytest.mark.parametrize("case", list(BAD_MESSAGES))
def test_bad_tool_messages_are_400_naming_the_param(case):
    messages, param = BAD_MESSAGES[case]
    assert bad_param(messages=messages, tools=TOOLS) == param


def test_valid_tool_requests():
    req = chat(messages=conversation(), tools=TOOLS, parallel_tool_calls=False)
    assert (req.tool_choice, req.tool_function, req.parallel_tool_calls) == ("auto", None, False)
    assert [t["function"]["name"] for t in req.tools] == ["get_weather", "add"]
    assistant, tool = req.messages[2], req.messages[3]
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tool == {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"}
    named = chat(messages=[USER], tools=TOOLS, tool_choice=fn("add"))
    assert (named.tool_choice, named.tool_function) == ("function", "add")
    assert chat(messages=[USER], tools=TOOLS, tool_choice="required").tool_choice == "required"
    for body in (dict(), dict(tools=[]), dict(tool_choice="none"), dict(tools=TOOLS, tool_choice="none")):
        assert chat(messages=[USER], **body).tool_choice == "none", body
    parts = chat(messages=[USER, {**TOOL_RESULT, "content": [{"type": "text", "text": "18 "}, {"type": "text",
                                                                                           "text": "C"}]}])
    assert parts.messages[1]["content"] == "18 C"
    echoed = {**ASSISTANT_CALL, "refusal": None}  # what a client's echo of our message may carry
    assert chat(messages=[USER, echoed, TOOL_RESULT], tools=TOOLS).messages[1]["tool_calls"]


# -- rendering ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(stories260k):
    return stories260k[1]


def render(tok, messages, template, tools=TOOLS, choice="auto", function=None, parallel=True):
    return T.render(tok, messages, tools, choice, function, parallel, template)


def test_hermes_fallback_renders_tools_calls_and_results(tok):
    messages = chat(messages=conversation(), tools=TOOLS).messages
    text, calls = render(tok, messages, TEMPLATE)
    tools_json = "\n".join(json.dumps(t) for t in TOOLS)
    system = T.HERMES_SYSTEM.format(tools=tools_json, parallel="")
    assert text == (f"system: Be brief.\n\n{system}\nuser: Weather in Paris?\nassistant: {CALL}\n"
                    "user: <tool_response>\n18 C\n</tool_response>\nassistant:")
    assert "<tools>\n" + tools_json + "\n</tools>" in system and "<tool_call></tool_call>" in system
    assert isinstance(calls.parser, T.HermesParser) and calls.names == NAMES and calls.prefix == ""
    # no system turn: one is added; consecutive results share one user turn; content before calls is kept
    two = [USER, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "b", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "18 C"}, {"role": "tool", "tool_call_id": "b", "content": "3"}]
    text, _ = render(tok, two, TEMPLATE, parallel=False)
    assert text.startswith("system: # Tools") and "Call at most one function per answer." in text
    assert ("assistant: Checking.\n" + CALL + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            "</tool_call>\nuser: <tool_response>\n18 C\n</tool_response>\n<tool_response>\n3\n</tool_response>\n"
            "assistant:") in text


def test_tool_choice_forces_the_start_of_the_turn(tok):
    messages = [USER]
    text, calls = render(tok, messages, TEMPLATE, choice="required")
    assert text.endswith("assistant:<tool_call>\n") and calls.prefix == "<tool_call>\n"
    text, calls = render(tok, messages, TEMPLATE, choice="function", function="add")
    assert text.endswith('assistant:<tool_call>\n{"name": "add", "arguments": ')
    assert calls.parse('{"a": 1, "b": 2}}\n</tool_call>')[1][0]["function"] == {"name": "add",
                                                                                 "arguments": '{"a":1,"b":2}'}
    text, calls = render(tok, messages, TEMPLATE, choice="none")
    assert text == "user: Weather in Paris?\nassistant:" and calls is None  # no tools, nothing parsed
    # history keeps its Hermes form under "none"
    text, _ = render(tok, chat(messages=conversation()).messages, TEMPLATE, tools=[], choice="none")
    assert "<tools>" not in text and CALL in text and "<tool_response>" in text


def test_template_that_takes_tools(tok):
    messages = chat(messages=conversation(), tools=TOOLS).messages
    text, calls = render(tok, messages, TOOLS_TEMPLATE, choice="function", function="get_weather")
    params = json.dumps(TOOLS[0]["function"]["parameters"])
    assert text.startswith(f"tools: get_weather{params} add") and "# Tools" not in text
    # arguments reach the template as an object (not a string to encode twice), the result with its call id
    assert f"assistant: {CALL.replace(chr(10), '')}\n" in text and "tool: 18 C [call_1]\n" in text
    assert text.endswith('assistant:<tool_call>\n{"name": "get_weather", "arguments": ')
    assert isinstance(calls.parser, T.HermesParser)
    text, calls = render(tok, messages, TOOLS_TEMPLATE, choice="none")
    assert not text.startswith("tools:") and calls is None


def test_parser_follows_the_template():
    assert isinstance(T.parser_for("{% for t in tools %}<tool_call>...{% endfor %}"), T.HermesParser)
    assert isinstance(T.parser_for("{{ '[TOOL_CALLS]' }}{{ tools | tojson }}"), T.MistralParser)
    llama = 'Respond in the format {"name": function name, "parameters": dictionary}. {{ "<|python_tag|>" }} tools'
    assert isinstance(T.parser_for(llama), T.Llama3JsonParser)
    assert isinstance(T.parser_for("{{ tools }}"), T.HermesParser)  # nothing to go on: Hermes
    assert T.takes_tools(TOOLS_TEMPLATE) and not T.takes_tools(TEMPLATE)


@pytest.mark.slow
def test_hermes_fallback_on_smollm2(smollm2):
    """SmolLM2's template knows nothing of tools: the tools land in its system turn, in ChatML."""
    _, tok = smollm2
    text, calls = T.render(tok, chat(messages=conversation()).messages, TOOLS, "required")
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and "<tools>\n" in text
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<tool_call>\n") and isinstance(calls.parser, T.HermesParser)


# -- parsing --------------------------------------------------------------------------------------
def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed[1]]


PARSES = {  # parser, answer, prefix -> content, calls
    "hermes one": (T.HermesParser(), CALL, "", None, [("get_weather", {"city": "Paris"})]),
    "hermes several, text first": (
        T.HermesParser(), f"Let me check.\n{CALL}\n<tool_call>{{\"name\": \"add\", \"arguments\": {{\"a\": 1}}}}"
        "</tool_call>\n", "", "Let me check.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]),
    "hermes text between and after": (T.HermesParser(), f"A.\n{CALL}\nB. ", "", "A.B. ",
                                      [("get_weather", {"city": "Paris"})]),
    "hermes arguments as a string": (
        T.HermesParser(), '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>', "", None,
        [("add", {"a": 2})]),
    "hermes unclosed at the end": (T.HermesParser(), CALL.removesuffix("</tool_call>"), "", None,
                                   [("get_weather", {"city": "Paris"})]),
    "hermes forced name": (T.HermesParser(), '{"city": "Paris"}}\n</tool_call>', T.HermesParser().prefix("get_weather"),
                           None, [("get_weather", {"city": "Paris"})]),
    "hermes forced start": (T.HermesParser(), CALL.removeprefix("<tool_call>\n"), "<tool_call>\n", None,
                            [("get_weather", {"city": "Paris"})]),
    "hermes plain text": (T.HermesParser(), " Just text, a < sign and <tool but no call.\n", "",
                          " Just text, a < sign and <tool but no call.\n", []),
    "llama3 tagged, two": (
        T.Llama3JsonParser(), '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}', "", None,
        [("add", {"a": 1}), ("get_weather", {"city": "Rome"})]),
    "llama3 bare": (T.Llama3JsonParser(), '\n{"name": "add", "parameters": {"a": 1, "b": {"c": "}"}}}', "", None,
                    [("add", {"a": 1, "b": {"c": "}"}})]),
    "llama3 not at the start": (T.Llama3JsonParser(), 'Use {"name": "add", "parameters": {}}', "",
                                'Use {"name": "add", "parameters": {}}', []),
    "llama3 JSON that is no call": (T.Llama3JsonParser(), '{"answer": 42}', "", '{"answer": 42}', []),
    "mistral marked, two": (
        T.MistralParser(), 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "", "Sure.",
        [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]),
    "mistral bare (special token skipped)": (T.MistralParser(), '[{"name": "add", "arguments": {"a": 1}}]', "", None,
                                             [("add", {"a": 1})]),
    "mistral list in text": (T.MistralParser(), "[1] and [2]", "", "[1] and [2]", []),
}


@pytest.mark.parametrize("case", list(PARSES))
def test_parsers(case):
    parser, answer, prefix, content, calls = PARSES[case]
    parsed = T.ToolCalls(parser, NAMES, prefix).parse(answer)
    assert parsed[0] == content and calls_of(parsed) == calls
    for c in parsed[1]:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
        assert c["id"][5:].isalnum() and " " not in c["function"]["arguments"]  # compact JSON


MALFORMED = {
    "bad JSON": (T.HermesParser(), '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'),
    "unknown function": (T.HermesParser(), CALL.replace("get_weather", "get_wether")),
    "arguments not an object": (T.HermesParser(), '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'),
    "no name": (T.HermesParser(), '<tool_call>{"arguments": {}}</tool_call>'),
    "cut off": (T.HermesParser(), '<tool_call>\n{"name": "add", "arguments": {"a": '),
    "llama3 unknown": (T.Llama3JsonParser(), '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}'),
    "mistral bad JSON": (T.MistralParser(), '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}]'),
    "mistral v11 layout": (T.MistralParser(), '[TOOL_CALLS]add{"a": 1}'),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_calls_come_back_as_text(case, caplog):
    parser, answer = MALFORMED[case]
    assert T.ToolCalls(parser, NAMES).parse(answer) == (answer, [])
    assert "malformed" in caplog.text


def test_a_malformed_call_leaves_good_ones_and_keeps_its_whitespace():
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    content, calls = T.ToolCalls(T.HermesParser(), NAMES).parse(f"{CALL}\n{bad} done")
    assert calls_of((content, calls)) == [("get_weather", {"city": "Paris"})] and content == f"{bad} done"
    content, calls = T.ToolCalls(T.HermesParser(), NAMES).parse(f"Hi\n{bad}\n{CALL}")
    assert content == f"Hi\n{bad}" and len(calls) == 1


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = CALL + CALL.replace("Paris", "Rome")
    assert calls_of(T.ToolCalls(T.HermesParser(), NAMES, parallel=False).parse(two)) == [
        ("get_weather", {"city": "Paris"})]


# -- streaming ------------------------------------------------------------------------------------
def streamed(parser, answer: str, cuts: list[int], prefix: str = "") -> tuple[str | None, list, list[dict]]:
    s = T.CallStream(parser, NAMES, prefix)
    deltas = []
    for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True):
        deltas += s.feed(answer[a:b])
    deltas += s.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
             for d in deltas for c in d.get("tool_calls", ())]
    return (None if calls and not content.strip() else content), calls, deltas


@pytest.mark.parametrize("case", list(PARSES) + [f"malformed: {c}" for c in MALFORMED])
def test_any_cut_of_a_stream_gives_the_whole_answers_parse(case):
    if case.startswith("malformed: "):
        (parser, answer), prefix = MALFORMED[case.removeprefix("malformed: ")], ""
    else:
        parser, answer, prefix, *_ = PARSES[case]
    content, calls = T.ToolCalls(parser, NAMES, prefix).parse(answer)
    want = (content, [(i, n, a) for i, (n, a) in enumerate(calls_of((content, calls)))])
    rng = random.Random(0)
    cuttings = [list(range(1, len(answer))), []] + [
        sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.randint(1, 12)))) for _ in range(20)]
    for cuts in cuttings:
        got_content, got_calls, deltas = streamed(parser, answer, cuts, prefix)
        assert (got_content, got_calls) == want, cuts
        if calls:  # the markers of calls that parse never stream as content
            assert all("<tool_call>" not in d.get("content", "") for d in deltas)


def test_marker_split_across_chunks_is_held_back():
    s = T.CallStream(T.HermesParser(), NAMES)
    assert s.feed("Sure, <to") == [{"content": "Sure,"}]  # the space may only separate text from a call
    assert s.feed("ol_ca") == []
    assert s.feed('ll>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_') == []
    (delta,) = s.feed("call>")
    (c,) = delta["tool_calls"]
    assert (c["index"], c["type"], c["function"]) == (0, "function", {"name": "get_weather",
                                                                     "arguments": '{"city":"Paris"}'})
    assert s.feed("\n") == [] and s.feed("<tool_cal") == []
    assert s.feed("culator") == [{"content": "<tool_calculator"}]  # not a marker after all
    assert s.finish() == [] and s.calls == 1
    s = T.CallStream(T.HermesParser(), NAMES)
    assert s.feed("a <") == [{"content": "a"}] and s.finish() == [{"content": " <"}]


# -- a live server, the real client, a scheduler that answers canned token ids ----------------------------------
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from eagle3.runtime import eos_token_ids  # noqa: E402
from eagle3.serving.app import create_app  # noqa: E402
from eagle3.serving.config import ServeConfig  # noqa: E402
from eagle3.serving.requests import _Row  # noqa: E402
from eagle3.serving.scheduler import Scheduler  # noqa: E402
from eagle3.serving.server import ServerThread  # noqa: E402
from eagle3.target import Target  # noqa: E402

MODEL = "stories260k"


class CannedScheduler(Scheduler):
    """The real scheduler whose `submit` decodes nothing: a request is answered with the next canned reply's token
    ids (then EOS), one token at a time through the scheduler's own output path (`_emit`: detokenization, streamed
    deltas, the done event). `prompts` keeps the prompt ids each request brought."""

    def __init__(self, model, tok, config: ServeConfig):
        super().__init__(Target(model, []), tok, eos_token_ids(model, tok), config=config)
        self.replies: list[str] = []
        self.prompts: list[list[int]] = []

    def submit(self, handle) -> None:
        self.prompts.append(list(handle.params.prompt_ids))
        ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"] + [min(self.eos)]
        row = _Row(handle)
        for t in ids:
            if self._emit(row, [t]):
                break


def canned_server(stories260k, template: str) -> ServerThread:
    model, tok = stories260k
    # prompts with tools outgrow stories260k's 512 positions; the double never runs the model
    config = ServeConfig(model_name=MODEL, chat_template=template, max_model_len=8192)
    return ServerThread(create_app(CannedScheduler(copy.deepcopy(model), tok, config))).start()


@pytest.fixture(scope="module")
def server(stories260k):
    srv = canned_server(stories260k, TEMPLATE)
    yield srv
    srv.stop()


@pytest.fixture
def double(server) -> CannedScheduler:
    return server.app.state.scheduler


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def accumulate(chunks) -> tuple[str, dict[int, dict], str]:
    """What a client builds from a stream: content, calls by index (arguments joined), the finish reason."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, calls, finish


def test_tool_call_round_trip(client, double, tok):
    """Tools offered -> a parsed call (streamed and not) -> the call and its result sent back -> a text answer."""
    messages = [USER]
    double.replies = [CALL]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and len(tc.id) == 29
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert r.usage.completion_tokens == len(tok(CALL, add_special_tokens=False)["input_ids"]) + 1
    prompt = tok.decode(double.prompts[-1])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and prompt.endswith("assistant:")

    double.replies = ["Let me look.\n" + CALL]  # streamed: text first, the call as one delta, split tokens held
    content, calls, finish = accumulate(client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, stream=True))
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")

    # the agent appends the assistant message as the client returned it, then the tool's result
    messages += [choice.message, {"role": "tool", "tool_call_id": tc.id, "content": "18 C and sunny"}]
    answer = "It is 18 C and sunny in Paris."
    double.replies = [answer, answer]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (answer, "stop")
    assert r.choices[0].message.tool_calls is None
    prompt = tok.decode(double.prompts[-1])
    assert f"assistant: {CALL}\nuser: <tool_response>\n18 C and sunny\n</tool_response>\nassistant:" in prompt
    content, calls, finish = accumulate(client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, stream=True))
    assert (content, calls, finish) == (answer, {}, "stop")


def test_malformed_call_through_the_server(client, double):
    bad = CALL.replace("get_weather", "get_wether")
    double.replies = [bad, bad]
    r = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (bad, None)
    assert r.choices[0].finish_reason == "stop"
    content, calls, finish = accumulate(client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS,
                                                                       stream=True))
    assert (content, calls, finish) == (bad, {}, "stop")


def test_tool_choice_reaches_the_prompt(client, double, tok):
    def prompt_of(**kwargs) -> str:
        double.replies = ["ok"]
        client.chat.completions.create(model=MODEL, messages=[USER], **kwargs)
        return tok.decode(double.prompts[-1])

    bare = tok("user: Weather in Paris?\nassistant:", add_special_tokens=False)["input_ids"]
    prompt_of(tools=TOOLS, tool_choice="none")
    assert double.prompts[-1] == bare  # "none": the tools are not rendered
    prompt_of()
    assert double.prompts[-1] == bare  # no tools: as before
    auto = prompt_of(tools=TOOLS, tool_choice="auto")
    assert "<tools>" in auto and auto.endswith("assistant:")
    required = prompt_of(tools=TOOLS, tool_choice="required")
    assert required.removesuffix("<tool_call>\n") == auto
    named = prompt_of(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert named == auto + '<tool_call>\n{"name": "add", "arguments": '
    # the model continues the forced start; the call is read from both
    double.replies = ['{"a": 2, "b": 3}}\n</tool_call>']
    r = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    (tc,) = r.choices[0].message.tool_calls
    assert (tc.function.name, tc.function.arguments, r.choices[0].finish_reason) == ("add", '{"a":2,"b":3}',
                                                                                    "tool_calls")
    double.replies = ['{"name": "add", "arguments": {"a": 1}}\n</tool_call>']
    content, calls, finish = accumulate(client.chat.completions.create(
        model=MODEL, messages=[USER], tools=TOOLS, tool_choice="required", stream=True))
    assert (content, [(c["name"], c["arguments"]) for c in calls.values()], finish) == (
        "", [("add", '{"a":1}')], "tool_calls")


def test_tool_400s_through_the_client(client):
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name"),
        (dict(tools=[fn(parameters={"type": "object", "properties": {"city": {"type": "strng"}}})]),
         "tools[0].function.parameters"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[fn("bad name")]), "tools[0].function.name"),
        (dict(messages=[USER, ASSISTANT_CALL, {"role": "tool", "content": "18 C"}], tools=TOOLS),
         "messages[2].tool_call_id"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, **{"messages": [USER], **kwargs})
        assert e.value.status_code == 400 and e.value.body["param"] == param, kwargs


def test_server_with_a_template_that_takes_tools(stories260k):
    srv = canned_server(stories260k, TOOLS_TEMPLATE)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        double = srv.app.state.scheduler
        double.replies = [CALL, "done"]
        r = c.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS)
        (tc,) = r.choices[0].message.tool_calls
        assert tc.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        assert stories260k[1].decode(double.prompts[-1]).startswith("tools: get_weather{")
        messages = [USER, r.choices[0].message, {"role": "tool", "tool_call_id": tc.id, "content": "18 C"}]
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        assert r.choices[0].message.content == "done"
        assert f"tool: 18 C [{tc.id}]\nassistant:" in stories260k[1].decode(double.prompts[-1])
        with pytest.raises(openai.BadRequestError) as e:  # the template refuses the conversation: a 400
            c.chat.completions.create(model=MODEL, messages=[TOOL_RESULT], tools=TOOLS)
        assert e.value.body["param"] == "messages" and "needs a call before it" in e.value.body["message"]
    finally:
        srv.stop()


@pytest.mark.slow
def test_smollm2_named_tool_choice_never_fails(smollm2):
    """The real scheduler and model: a named tool_choice answers a parsed call of that function or, if the model
    botches it, the attempt as text; streamed and not, the same (greedy)."""
    from eagle3.serving.server import build_scheduler

    model, tok = smollm2
    model = copy.deepcopy(model)
    sched = build_scheduler(Target(model, []), tok, eos_token_ids(model, tok), config=ServeConfig(model_name="smollm2"))
    with ServerThread(create_app(sched)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kwargs = dict(model="smollm2", messages=[USER], tools=TOOLS, max_tokens=32, temperature=0,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        r = c.chat.completions.create(**kwargs)
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        if message.tool_calls:  # the forced call, perhaps more after it
            assert finish == "tool_calls" and message.tool_calls[0].function.name == "get_weather"
            for tc in message.tool_calls:
                assert tc.function.name in NAMES and isinstance(json.loads(tc.function.arguments), dict)
        else:
            assert finish in ("stop", "length")
            assert message.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
        content, calls, stream_finish = accumulate(c.chat.completions.create(**kwargs, stream=True))
        assert stream_finish == finish and content == (message.content or "")
        assert [(x["name"], x["arguments"]) for x in calls.values()] == [
            (tc.function.name, tc.function.arguments) for tc in message.tool_calls or []]
