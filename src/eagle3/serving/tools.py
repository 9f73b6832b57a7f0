"""Tool calls for `/v1/chat/completions`: tools into the prompt, calls out of the answer.

Rendering (`render`): a chat template whose source mentions `tools` gets them through
`apply_chat_template(messages, tools=...)`, with assistant `tool_calls` (arguments as objects) and `tool` results
in the messages, and its answers are read with the parser its source points to. Any other template gets the
Hermes format in ordinary turns (`hermes_messages`): the tools as JSON lines inside `<tools></tools>` in the
system turn, past calls as `<tool_call>` blocks in the assistant's turn, results as a user turn of
`<tool_response>` blocks (the layout of Qwen2.5's template, Qwen/Qwen2.5-7B-Instruct `tokenizer_config.json`).
`tool_choice` "required" or a named function starts the assistant's turn with the opening of a call (`prefix`),
which the model continues; "none" renders no tools and parses nothing. A forced call is also
constrained (`ToolCalls.grammar`), in every format: the rest of the turn must be a call of an offered function
whose arguments follow its parameter schema (`eagle3.decoding.grammar`).

Parsing (`CallStream`), one parser per format, chosen from the template's source (`parser_for`):
    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call (Hermes 2 Pro, Qwen)
    llama3   {"name": ..., "parameters": {...}} at the start of the answer, after an optional <|python_tag|>;
             several separated by ";" (Llama 3.1-3.3)
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]; also the bare array at the start of the
             answer, since the server's detokenizer skips special tokens such as [TOOL_CALLS]
The stream cuts the answer into text and call blocks as it arrives: text streams as content, holding back a
suffix that could begin a marker (and whitespace, dropped where it only separates text from a call); a block is
buffered until it closes and then becomes one tool call (or several), or, if malformed (bad JSON, an unknown
function, arguments that are not an object), plain content again, with a warning in the log (vLLM also answers
an unparsable call as text: vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py). A whole answer is
parsed by the same stream (`ToolCalls.parse`), so streamed and non-streamed answers agree.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import string
from dataclasses import dataclass

from eagle3.decoding.grammar import WHITESPACE, GrammarCompiler, GrammarError

__all__ = ["CallStream", "ToolCalls", "hermes_messages", "new_call_id", "parser_for", "render", "takes_tools"]

log = logging.getLogger("eagle3.serving")

_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` and 24 random letters and digits (OpenAI's shape)."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def _json_end(text: str, i: int) -> int:
    """The index just past the JSON object or array that opens at `text[i]`, or -1 if it has not closed yet."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return -1


