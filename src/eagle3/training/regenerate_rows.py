"""The input rows of `eagle3 regenerate`: ShareGPT / OpenAI / FastChat-`turns` conversations and completion
prompts, read and normalised into the conversations whose user turns the target answers. Tool-call turns and
tool results are kept as `eagle3 prepare` reads them (`data.normalize_message`), with the row's `tools`."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.training.data import (
    ROLE_MAP,
    BadRow,
    conversation_tools,
    iter_rows,
    link_tool_results,
    normalize_message,
)

Message = dict[str, Any]

# Speaker names mapped to chat-template roles: `eagle3 prepare`'s table, plus "bing", whose (often broken)
# answers are worth regenerating but not worth training on as written.
ROLES = {**ROLE_MAP, "bing": "assistant"}
ID_FIELDS = ("id", "question_id", "uuid", "conversation_id")


class _SkipRow(Exception):
    """A row that cannot be regenerated; the message is the reason counted in the report."""


@dataclass
class _Row:
    index: int
    id: str
    messages: list[Message] | None
    skip: str | None = None
    raw: bool = False  # a completion row: messages is one user turn, the prompt to continue
    tools: list[dict] = field(default_factory=list)  # the row's tools (OpenAI function tools)


RAW_ROW_SKIPPED = "a completion row (prompt/text): continue those in a run of their own, with a raw-text backend"


def completion_prompt(row: Any) -> str | None:
    """The text a base model continues, for a row with `prompt` or `text` (and no conversation); else None."""
    if not isinstance(row, dict) or any(k in row for k in ("conversations", "messages", "turns")):
        return None
    text = row.get("prompt", row.get("text"))
    return text if isinstance(text, str) and text.strip() else None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        if all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            return "\n".join(str(p.get("text", "")) for p in content)
        raise _SkipRow("non-text content (images/audio); regeneration is text-only")
    raise _SkipRow(f"message content of type {type(content).__name__}, expected a string")


def normalise_conversation(row: Any) -> list[Message]:
    """A ShareGPT / OpenAI / FastChat-`turns` row as [{"role": system|user|assistant, "content": str}]."""
    if not isinstance(row, dict):
        raise _SkipRow("row is not a JSON object")
    turns = row.get("conversations") or row.get("messages")
    if not turns and isinstance(row.get("turns"), list):
        return [{"role": "user", "content": _text(t)} for t in row["turns"]]
    if not isinstance(turns, list) or not turns:
        raise _SkipRow("no `conversations`, `messages` or `turns` list")
    messages: list[Message] = []
    calls = 0
    for turn in turns:
        if not isinstance(turn, dict):
            raise _SkipRow("a turn is not a JSON object")
        speaker = turn.get("from", turn.get("role"))
        role = ROLES.get(str(speaker).lower())
        if role is None:
            raise _SkipRow(f"unsupported role {speaker!r}")
        if role == "tool" or str(speaker).lower() == "function_call" or turn.get("tool_calls") or turn.get(
                "function_call"):
            try:  # a call the target's answer is compared with, or a result shown to it
                messages.append(normalize_message(turn, calls))
            except BadRow as exc:
                raise _SkipRow(f"{exc.reason}: {exc.detail}") from None
            calls += len(messages[-1].get("tool_calls", ()))
            continue
        messages.append(
            {"role": role, "content": _text(turn["value"] if "value" in turn else turn.get("content"))}
        )
    link_tool_results(messages)
    for before, m in zip([None, *messages], messages, strict=False):
        if m["role"] == "tool" and not (before and (before["role"] == "tool" or before.get("tool_calls"))):
            raise _SkipRow("a tool result with no tool call before it")
    if not any(m["role"] == "user" for m in messages):
        raise _SkipRow("no user turn")
    if messages[0]["role"] != "system" and isinstance(row.get("system"), str) and row["system"].strip():
        messages.insert(0, {"role": "system", "content": row["system"]})  # some ShareGPT variants
    return messages


def row_tools(row: Any) -> list[dict]:
    """The row's `tools` (`data.conversation_tools`); a bad list skips the row."""
    try:
        return conversation_tools(row)
    except BadRow as exc:
        raise _SkipRow(f"{exc.reason}: {exc.detail}") from None


def _row_id(obj: Any, index: int, messages: list[Message] | None) -> str:
    if isinstance(obj, dict):
        for key in ID_FIELDS:
            if obj.get(key) not in (None, ""):
                return str(obj[key])
    digest = hashlib.sha1(json.dumps(messages, ensure_ascii=False).encode("utf-8")).hexdigest()[:10]
    return f"row{index}-{digest}"


def _load_rows(paths: Sequence[Path], limit: int | None, problems: Counter[str]) -> list[_Row]:
    """Rows of all inputs in order (`row` = position in this sequence); unreadable parts go to `problems`."""
    rows: list[_Row] = []
    for path in paths:
        for obj in iter_rows(path, problems):
            if limit is not None and len(rows) >= limit:
                return rows
            index = len(rows)
            prompt = completion_prompt(obj)
            if prompt is not None:
                messages = [{"role": "user", "content": prompt}]
                rows.append(_Row(index, _row_id(obj, index, messages), messages, raw=True))
                continue
            try:
                messages = normalise_conversation(obj)
                rows.append(_Row(index, _row_id(obj, index, messages), messages, tools=row_tools(obj)))
            except _SkipRow as exc:
                rows.append(_Row(index, _row_id(obj, index, None), None, skip=str(exc)))
    return rows
