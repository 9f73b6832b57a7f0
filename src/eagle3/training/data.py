"""Training rows: read them from data files and normalise them; ChatRenderer (`eagle3.training.render`) then
renders them with the target's chat template and masks them.

* `iter_rows(path, problems)` streams raw rows from ShareGPT/FastChat JSON (an array, possibly truncated
  mid-record), JSONL (either also gzipped: `.json.gz`, `.jsonl.gz`), parquet, or a `datasets.save_to_disk`
  folder; unreadable parts are counted in `problems`.
* `normalize_conversation(row)` turns a ShareGPT (`conversations`/`from`/`value`) or OpenAI (`messages`/
  `role`/`content`) row into a clean `[{"role", "content"}]` list, or raises `BadRow(reason)`.
* Tool calls are kept: OpenAI assistant messages with `tool_calls` (arguments a JSON string or an object; the
  legacy `function_call` too) and `tool` results, and ShareGPT `function_call` / `observation` turns (the
  convention of LLaMA-Factory's ShareGPT format: the value of a `function_call` turn is a JSON call
  `{"name", "arguments"}` or a list of them). They come out as OpenAI messages, arguments as objects, each result
  carrying the `tool_call_id` (and `name`) of the call it answers. `conversation_tools(row)` reads the row's
  `tools` (a list, or a JSON string of one, of OpenAI tools or bare function definitions).
* Completion rows, for base models (`completion_segments`): `{"text"}` (all of it trained on) or
  `{"prompt", "completion"}` (the completion trained on), and `.txt` files (one document per blank-line-separated
  block, read as `{"text"}` rows). They are tokenised as raw text, the way a raw prompt is (the tokenizer's own
  BOS, no end-of-text token), with no template; so are conversations under the `plain` template (`PLAIN`): their
  messages' texts back to back, the assistant ones trained on.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from eagle3.config import ConfigError

# Role names seen in ShareGPT/FastChat dumps and OpenAI-style rows, mapped to chat-template roles.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "function_call": "assistant",  # ShareGPT (LLaMA-Factory): the assistant's call, its value a JSON call
    "tool": "tool",
    "observation": "tool",  # ShareGPT (LLaMA-Factory): a tool's result
    "function": "tool",  # OpenAI's legacy function result
    "ipython": "tool",  # Llama 3.1's role for tool results
}

# Why a row was rejected (keys of the report's `dropped` counter).
BAD_REASONS = (
    "malformed",  # not a dict, no `conversations`/`messages` list, a message without role or text field
    "empty",  # no messages at all
    "unknown_role",  # a role outside ROLE_MAP (e.g. "bing")
    "non_text_content",  # image/audio parts, or content that is not text (e.g. content=None and no tool calls)
    "bad_tool_call",  # a call without a function name, arguments that are not a JSON object, or bad `tools`
    "empty_turn",  # a message whose text is empty or whitespace
    "misplaced_system",  # a system message after the first position
    "not_alternating",  # two user or two assistant messages in a row; tool results not right after a call
    "no_assistant_turn",  # nothing to supervise
    "template_error",  # the chat template raised (e.g. "roles must alternate", "system role not supported")
    "prefix_mismatch",  # no assistant turn passed the prefix-rendering check (see module docstring)
    "content_not_found",  # the template changed the assistant text beyond whitespace in every turn
    "no_chat_template",  # a conversation, but the tokenizer has no chat template and none was given
)

# `--chat-template plain`: no template; conversations are raw text (see the module docstring)
PLAIN = "plain"
# Fields of a completion row (`completion_segments`); a conversation has `conversations` or `messages`.
COMPLETION_FIELDS = ("text", "prompt", "completion")
CHAT_FIELDS = ("conversations", "messages")


class BadRow(Exception):
    """A row that cannot become a training example; `reason` is one of BAD_REASONS."""

    def __init__(self, reason: str, detail: str = "", turns: Counter[str] | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.turns: Counter[str] = (
            turns if turns is not None else Counter()
        )  # turn outcomes seen before failing

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across worker processes
        return (BadRow, (self.reason, self.detail, self.turns))


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------
_JSON_CHUNK_CHARS = 1 << 20
_JSON_SEPARATORS = re.compile(r"[\s,]*")
_SUPPORTED_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet", ".arrow")


def _data_suffix(path: Path) -> str:
    """'.jsonl.gz' for a gzipped JSONL file, else the last suffix (lower case)."""
    suffixes = [x.lower() for x in path.suffixes[-2:]]
    return "".join(suffixes) if suffixes[-1:] == [".gz"] else (suffixes[-1] if suffixes else "")


class _GzipBytes(io.RawIOBase):
    """The decompressed bytes of a `.gz` file (all its members). A stream cut short (a download or copy that
    stopped) ends early, counted once as `gzip_truncated`, with every byte before the cut delivered: decompressing
    chunk by chunk with zlib, rather than through `gzip.GzipFile`, which raises without returning what it had
    decoded from a short file."""

    CHUNK = 1 << 16

    def __init__(self, path: Path, problems: Counter[str]):
        self._path = path
        self._raw = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._z = zlib.decompressobj(31)  # 31: gzip header and trailer
        self._problems = problems
        self._out, self._pos = b"", 0
        self._done = self._seen = False

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        while self._pos >= len(self._out) and not self._done:
            chunk = self._raw.read(self.CHUNK)
            if not chunk:
                if self._seen and not self._z.eof:
                    self._problems["gzip_truncated"] += 1
                self._done = True
                return
            self._seen = True
            try:
                out = self._z.decompress(chunk)
                while self._z.eof and self._z.unused_data.strip(b"\0"):  # another member follows
                    rest = self._z.unused_data
                    self._z = zlib.decompressobj(31)
                    out += self._z.decompress(rest)
            except zlib.error as e:
                raise ConfigError(f"--data {self._path}: not a readable gzip file ({e})") from None
            self._out, self._pos = out, 0

    def readinto(self, b: Any) -> int:
        self._fill()
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _open_text(path: Path, problems: Counter[str]) -> IO[str]:
    """A text handle on a JSON/JSONL file, decompressing `.gz` on the fly."""
    if path.suffix.lower() == ".gz":
        return io.TextIOWrapper(io.BufferedReader(_GzipBytes(path, problems)), encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_rows(path: str | os.PathLike[str], problems: Counter[str] | None = None) -> Iterator[Any]:
    """Stream the raw rows of one data file or folder.

    `problems` counts what could not be read (`jsonl_invalid_line`, `json_broken_tail`); a truncated JSON array
    yields every complete record before the break. Raises ConfigError for a missing path or unknown format.
    """
    problems = problems if problems is not None else Counter()
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--data {p}: no such file or folder")
    if p.is_dir():
        yield from _iter_dir(p, problems)
        return
    suffix = _data_suffix(p)
    if suffix == ".txt":
        yield from _iter_text_blocks(p)
    elif suffix == ".parquet":
        yield from _iter_parquet(p)
    elif suffix == ".arrow":
        yield from _iter_arrow_file(p)
    elif suffix in (".json", ".jsonl", ".json.gz", ".jsonl.gz"):
        first = _first_non_space_char(p)
        if first == "[":
            yield from _iter_json_array(p, problems)
        elif first == "{":
            yield from _iter_jsonl(p, problems)
        elif first == "":
            return
        else:
            raise ConfigError(
                f"--data {p}: expected a JSON array of conversations or JSONL (one object per line), "
                f"but the file starts with {first!r}"
            )
    else:
        raise ConfigError(
            f"--data {p}: unknown file type {suffix!r}; use one of {', '.join(_SUPPORTED_SUFFIXES)}, .txt "
            "or a folder written by datasets' save_to_disk"
        )


def _iter_text_blocks(path: Path) -> Iterator[dict[str, str]]:
    """A plain-text file as `{"text": block}` rows: one per block of lines between blank lines."""
    block: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                block.append(line.rstrip("\r\n"))
            elif block:
                yield {"text": "\n".join(block)}
                block = []
    if block:
        yield {"text": "\n".join(block)}


def _first_non_space_char(path: Path) -> str:
    with _open_text(path, Counter()) as f:  # the full read below counts any problem once
        while True:
            chunk = f.read(4096)
            if not chunk:
                return ""
            stripped = chunk.lstrip()
            if stripped:
                return stripped[0]


def _iter_json_array(path: Path, problems: Counter[str]) -> Iterator[Any]:
    """Decode array elements one at a time (`raw_decode`), so a file truncated mid-record still yields its head.

    Memory stays at about one chunk plus the largest record. Reading stops at the first element that cannot be
    decoded once the whole rest of the file is in the buffer (a truncated or broken tail), counted once.
    """
    decoder = json.JSONDecoder()
    with _open_text(path, problems) as f:
        buf = f.read(_JSON_CHUNK_CHARS)
        eof = not buf
        pos = len(buf) - len(buf.lstrip())
        if pos >= len(buf) or buf[pos] != "[":
            raise ConfigError(f"--data {path}: expected a JSON array starting with '['")
        pos += 1
        while True:
            pos = _JSON_SEPARATORS.match(buf, pos).end()
            if pos >= len(buf):
                if eof:
                    problems["json_unterminated_array"] += 1
                    return
                buf, pos, eof = _refill(f, buf, pos, _JSON_CHUNK_CHARS)
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    problems["json_broken_tail"] += 1
                    return
                # the record runs past the buffer: read at least as much again (geometric growth)
                buf, pos, eof = _refill(f, buf, pos, max(_JSON_CHUNK_CHARS, len(buf) - pos))
                continue
            if end >= len(buf) and not eof:
                # a scalar could continue in the next chunk; records are objects, but stay exact anyway
                buf, pos, eof = _refill(f, buf, pos, _JSON_CHUNK_CHARS)
                continue
            yield obj
            pos = end


def _refill(f: Any, buf: str, pos: int, size: int) -> tuple[str, int, bool]:
    more = f.read(size)
    return buf[pos:] + more, 0, not more


def _iter_jsonl(path: Path, problems: Counter[str]) -> Iterator[Any]:
    with _open_text(path, problems) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                problems["jsonl_invalid_line"] += 1


def _require_pyarrow(path: Path) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ConfigError(
            f"--data {path}: reading parquet/arrow data needs pyarrow, in the data extra: "
            "pip install 'eagle3[data]' (or convert the data to JSONL first)"
        ) from None
    return pyarrow


def _iter_parquet(path: Path) -> Iterator[Any]:
    _require_pyarrow(path)
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
        yield from batch.to_pylist()


def _iter_arrow_file(path: Path) -> Iterator[Any]:
    """Arrow IPC as written by `datasets` (stream format), or the random-access file format."""
    pa = _require_pyarrow(path)
    import pyarrow.ipc

    with pa.memory_map(str(path)) as source:
        try:
            reader = pyarrow.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            file_reader = pyarrow.ipc.open_file(source)
            for i in range(file_reader.num_record_batches):
                yield from file_reader.get_batch(i).to_pylist()
            return
        for batch in reader:
            yield from batch.to_pylist()


def _iter_dir(path: Path, problems: Counter[str]) -> Iterator[Any]:
    """A `save_to_disk` folder (state.json lists the arrow shards), its DatasetDict parent, or a folder of files."""
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if "train" not in splits:
            raise ConfigError(
                f"--data {path}: a DatasetDict without a 'train' split; pass one split's folder of {splits}"
            )
        yield from _iter_dir(path / "train", problems)
        return
    if (path / "state.json").exists():
        state = json.loads((path / "state.json").read_text())
        for shard in state.get("_data_files", []):
            yield from _iter_arrow_file(path / shard["filename"])
        return
    files = sorted(q for q in path.rglob("*") if q.is_file() and _data_suffix(q) in _SUPPORTED_SUFFIXES)
    if not files:
        raise ConfigError(f"--data {path}: the folder holds no {', '.join(_SUPPORTED_SUFFIXES)} files")
    both = [q for q in files if q.with_name(q.name + ".gz") in files]
    if both:  # `gzip -k` leaves the original: reading both would train on every row twice
        raise ConfigError(f"--data {path}: {both[0].name} and {both[0].name}.gz are both there (the same rows twice?); "
                          "remove one or pass the file you mean")
    for q in files:
        yield from iter_rows(q, problems)


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------
def _message_text(content: Any) -> str:
    """A message's text: a string, or OpenAI content parts that are all `{"type": "text"}`."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise BadRow("non_text_content", f"content part {str(part)[:60]!r}")
        # vLLM joins text parts with a newline (vllm-project/vllm `vllm/entrypoints/chat_utils.py`)
        return "\n".join(texts)
    raise BadRow("non_text_content", f"content of type {type(content).__name__}")


