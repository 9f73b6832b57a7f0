"""Checks the data commands run before loading a model, and the `--chat-template` choices.

`check_data` reads each data file until its first usable row, so a wrong file (no rows in a known format, a
missing path) stops a command at once, with the fields it expected and the fields it found, instead of after the
model has loaded or with an empty output. `resolve_chat_template` turns `--chat-template FILE|NAME` into the
template text, or `PLAIN` (raw text, no template: for base models).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError
from eagle3.training.data import PLAIN, BadRow, completion_segments, iter_rows, normalize_conversation

# ChatML, as Qwen and SmolLM2 write it (without their default system message).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML, PLAIN: PLAIN}
CHAT_TEMPLATE_HELP = ("a Jinja file, or chatml, or plain (raw text, no template: for a base model); "
                      "default: the tokenizer's")

EXPECTED = {
    "prepare": "conversations (`conversations` or `messages` with an assistant turn) or completion rows "
               "(`text`, or `prompt` and `completion`; a .txt file is read as `text` blocks)",
    "regenerate": "conversations (`conversations`, `messages` or `turns` with a user turn) or prompts to "
                  "continue (`prompt` or `text`; a .txt file is read as `text` blocks)",
}
_FIELDS_SHOWN = 12
_ROWS_FOR_FIELDS = 1000


def resolve_chat_template(value: str | None) -> str | None:
    """`--chat-template`: None (the tokenizer's), a built-in name (`chatml`, `plain`), or a Jinja file's text."""
    if value is None:
        return None
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"--chat-template {value}: no such file, and not one of {', '.join(BUILTIN_TEMPLATES)}; "
                          "give a Jinja file (e.g. a chat_template.jinja) or a built-in name")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ConfigError(f"--chat-template {value}: the file is empty")
    return text


def row_kind(row: Any, command: str) -> str | None:
    """"chat", "completion", or None (a row `command` cannot use), judged without a tokenizer."""
    if command == "regenerate":
        from eagle3.training.regenerate_rows import _SkipRow, completion_prompt, normalise_conversation

        if completion_prompt(row) is not None:
            return "completion"
        try:
            normalise_conversation(row)
        except _SkipRow:
            return None
        return "chat"
    try:
        if completion_segments(row) is not None:
            return "completion"
        normalize_conversation(row)
    except BadRow:
        return None
    return "chat"


def _why(row: Any, command: str) -> str:
    """Why the first row is unusable, for the error message."""
    if command == "regenerate":
        from eagle3.training.regenerate_rows import _SkipRow, normalise_conversation

        try:
            normalise_conversation(row)
        except _SkipRow as e:
            return str(e)
        return "not a conversation"
    try:
        completion_segments(row)
        normalize_conversation(row)
    except BadRow as e:
        return str(e)
    return "not a conversation"


def check_data(paths: Iterable[str | Path], command: str) -> Counter[str]:
    """Each path exists and holds a usable row (read up to the first one); the kinds of those first rows.

    Raises ConfigError naming the fields expected and the fields found in a file with no usable row."""
    kinds: Counter[str] = Counter()
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError(f"--data {p}: no such file or folder")
        fields: Counter[str] = Counter()
        seen, first = 0, None
        for seen, row in enumerate(iter_rows(p, Counter()), 1):
            kind = row_kind(row, command)
            if kind is not None:
                kinds[kind] += 1
                break
            first = row if seen == 1 else first
            if seen <= _ROWS_FOR_FIELDS:
                fields.update(row.keys() if isinstance(row, dict) else [f"<{type(row).__name__} row>"])
        else:
            if seen == 0:
                raise ConfigError(f"--data {p}: no rows; expected {EXPECTED[command]}")
            found = ", ".join(k for k, _ in fields.most_common(_FIELDS_SHOWN))
            raise ConfigError(
                f"--data {p}: none of its {seen} rows is usable; expected {EXPECTED[command]}; found fields: "
                f"{found} (first row: {_why(first, command)})")
    return kinds


def check_out_dir(out: str | Path, flag: str = "--out") -> None:
    """An output folder may exist, but not as a file."""
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"{flag} {out} is a file; give a folder")


def check_out_file(out: str | Path, flag: str = "--out") -> None:
    """An output file may exist (to resume), but not as a folder."""
    if Path(out).is_dir():
        raise ConfigError(f"{flag} {out} is a folder; give a file name, e.g. {Path(out) / 'regenerated.jsonl'}")


def at_least(flag: str, value: int | float | None, low: int | float) -> None:
    """A flag's value is >= low (None: unset, fine)."""
    if value is not None and value < low:
        raise ConfigError(f"{flag} {value} must be >= {low}")


def needs_template_error(tokenizer: Any, command: str) -> ConfigError:
    """The error for conversations and a tokenizer without a chat template."""
    name = getattr(tokenizer, "name_or_path", "") or "the target"
    return ConfigError(
        f"{name!r} has no chat template (a base model), and the data holds conversations; pass "
        f"`eagle3 {command} --chat-template plain` (raw text), chatml or a Jinja file, or give completion rows "
        "(a .txt file, or `text` / `prompt`+`completion` fields)")
