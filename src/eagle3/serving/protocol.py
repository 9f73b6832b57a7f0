"""OpenAI request validation and response shapes for `/v1/chat/completions` and `/v1/completions`.

Every problem raises `RequestError`, which the app turns into OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with status 400 (messages follow OpenAI's wording).
Fields OpenAI defines but this server does not implement are accepted only at their neutral value
(`n: 1`, `logprobs: false`, penalties 0, ...) and rejected otherwise with a message saying so; fields
OpenAI does not define are rejected ("Unrecognized request argument"). `top_k` is accepted as an extension
(as vLLM does). Tool calls (`tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `tool`
messages) are validated here; `tools.py` renders and parses them.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3.decoding.grammar import GrammarCompiler, GrammarError

__all__ = ["ChatRequest", "CompletionRequest", "RequestError", "error_body", "parse_chat", "parse_completion"]

MAX_TEMPERATURE = 2.0


class RequestError(Exception):
    """A client error, reported in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- field checks -------------------------------------------------------------------------------
def _type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _bad_type(name: str, expected: str, v: Any) -> RequestError:
    return RequestError(f"Invalid type for '{name}': expected {expected}, but got {_type_name(v)} instead.",
                        param=name, code="invalid_type")


def _int(name: str, v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad_type(name, "an integer", v)
    return v


def _number(name: str, v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad_type(name, "a number", v)
    return float(v)


def _bool(name: str, v: Any) -> bool | None:
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad_type(name, "a boolean", v)
    return v


def _str(name: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise _bad_type(name, "a string", v)
    return v


def _unsupported(name: str, neutral: Callable[[Any], bool], what: str) -> Callable[[str, Any], Any]:
    def check(_name: str, v: Any) -> Any:
        if v is not None and not neutral(v):
            raise RequestError(f"'{name}' is not supported by this server ({what}).", param=name,
                               code="unsupported_parameter")
        return v
    return check


def _ignored(_name: str, v: Any) -> Any:
    return v


_COMMON: dict[str, Callable[[str, Any], Any]] = {
    "model": _str,
    "max_tokens": _int,
    "temperature": _number,
    "top_p": _number,
    "top_k": _int,
    "seed": _int,
    "stop": _ignored,  # checked below (a string or a list of strings)
    "stream": _bool,
    "stream_options": _ignored,  # checked below
    "n": _unsupported("n", lambda v: v == 1 and not isinstance(v, bool), "only n=1: send one request per choice"),
    "user": _str,
    "presence_penalty": _unsupported("presence_penalty", lambda v: v == 0, "only 0"),
    "frequency_penalty": _unsupported("frequency_penalty", lambda v: v == 0, "only 0"),
    "logit_bias": _unsupported("logit_bias", lambda v: v == {}, "no logit bias"),
}
_CHAT = {
    **_COMMON,
    "messages": _ignored,  # checked below
    "max_completion_tokens": _int,
    "logprobs": _unsupported("logprobs", lambda v: v is False, "no log probabilities"),
    "top_logprobs": _unsupported("top_logprobs", lambda v: v == 0, "no log probabilities"),
    "response_format": _ignored,  # checked below (`_response_format`)
    "tools": _ignored,  # checked below (`_tools`)
    "tool_choice": _ignored,  # checked below (`_tool_choice`)
    "parallel_tool_calls": _bool,
    "metadata": _ignored,
    "store": _bool,  # False: kept out of the server's traffic record (`eagle3 serve --record`)
}
_COMPLETION = {
    **_COMMON,
    "prompt": _ignored,  # checked below
    "logprobs": _unsupported("logprobs", lambda v: v == 0, "no log probabilities"),
    "echo": _unsupported("echo", lambda v: v is False, "the prompt is not echoed"),
    "best_of": _unsupported("best_of", lambda v: v == 1, "only best_of=1"),
    "suffix": _unsupported("suffix", lambda v: v == "", "no suffix (insertion)"),
}


@dataclass
class _Sampling:
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


@dataclass
class ChatRequest(_Sampling):
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)  # [{"type": "function", "function": {"name", ...}}]
    tool_choice: str = "none"  # "none", "auto", "required", or "function" (the one named `tool_function`)
    tool_function: str | None = None
    parallel_tool_calls: bool = True
    store: bool = True  # False: not recorded (`ServeConfig.record`)
    grammar: str | None = None  # `response_format` json_object / json_schema as the engine's grammar text


@dataclass
class CompletionRequest(_Sampling):
    prompt: str | list[int] = ""


def _load(raw: bytes | str) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"We could not parse the JSON body of your request ({e}). Send a JSON object.",
                           code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"The request body must be a JSON object, got {_type_name(body)}.", code="invalid_json")
    return body


def _common(body: dict, spec: dict, out: _Sampling, max_stop: int) -> None:
    unknown = sorted(set(body) - set(spec))
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                           code="unknown_parameter")
    values = {k: spec[k](k, v) for k, v in body.items()}
    if values.get("model") is None:
        raise RequestError("You must provide a model parameter.", param="model", code="missing_required_parameter")
    out.model = values["model"]
    if values.get("max_tokens") is not None:
        out.max_tokens = values["max_tokens"]
        if out.max_tokens < 1:
            raise RequestError(f"Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got "
                               f"{out.max_tokens} instead.", param="max_tokens", code="integer_below_min_value")
    t = values.get("temperature")
    if t is not None:
        if not 0.0 <= t <= MAX_TEMPERATURE:
            raise RequestError(f"Invalid 'temperature': expected a value between 0 and {MAX_TEMPERATURE:g}, but got "
                               f"{t:g} instead.", param="temperature", code="invalid_value")
        out.temperature = t
    p = values.get("top_p")
    if p is not None:
        if not 0.0 < p <= 1.0:
            raise RequestError(f"Invalid 'top_p': expected a value in (0, 1], but got {p:g} instead.",
                               param="top_p", code="invalid_value")
        out.top_p = p
    k = values.get("top_k")
    if k is not None:
        if k < -1:
            raise RequestError(f"Invalid 'top_k': expected -1 or 0 (off) or a positive integer, got {k}.",
                               param="top_k", code="invalid_value")
        out.top_k = max(k, 0)
    out.seed = values.get("seed")
    out.stream = bool(values.get("stream"))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad_type("stop", "a string or an array of strings", body["stop"])
        if len(stop) > max_stop:
            raise RequestError(f"Invalid 'stop': at most {max_stop} stop sequences are allowed, got {len(stop)}.",
                               param="stop", code="invalid_value")
        if any(s == "" for s in stop):
            raise RequestError("Invalid 'stop': stop sequences must be non-empty strings.", param="stop",
                               code="invalid_value")
        out.stop = stop
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _bad_type("stream_options", "an object", so)
        extra = sorted(set(so) - {"include_usage"})
        if extra:
            raise RequestError(f"Unrecognized request argument supplied: stream_options.{extra[0]}",
                               param=f"stream_options.{extra[0]}", code="unknown_parameter")
        if not out.stream:
            raise RequestError("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                               param="stream_options", code="invalid_value")
        out.include_usage = bool(_bool("stream_options.include_usage", so.get("include_usage")))


def _unknown(name: str) -> RequestError:
    return RequestError(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")


def _missing(name: str) -> RequestError:
    return RequestError(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")


def _invalid(name: str, message: str, code: str = "invalid_value") -> RequestError:
    return RequestError(f"Invalid value for '{name}': {message}", param=name, code=code)


def _object(name: str, v: Any, keys: set[str]) -> dict:
    """`v` as an object with no keys beyond `keys`."""
    if not isinstance(v, dict):
        raise _bad_type(name, "an object", v)
    extra = sorted(set(v) - keys)
    if extra:
        raise _unknown(f"{name}.{extra[0]}")
    return v


def _text(name: str, content: Any) -> str:
    """A message's content: a string or an array of text parts, joined."""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"'{name}[{j}]': only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                   "are supported.", param=name, code="unsupported_parameter")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _bad_type(name, "a string or an array of text parts", content)
    return content


def _tool_call(where: str, c: Any) -> dict:
    """One call of an assistant message, with its arguments decoded (chat templates write them with `tojson`)."""
    c = _object(where, c, {"id", "type", "function"})
    if not isinstance(c.get("id"), str):
        raise _missing(f"{where}.id") if c.get("id") is None else _bad_type(f"{where}.id", "a string", c["id"])
    if c.get("type", "function") != "function":
        raise _invalid(f"{where}.type", f"expected 'function', got {c['type']!r}.")
    if "function" not in c:
        raise _missing(f"{where}.function")
    f = _object(f"{where}.function", c["function"], {"name", "arguments"})
    for key in ("name", "arguments"):
        if f.get(key) is None:
            raise _missing(f"{where}.function.{key}")
        _str(f"{where}.function.{key}", f[key])
    try:
        arguments = json.loads(f["arguments"])
    except json.JSONDecodeError as e:
        raise _invalid(f"{where}.function.arguments", f"not valid JSON ({e}).") from None
    if not isinstance(arguments, dict):
        raise _invalid(f"{where}.function.arguments", f"expected a JSON object, got {_type_name(arguments)}.")
    return {"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": arguments}}


_MESSAGE_KEYS = {"role", "content", "name"}
_ROLE_KEYS = {"assistant": _MESSAGE_KEYS | {"tool_calls", "refusal"}, "tool": _MESSAGE_KEYS | {"tool_call_id"}}


def _message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad_type(where, "an object", m)
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"Invalid value for '{where}.role': expected one of 'system', 'developer', 'user', "
                           f"'assistant', 'tool', got {role!r}.", param=f"{where}.role", code="invalid_value")
    extra = sorted(set(m) - _ROLE_KEYS.get(role, _MESSAGE_KEYS))
    if extra:
        raise _unknown(f"{where}.{extra[0]}")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise _bad_type(f"{where}.tool_calls", "an array", calls)
    calls = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls or [])]
    # an assistant turn that only calls tools has no content (null)
    content = "" if calls and m.get("content") is None else _text(f"{where}.content", m.get("content"))
    out = {"role": "system" if role == "developer" else role, "content": content}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        if m.get("tool_call_id") is None:
            raise _missing(f"{where}.tool_call_id")
        out["tool_call_id"] = _str(f"{where}.tool_call_id", m["tool_call_id"])
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _name_tool_results(messages: list[dict]) -> None:
    """Give each tool result the name of the function whose call it answers (some templates write it)."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
    for m in messages:
        if m["role"] == "tool" and "name" not in m and m["tool_call_id"] in names:
            m["name"] = names[m["tool_call_id"]]


TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


def _check_schema(name: str, schema: Any) -> None:
    """`schema` must be a valid JSON Schema object (checked against its draft's metaschema)."""
    if not isinstance(schema, dict):
        raise _bad_type(name, "a JSON Schema object", schema)
    try:
        from jsonschema import exceptions, validators
    except ImportError:  # pragma: no cover - a server installed without its extras
        raise RequestError("This server cannot check tool schemas: install jsonschema (pip install "
                           "'eagle3[serve]').", param=name, status=500, type="server_error") from None
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as e:
        raise RequestError(f"Invalid schema for '{name}': {e.message} (at {e.json_path}).", param=name,
                           code="invalid_function_parameters") from None


def _tools(v: Any) -> list[dict]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise _bad_type("tools", "an array", v)
    tools, seen = [], set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        t = _object(where, t, {"type", "function"})
        if t.get("type") != "function":
            if t.get("type") is None:
                raise _missing(f"{where}.type")
            raise _invalid(f"{where}.type", f"only 'function' tools are supported, got {t['type']!r}.")
        if "function" not in t:
            raise _missing(f"{where}.function")
        f = _object(f"{where}.function", t["function"], {"name", "description", "parameters", "strict"})
        name = f.get("name")
        if name is None:
            raise _missing(f"{where}.function.name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise RequestError(f"Invalid '{where}.function.name': string does not match pattern. Expected a "
                               f"string that matches the pattern '{TOOL_NAME.pattern}', got {name!r}.",
                               param=f"{where}.function.name", code="invalid_value")
        if name in seen:
            raise _invalid(f"{where}.function.name", f"duplicate function name {name!r}: tool names must be unique.")
        seen.add(name)
        _str(f"{where}.function.description", f.get("description"))
        _bool(f"{where}.function.strict", f.get("strict"))
        if f.get("parameters") is not None:
            _check_schema(f"{where}.function.parameters", f["parameters"])
        tools.append({"type": "function", "function": {k: f[k] for k in ("name", "description", "parameters")
                                                       if f.get(k) is not None}})
    return tools


def _tool_choice(v: Any, tools: list[dict]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "function", the function's name). OpenAI's default: "auto" with tools."""
    if v is None:
        return ("auto" if tools else "none"), None
    if isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise _invalid("tool_choice", f"expected 'none', 'auto', 'required' or an object naming a function, "
                           f"got {v!r}.")
        choice, name = v, None
    elif isinstance(v, dict):
        c = _object("tool_choice", v, {"type", "function"})
        if c.get("type") != "function":
            raise _invalid("tool_choice.type", f"expected 'function', got {c.get('type')!r}.")
        if "function" not in c:
            raise _missing("tool_choice.function")
        f = _object("tool_choice.function", c["function"], {"name"})
        if f.get("name") is None:
            raise _missing("tool_choice.function.name")
        choice, name = "function", _str("tool_choice.function.name", f["name"])
    else:
        raise _bad_type("tool_choice", "a string or an object", v)
    if choice != "none" and not tools:
        raise _invalid("tool_choice", "'tool_choice' is only allowed when 'tools' are specified.")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise _invalid("tool_choice.function.name", f"no function named {name!r} in 'tools'.")
    return choice, name


def parse_chat(raw: bytes | str, max_stop: int = 4) -> ChatRequest:
    body = _load(raw)
    req = ChatRequest()
    _common(body, _CHAT, req, max_stop)
    req.store = body.get("store") is not False
    if body.get("max_completion_tokens") is not None:
        mct = _int("max_completion_tokens", body["max_completion_tokens"])
        if mct < 1:
            raise RequestError(f"Invalid 'max_completion_tokens': expected a value >= 1, but got {mct} instead.",
                               param="max_completion_tokens", code="integer_below_min_value")
        req.max_tokens = mct if req.max_tokens is None else min(req.max_tokens, mct)
    msgs = body.get("messages")
    if msgs is None:
        raise RequestError("Missing required parameter: 'messages'.", param="messages",
                           code="missing_required_parameter")
    if not isinstance(msgs, list):
        raise _bad_type("messages", "an array", msgs)
    if not msgs:
        raise RequestError("Invalid 'messages': empty array. Expected an array with minimum length 1, but got an "
                           "empty array instead.", param="messages", code="empty_array")
    req.messages = [_message(i, m) for i, m in enumerate(msgs)]
    _name_tool_results(req.messages)
    req.tools = _tools(body.get("tools"))
    req.tool_choice, req.tool_function = _tool_choice(body.get("tool_choice"), req.tools)
    req.parallel_tool_calls = body.get("parallel_tool_calls") is not False
    req.grammar = _response_format(body.get("response_format"))
    if req.grammar is not None and req.tool_choice in ("required", "function"):
        raise _invalid("response_format", "a JSON answer cannot be combined with a 'tool_choice' that forces a tool "
                       "call; use tool_choice 'auto' or 'none'.")
    return req


def _response_format(v: Any) -> str | None:
    """OpenAI's `response_format`: None for text, else the grammar (engine text) of the JSON schema the answer
    must follow (json_object: any JSON object). Built here, so a bad schema is a 400 naming the field."""
    if v is None:
        return None
    fmt = _object("response_format", v, {"type", "json_schema"})
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise _invalid("response_format.type", f"expected 'text', 'json_object' or 'json_schema', got {kind!r}.")
    if kind != "json_schema" and "json_schema" in fmt:
        raise _unknown("response_format.json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    else:
        if "json_schema" not in fmt:
            raise _missing("response_format.json_schema")
        js = _object("response_format.json_schema", fmt["json_schema"], {"name", "description", "schema", "strict"})
        name = js.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise _invalid("response_format.json_schema.name", "expected a name of 1 to 64 letters, digits, "
                           "underscores or dashes.")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise _bad_type("response_format.json_schema.schema", "an object", schema)
        if "strict" in js and not isinstance(js["strict"], bool):
            raise _bad_type("response_format.json_schema.strict", "a boolean", js["strict"])
    try:
        return GrammarCompiler.grammar_text(schema)
    except GrammarError as e:
        raise _invalid("response_format.json_schema.schema", f"{e}.") from None


def parse_completion(raw: bytes | str, max_stop: int = 4) -> CompletionRequest:
    body = _load(raw)
    req = CompletionRequest()
    _common(body, _COMPLETION, req, max_stop)
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    # a list holding one prompt (text or token ids) is one prompt; several prompts would be several choices
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(x, list) for x in prompt):
        raise RequestError("Several prompts in one request are not supported by this server; send one request "
                           "per prompt.", param="prompt", code="unsupported_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        raise RequestError("Several prompts in one request are not supported by this server; send one request "
                           "per prompt.", param="prompt", code="unsupported_parameter")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            raise _bad_type("prompt", "a string, an array of token ids, or an array with one string", body["prompt"])
    elif not isinstance(prompt, str):
        raise _bad_type("prompt", "a string or an array of token ids", prompt)
    if prompt == "":
        raise RequestError("Invalid 'prompt': empty string. Give at least one character.", param="prompt",
                           code="invalid_value")
    req.prompt = prompt
    return req


# -- responses ----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(rid: str, model: str, text: str | None, finish: str, prompt_tokens: int, completion_tokens: int,
                  tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_response(rid: str, model: str, text: str, finish: str, prompt_tokens: int,
                        completion_tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