def completion_segments(row: Any) -> list[tuple[str, bool]] | None:
    """A completion row as (text, trained on?) pieces: `{"prompt", "completion"}` or `{"text"}`; None for a row
    that is not one (a conversation, or neither field set). Empty text is a `BadRow("empty_turn")`."""
    if not isinstance(row, dict) or any(k in row for k in (*CHAT_FIELDS, "conversation")):
        return None
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        segments = [(row["prompt"], False), (row["completion"], True)]
    elif isinstance(row.get("text"), str):
        segments = [(row["text"], True)]
    else:
        return None
    if not any(text.strip() for text, trained in segments if trained):
        raise BadRow("empty_turn", "empty completion text")
    return segments


def _json_value(text: Any, what: str) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRow("bad_tool_call", f"{what} is not JSON ({e.msg})") from None


def _tool_calls(m: dict, sharegpt_call: bool, first_id: int) -> list[dict]:
    """An assistant message's calls as `[{"id", "type": "function", "function": {"name", "arguments": {...}}}]`
    ([] for none); calls without an id get `call_<n>`, numbered through the conversation from `first_id`."""
    if sharegpt_call:
        value = _json_value(m.get("value", m.get("content")), "a function_call turn")
        items = [{"function": c} for c in (value if isinstance(value, list) else [value])]
    elif m.get("tool_calls"):
        items = m["tool_calls"]
    elif m.get("function_call"):
        items = [{"function": m["function_call"]}]
    else:
        return []
    if not isinstance(items, list):
        raise BadRow("bad_tool_call", "tool_calls is not a list")
    calls = []
    for c in items:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadRow("bad_tool_call", "a tool call without a function name")
        arguments = _json_value(f.get("arguments", f.get("parameters", {})), f"the arguments of {f['name']!r}")
        if not isinstance(arguments, dict):
            raise BadRow("bad_tool_call", f"the arguments of {f['name']!r} are not a JSON object")
        call_id = c.get("id") or f"call_{first_id + len(calls)}"
        calls.append({"id": str(call_id), "type": "function", "function": {"name": f["name"], "arguments": arguments}})
    return calls