def _partial(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker` (to hold back)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# -- parsers ------------------------------------------------------------------------------------
# Each finds where a call block opens (`opening`), how much of the text's end could still become an opening
# marker (`partial`), where an open block ends (`closing`, -1: not yet), and the calls in a complete block
# (`calls`: [(name, arguments)], None if the block is not JSON of the format's shape). `start`: nothing but
# whitespace since the answer began or the last call ended.
class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (vLLM `--tool-call-parser hermes`)."""

    name = "hermes"
    separators = None  # what may stand between calls: whitespace
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def prefix(self, function: str | None) -> str:
        if function is None:
            return self.OPEN + "\n"
        return f'{self.OPEN}\n{{"name": {json.dumps(function)}, "arguments": '

    def grammar(self, tools: list[dict], function: str | None, parallel: bool) -> str | None:
        """What may follow `prefix(function)`, as a Lark grammar with JSON schemas (llguidance): the named
        function's arguments and the call's end, or a call of any offered function (more calls after it where
        `parallel`); then the answer ends."""
        params = _parameters(tools)
        close = json.dumps("\n" + self.CLOSE)
        if function is not None:
            return f'start: args "}}" {close}\nargs: {_json_rule(params[function])}\n'
        more = f' ({json.dumps(chr(10) + self.OPEN + chr(10))} call {close})*' if parallel else ""
        return f"start: call {close}{more}\ncall: {_json_rule(_call_schema(params, 'arguments'))}\n"

    def opening(self, text: str, start: bool) -> int:
        return text.find(self.OPEN)

    def partial(self, text: str, start: bool) -> int:
        return _partial(text, self.OPEN)

    def closing(self, block: str) -> int:
        i = block.find(self.CLOSE, len(self.OPEN))
        return -1 if i < 0 else i + len(self.CLOSE)

    def calls(self, block: str) -> list[tuple] | None:
        body = block[len(self.OPEN):]
        body = body[: -len(self.CLOSE)] if body.endswith(self.CLOSE) else body
        return _shape(_loads(body.strip()), "arguments")


class Llama3JsonParser:
    """`<|python_tag|>{"name": ..., "parameters": {...}}`, the answer being the call; several separated by `;`
    (vLLM `--tool-call-parser llama3_json`, vllm/entrypoints/openai/tool_parsers/llama_tool_parser.py)."""

    name = "llama3"
    separators = " \t\r\n;"
    TAG = "<|python_tag|>"

    def grammar(self, tools: list[dict], function: str | None, parallel: bool) -> str | None:
        """What may follow `prefix(function)` (Lark, llguidance): the named function's parameters and the
        object's end; or, after the opened name, an offered function's name, its parameters, the end (more whole
        calls after `; ` where `parallel`); then the answer ends."""
        params = _parameters(tools)
        if function is not None:
            return f'start: args "}}"\nargs: {_json_rule(params[function])}\n'
        names = list(params)
        rules = [f'first: {" | ".join(f"call{i}" for i in range(len(names)))}']
        for i, n in enumerate(names):
            rest = json.dumps(n + '", "parameters": ')  # the name's end, then its parameters' key
            rules.append(f'call{i}: {rest} args{i} "}}"')
            rules.append(f"args{i}: {_json_rule(params[n])}")
        more = ' ("; " call)*' if parallel else ""
        rules.append(f"call: {_json_rule(_call_schema(params, 'parameters'))}")
        return f"start: first{more}\n" + "\n".join(rules) + "\n"

    def prefix(self, function: str | None) -> str:
        return '{"name": "' if function is None else f'{{"name": {json.dumps(function)}, "parameters": '

    def opening(self, text: str, start: bool) -> int:
        if not start:
            return -1
        i = len(text) - len(text.lstrip(self.separators))
        return i if text.startswith((self.TAG, "{"), i) else -1

    def partial(self, text: str, start: bool) -> int:
        # at the start, separators and the beginning of the tag are all held (a call may follow)
        return len(text) if start and self.TAG.startswith(text.lstrip(self.separators)) else 0

    def closing(self, block: str) -> int:
        i = len(self.TAG) if block.startswith(self.TAG) else 0
        i += len(block[i:]) - len(block[i:].lstrip())
        if i < len(block) and block[i] == "{":
            return _json_end(block, i)
        return -1  # not JSON after the tag (a built-in tool's code): the rest of the answer, judged at the end

    def calls(self, block: str) -> list[tuple] | None:
        return _shape(_loads(block.removeprefix(self.TAG).strip()), "parameters")


class MistralParser:
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (vLLM `--tool-call-parser mistral`, pre-v11 tokenizer
    format; vLLM keeps special tokens in the text for it, this server skips them, hence the bare array)."""

    name = "mistral"
    separators = None
    MARK = "[TOOL_CALLS]"
    _BARE = re.compile(r"\s*\[\s*(\{|\Z)")  # the array at the start of an answer (or its beginning)

    def grammar(self, tools: list[dict], function: str | None, parallel: bool) -> str | None:
        """What may follow `prefix(function)` (Lark, llguidance): the named function's arguments and the
        array's end, or an array of calls of offered functions (one unless `parallel`); then the answer ends."""
        params = _parameters(tools)
        if function is not None:
            return f'start: args "}}]"\nargs: {_json_rule(params[function])}\n'
        more = ' (", " call)*' if parallel else ""
        return f'start: "[" call{more} "]"\ncall: {_json_rule(_call_schema(params, "arguments"))}\n'

    def prefix(self, function: str | None) -> str:
        return self.MARK if function is None else f'{self.MARK}[{{"name": {json.dumps(function)}, "arguments": '

    def opening(self, text: str, start: bool) -> int:
        if start and (m := self._BARE.match(text)) and m.group(1):
            return len(text) - len(text.lstrip())  # the "[" (no marker can come before it)
        return text.find(self.MARK)

    def partial(self, text: str, start: bool) -> int:
        if start and (m := self._BARE.match(text)) and not m.group(1):
            return len(text.lstrip())  # "[" and whitespace: perhaps an array of calls
        return _partial(text, self.MARK)

    def closing(self, block: str) -> int:
        i = len(self.MARK) if block.startswith(self.MARK) else 0
        i += len(block[i:]) - len(block[i:].lstrip())
        if i == len(block):
            return -1
        if block[i] not in "[{":
            return i  # a marker without calls after it: text
        return _json_end(block, i)

    def calls(self, block: str) -> list[tuple] | None:
        return _shape(_loads(block.removeprefix(self.MARK).strip()), "arguments")


ToolParser = HermesParser | Llama3JsonParser | MistralParser


def _parameters(tools: list[dict]) -> dict[str, dict]:
    """Each offered function's parameter schema (any object where it gives none)."""
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}


def _json_rule(schema: dict) -> str:
    """A Lark rule body matching JSON under `schema`, with the bounded whitespace of `eagle3.decoding.grammar`."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": WHITESPACE}})


def _call_schema(params: dict[str, dict], key: str) -> dict:
    """A call object of any offered function: {"name": its name, key: its arguments}."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, key: p},
                       "required": ["name", key], "additionalProperties": False} for n, p in params.items()]}


def _shape(obj, key: str) -> list[tuple] | None:
    """[(name, arguments)] from a decoded call or list of calls; None unless each is {"name": str, key: ...}
    (either arguments key is taken; arguments given as a JSON string are decoded)."""
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get(key, item.get("arguments" if key == "parameters" else "parameters", {}))
        if isinstance(args, str):
            args = _loads(args)
        out.append((item["name"], args))
    return out or None


def parser_for(source: str) -> ToolParser:
    """The parser for the calls a chat template teaches its model to write; Hermes when it shows none."""
    if "[TOOL_CALLS]" in source:
        return MistralParser()
    if "<tool_call>" not in source and ("<|python_tag|>" in source or '"parameters": ' in source):
        return Llama3JsonParser()
    return HermesParser()


def takes_tools(source: str) -> bool:
    """Whether a chat template renders tools itself (its source refers to `tools`)."""
    return re.search(r"\btools\b", source) is not None


# -- reading calls --------------------------------------------------------------------------------
class CallStream:
    """Cuts an answer, fed in pieces, into content and tool calls. `feed` and `finish` return deltas:
    `{"content": text}` or `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}`.
    The concatenated content and the calls do not depend on how the answer is cut into pieces."""

    def __init__(self, parser: ToolParser, names: set[str], prefix: str = "", parallel: bool = True):
        self.parser, self.names, self.parallel = parser, names, parallel
        self.buf = prefix  # text not yet classified (outside a call); starts with the forced prefix, if any
        self.ws = ""  # whitespace after the last content, held: dropped if a call follows
        self.block: str | None = None  # an open call block, from its opening marker
        self.block_ws = ""  # the whitespace held before the open block, restored if it is not a call
        self.start = True  # nothing but whitespace since the answer began or the last call ended
        self.after_call = False  # drop separators until text that is not
        self.calls = 0  # calls emitted
        self.errors = 0  # blocks returned as text

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        self.buf += text
        self._run(out)
        return _merge(out)

    def finish(self) -> list[dict]:
        """The end of the answer: an open block is a call if its JSON is complete, held text is content."""
        out: list[dict] = []
        self._run(out)
        if self.block is not None:
            block, self.block = self.block, None
            self._close(block, out)
        else:
            self._text(self.buf, out)
            self.buf = ""
        if self.ws:
            out.append({"content": self.ws})
            self.ws = ""
        return _merge(out)

    def _run(self, out: list[dict]) -> None:
        while True:
            if self.block is not None:
                self.block += self.buf
                self.buf = ""
                end = self.parser.closing(self.block)
                if end < 0:
                    return
                block, self.buf, self.block = self.block[:end], self.block[end:], None
                self._close(block, out)
                continue
            i = self.parser.opening(self.buf, self.start)
            if i >= 0:
                self._text(self.buf[:i], out, call_next=True)
                self.block, self.buf = self.buf[i:], ""
                continue
            cut = len(self.buf) - self.parser.partial(self.buf, self.start)
            self._text(self.buf[:cut], out)
            self.buf = self.buf[cut:]
            return

    def _text(self, text: str, out: list[dict], call_next: bool = False) -> None:
        if self.after_call:
            text = text.lstrip(self.parser.separators)
            if not text:
                if call_next:
                    self.block_ws = ""
                return
            self.after_call = False
        text = self.ws + text
        body = text.rstrip()
        if call_next:
            self.block_ws, self.ws = text[len(body):], ""
        else:
            self.ws = text[len(body):]
        if body:
            out.append({"content": body})
            self.start = False

    def _close(self, block: str, out: list[dict]) -> None:
        calls = self.parser.calls(block)
        bad = calls is None or any(name not in self.names or not isinstance(args, dict) for name, args in calls)
        if bad:
            self.errors += 1
            log.warning("a malformed %s tool call is returned as text: %.200r", self.parser.name, block)
            out.append({"content": self.block_ws + block})
            self.start = self.after_call = False
        else:
            for name, args in calls:
                if self.parallel or self.calls == 0:  # parallel_tool_calls false: the first call only
                    arguments = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
                    out.append({"tool_calls": [{"index": self.calls, "id": new_call_id(), "type": "function",
                                                "function": {"name": name, "arguments": arguments}}]})
                    self.calls += 1
            self.start = self.after_call = True
        self.block_ws = ""


def _merge(deltas: list[dict]) -> list[dict]:
    """Adjacent content deltas as one."""
    out: list[dict] = []
    for d in deltas:
        if "content" in d and out and "content" in out[-1]:
            out[-1] = {"content": out[-1]["content"] + d["content"]}
        else:
            out.append(d)
    return out


@dataclass
class ToolCalls:
    """How one request's answer is read: its format, the functions it may call, the forced start of its turn."""

    parser: ToolParser
    names: set[str]
    prefix: str = ""
    parallel: bool = True
    errors: int = 0  # malformed calls of the last `parse`
    grammar: str | None = None  # a forced call's grammar (engine text, `eagle3.decoding.grammar`); None: free

    def stream(self) -> CallStream:
        return CallStream(self.parser, self.names, self.prefix, self.parallel)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole answer; content None when calls leave only whitespace. Malformed calls
        are counted in `errors`."""
        s = self.stream()
        deltas = s.feed(text) + s.finish()
        self.errors = s.errors
        content = "".join(d.get("content", "") for d in deltas)
        calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", ())]
        return (None if calls and not content.strip() else content), calls


# -- rendering ------------------------------------------------------------------------------------
HERMES_SYSTEM = """# Tools

You may call one or more functions to help with the user's request. The functions you can call are described by
the JSON signatures inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and arguments inside <tool_call></tool_call>:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>{parallel}"""


def _call_block(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def hermes_messages(messages: list[dict], tools: list[dict], parallel: bool = True) -> list[dict]:
    """`messages` in ordinary turns: `tools` (none: nothing added) in the system turn, assistant calls as
    `<tool_call>` blocks, each run of tool results as one user turn of `<tool_response>` blocks."""
    out: list[dict] = []
    if tools:
        text = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools),
                                    parallel="" if parallel else "\n\nCall at most one function per answer.")
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + text})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": text})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif m.get("tool_calls"):
            calls = [_call_block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + calls)})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def template_source(tokenizer, chat_template: str | None = None) -> str:
    """The chat template the server renders with (a tokenizer's named templates joined)."""
    source = chat_template or getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(source.values()) if isinstance(source, dict) else source


def render(tokenizer, messages: list[dict], tools: list[dict], tool_choice: str = "auto",
           tool_function: str | None = None, parallel: bool = True,
           chat_template: str | None = None) -> tuple[str, ToolCalls | None]:
    """The prompt text of a chat request, and how to read its answer's calls (None: no tools, or "none")."""
    source = template_source(tokenizer, chat_template)
    offered = tools if tool_choice != "none" else []
    kwargs = {}
    if takes_tools(source):
        parser = parser_for(source)
        if offered:
            kwargs["tools"] = offered
    else:
        parser = HermesParser()
        messages = hermes_messages(messages, offered, parallel)
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True,
                                         tokenize=False, **kwargs)
    if not offered:
        return text, None
    forced = tool_choice in ("required", "function")
    prefix = parser.prefix(tool_function) if forced else ""
    names = {t["function"]["name"] for t in offered}
    return text + prefix, ToolCalls(parser, names, prefix, parallel, grammar=_call_grammar(
        parser, offered, tool_function, parallel) if forced else None)


def _call_grammar(parser: ToolParser, tools: list[dict], function: str | None, parallel: bool) -> str | None:
    """A forced call's grammar in the engine's text, or None where the engine refuses a parameter schema (the
    call is then prompt-level: the model may still write a malformed call)."""
    lark = parser.grammar(tools, function, parallel)
    if lark is None:
        return None
    try:
        return GrammarCompiler.lark_text(lark)
    except GrammarError as e:
        log.warning("the forced tool call is not constrained: %s", e)
        return None