def _result_text(content: Any) -> str:
    """A tool result's text: text as `_message_text` reads it; a JSON value (some datasets store objects) as JSON."""
    if isinstance(content, dict) or (isinstance(content, list) and not all(
            isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text") for p in content)):
        return json.dumps(content, ensure_ascii=False)
    return _message_text("" if content is None else content)


def conversation_tools(row: Any) -> list[dict]:
    """The row's `tools` as OpenAI tools `[{"type": "function", "function": {"name", ...}}]`; [] for none.
    Accepts a list or a JSON string of one (as parquet datasets store it), of OpenAI tools or bare functions."""
    tools = row.get("tools") if isinstance(row, dict) else None
    tools = _json_value(tools, "the row's tools") if tools else []
    if not isinstance(tools, list):
        raise BadRow("bad_tool_call", "`tools` is not a list")
    out = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and isinstance(t.get("function"), dict) else t
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadRow("bad_tool_call", "a tool that is not a function definition with a name")
        out.append({"type": "function", "function": f})
    return out


def normalize_message(m: Any, calls_so_far: int) -> dict[str, Any]:
    """One raw message, normalised (see `normalize_conversation`)."""
    if not isinstance(m, dict):
        raise BadRow("malformed", "a message is not an object")
    role_name = m.get("from", m.get("role"))
    if not isinstance(role_name, str):
        raise BadRow("malformed", "a message has no 'from'/'role'")
    role = ROLE_MAP.get(role_name.lower())
    if role is None:
        raise BadRow("unknown_role", role_name)
    if "value" in m:
        content = m["value"]
    elif "content" in m:
        content = m["content"]
    else:
        raise BadRow("malformed", "a message has no 'value'/'content'")
    if role == "tool":
        message = {"role": "tool", "content": _result_text(content)}
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        return message
    calls = _tool_calls(m, role_name.lower() == "function_call", calls_so_far) if role == "assistant" else []
    if calls:
        text = "" if content is None or role_name.lower() == "function_call" else _message_text(content)
        message = {"role": role, "content": text, "tool_calls": calls}
    else:
        message = {"role": role, "content": _message_text(content)}
    if role == "assistant" and m.get("finish_reason") == "length":
        message["finish_reason"] = "length"
    return message


def link_tool_results(messages: list[dict[str, Any]]) -> None:
    """Give each tool result without one the id (and name) of the call it answers: the k-th result after a call
    turn answers its k-th call (the last one when there are more results than calls)."""
    calls: list[dict] = []
    k = 0
    names: dict[str, str] = {}
    for m in messages:
        if m["role"] == "assistant":
            calls, k = m.get("tool_calls", []), 0
            names.update((c["id"], c["function"]["name"]) for c in calls)
        elif m["role"] == "tool":
            if "tool_call_id" not in m and calls:
                m["tool_call_id"] = calls[min(k, len(calls) - 1)]["id"]
            if "name" not in m and m.get("tool_call_id") in names:
                m["name"] = names[m["tool_call_id"]]
            k += 1


def normalize_conversation(
    row: Any, system_prompt: str | None = None, repairs: Counter[str] | None = None
) -> list[dict[str, Any]]:
    """A clean `[{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}, ...]` list, or `BadRow`.

    Turns go user, assistant, user, ...; an assistant turn with `tool_calls` is followed by its `tool` results
    and then the assistant again. Repairs that keep the row (counted in `repairs`): a leading assistant message
    (and any results of its calls) is dropped, as FastChat/EAGLE do (SafeAILab/EAGLE
    `eagle/ge_data/ge_data_all_vicuna.py`: `if roles[source[0]["from"]] != conv.roles[0]: source = source[1:]`)
    - ShareGPT splits long chats into parts that start with the assistant; trailing user messages and tool
    results are dropped (nothing after them to supervise); `system_prompt` is inserted when the row has no
    system message. A row-level `"system"` string (some ShareGPT variants) counts as a system message.
    An assistant message with `"finish_reason": "length"` (cut at the generation limit) keeps that key.
    """
    repairs = repairs if repairs is not None else Counter()
    if not isinstance(row, dict):
        raise BadRow("malformed", f"row is a {type(row).__name__}, not an object")
    raw = row.get("conversations", row.get("messages"))
    if raw is None and "conversation" in row:
        raw = row["conversation"]
    if not isinstance(raw, list):
        raise BadRow("malformed", "no 'conversations' or 'messages' list")
    if not raw:
        raise BadRow("empty")
    messages: list[dict[str, Any]] = []
    calls_so_far = 0
    for m in raw:
        messages.append(normalize_message(m, calls_so_far))
        calls_so_far += len(messages[-1].get("tool_calls", ()))
    link_tool_results(messages)

    system: list[dict[str, Any]] = []
    if messages[0]["role"] == "system":
        system, messages = messages[:1], messages[1:]
    elif isinstance(row.get("system"), str) and row["system"].strip():
        system = [{"role": "system", "content": row["system"]}]
    elif system_prompt is not None:
        system = [{"role": "system", "content": system_prompt}]
        repairs["system_prompt_added"] += 1
    if any(m["role"] == "system" for m in messages):
        raise BadRow("misplaced_system")
    if messages and messages[0]["role"] == "assistant":
        messages = messages[1:]
        while messages and messages[0]["role"] == "tool":
            messages = messages[1:]
        repairs["leading_assistant_dropped"] += 1
    if messages and messages[-1]["role"] == "user":
        messages = messages[:-1]
        repairs["trailing_user_dropped"] += 1
    if messages and messages[-1]["role"] == "tool":
        while messages and messages[-1]["role"] == "tool":
            messages = messages[:-1]
        repairs["trailing_tool_results_dropped"] += 1
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no_assistant_turn")
    expected = ("user",)
    for i, m in enumerate(messages):
        if m["role"] not in expected:
            raise BadRow("not_alternating", f"message {i} is {m['role']!r}")
        if m["role"] == "assistant":
            expected = ("tool",) if m.get("tool_calls") else ("user",)
        else:
            expected = ("assistant",) if m["role"] == "user" else ("tool", "assistant")
        if not m["content"].strip() and m["role"] != "tool" and not m.get("tool_calls"):
            raise BadRow("empty_turn", f"message {i} ({m['role']}) is empty")
    if system and not system[0]["content"].strip():
        raise BadRow("empty_turn", "empty system message")
    return system + messages


# ---------------------------------------------------------------------------------------------
# Fingerprints (so training can check data and target agree)
# ---------------------------------------------------------------------------------------------
def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Name, size and a hash of the full token -> id table (added tokens included)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "class": type(tokenizer).__name__,
        "size": len(tokenizer),
        "vocab_sha256": digest,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
    }


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
