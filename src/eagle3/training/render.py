"""Rendering conversations with the target's chat template, and the assistant-only loss mask: `ChatRenderer`
turns a raw row into token ids and a mask (completion rows and the `plain` template as raw text).

How the loss mask is found, without `{% generation %}` markers (HF `return_assistant_tokens_mask` needs them
and silently returns an all-zero mask otherwise). For each assistant message i:

    A = render(messages[:i],   add_generation_prompt=True)    # "...<|im_start|>assistant\\n"
    B = render(messages[:i+1], add_generation_prompt=False)   # A + "Hello<|im_end|>\\n"
    F = render(messages)                                      # the text we train on

If A is a prefix of B and B a prefix of F, the span F[len(A):len(B)] is what the template writes for this
turn. Inside it we locate the message content (exactly, else ignoring whitespace, since templates `trim`);
template text before the content (an empty `<think>\\n\\n</think>\\n\\n` that a Qwen3-style template adds) is
masked out; after the content we supervise up to and including the first special token (`<|im_end|>`,
`<|eot_id|>`, `</s>`), not the newline after it. An answer cut at the generation limit (marked
`"finish_reason": "length"`, as `eagle3 regenerate` writes them) keeps its text supervised but not the
end-of-turn token the template appends, because the target did not end there. A turn where the prefix property
fails (templates that rewrite earlier turns, e.g. drop their reasoning) is left unsupervised and counted; a row
with no supervised turn is bad. F is tokenised once with `add_special_tokens=False` (the template writes its own BOS, as in HF
`apply_chat_template(tokenize=True)` and vLLM chat serving) and character spans map to tokens by overlap.

Tool calls render as the server renders them (`eagle3.serving.tools`): a template whose source refers to `tools`
gets `apply_chat_template(messages, tools=...)` with the assistant `tool_calls` and `tool` results in the
messages; any other template gets the Hermes layout in ordinary turns (`hermes_messages`: the tools in the system
turn, calls as `<tool_call>` blocks in the assistant's text, results as a user turn of `<tool_response>` blocks).
A call turn is the target's own output, so it is supervised like any answer; under a template that writes the
calls itself there is no content to find, and the whole turn F[len(A):len(B)] is supervised up to and including
the end-of-turn token that closes it. Tool results, like user and system turns, are never supervised.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eagle3.config import ConfigError
from eagle3.serving.tools import hermes_messages, takes_tools
from eagle3.training.data import (
    PLAIN,
    BadRow,
    completion_segments,
    conversation_tools,
    normalize_conversation,
)

# Turn-level outcomes (the report's `turns` counter).
TURN_SUPERVISED = "supervised"
TURN_INSERTED_TEXT_MASKED = (
    "template_inserted_text_masked"  # e.g. an empty <think></think> the template added
)
TURN_NO_END_TOKEN = "no_end_token_after_content"  # no special token right after the content; none supervised
TURN_CUT_END_MASKED = "cut_at_limit_end_token_masked"  # finish_reason "length": its end token is not a label
TURN_TOOL_CALL = "tool_call_turn_supervised"  # a call turn written by a template that takes tools: whole turn
TURN_SKIP_GENERATION_PROMPT = "skipped_generation_prompt_mismatch"  # A is not a prefix of B
TURN_SKIP_PREFIX = "skipped_prefix_mismatch"  # B is not a prefix of F
TURN_SKIP_CONTENT = "skipped_content_not_found"

_SKIP_TO_ROW_REASON = {
    TURN_SKIP_GENERATION_PROMPT: "prefix_mismatch",
    TURN_SKIP_PREFIX: "prefix_mismatch",
    TURN_SKIP_CONTENT: "content_not_found",
}


@dataclass
class EncodedRow:
    """One conversation ready to train on: token ids and the assistant-only loss mask, both [T]."""

    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] uint8, 1 on assistant content and its end-of-turn token
    turns: Counter[str] = field(default_factory=Counter)  # turn outcomes (TURN_* keys)
    repairs: Counter[str] = field(default_factory=Counter)  # what normalize_conversation fixed


@dataclass
class _Spans:
    text: str
    spans: list[tuple[int, int]]
    turns: Counter[str]


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template and finds the supervised character spans.

    `chat_template` overrides the tokenizer's (`PLAIN`: conversations as raw text); `template_kwargs` go to every
    render (e.g. `{"enable_thinking": False}` for Qwen3). Completion rows (`completion_segments`) never use the
    template. With `require_template=False` a missing template is no error: conversations become
    `BadRow("no_chat_template")`. Picklable, so worker processes can hold a copy.
    """

    def __init__(
        self, tokenizer: Any, chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
        require_template: bool = True,
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(
                f"tokenizer {type(tokenizer).__name__} is not a fast (Rust `tokenizers`) tokenizer; the loss mask "
                "needs character offsets (return_offsets_mapping). Load it with AutoTokenizer (use_fast=True)"
            )
        template = chat_template if chat_template is not None else tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        if not template and require_template:
            raise ConfigError(
                f"tokenizer {tokenizer.name_or_path!r} has no chat template; pass chat_template= (a Jinja "
                "string, e.g. the target's tokenizer_config.json 'chat_template'; or \"plain\" for raw text)"
            )
        self.tokenizer = tokenizer
        self.chat_template: str | None = template or None
        self.plain = template == PLAIN
        self.takes_tools = bool(template) and not self.plain and takes_tools(template)
        self.template_kwargs = dict(template_kwargs or {})
        specials = {str(t) for t in tokenizer.all_special_tokens}
        specials |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        self.end_tokens = sorted((s for s in specials if s), key=len, reverse=True)  # longest match first

    # -- rendering -------------------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        """The template's text for `messages` as given (see `for_template`), with `tools` (templates that take them)."""
        if self.chat_template is None:
            raise BadRow("no_chat_template")
        if self.plain:
            return "".join(m["content"] for m in messages)
        kwargs = {"tools": tools} if tools and self.takes_tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
                **self.template_kwargs,
            )
        except Exception as e:  # jinja2 TemplateError, raise_exception(...) in templates, KeyError in filters
            raise BadRow("template_error", f"{type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise BadRow("template_error", f"apply_chat_template returned {type(text).__name__}")
        return text

    def for_template(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
        """(messages, tools) as the template is given them: as they are, or, for a conversation with tools or tool
        turns and a template that does not take tools, in the Hermes layout (no tools left to pass)."""
        tools = list(tools or [])
        if self.takes_tools or not (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)):
            return messages, tools
        return hermes_messages(messages, tools), []

    def supervised_spans(self, messages: list[dict], tools: list[dict] | None = None) -> _Spans:
        """The full render and the character spans to supervise (see the module docstring)."""
        cut = [m.get("finish_reason") == "length" for m in messages if m["role"] == "assistant"]
        # templates see no finish_reason; the Hermes layout keeps one assistant turn per assistant message
        messages, tools = self.for_template([{k: v for k, v in m.items() if k != "finish_reason"} for m in messages],
                                            tools)
        full = self.render(messages, tools=tools)
        spans: list[tuple[int, int]] = []
        turns: Counter[str] = Counter()
        answer = -1
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            answer += 1
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            upto = self.render(messages[: i + 1], tools=tools)
            if not upto.startswith(prompt):
                turns[TURN_SKIP_GENERATION_PROMPT] += 1
                continue
            if not full.startswith(upto):
                turns[TURN_SKIP_PREFIX] += 1
                continue
            if m.get("tool_calls"):
                found = self._whole_turn(upto, len(prompt))
                if found is not None:
                    turns[TURN_TOOL_CALL] += 1
            else:
                found = self._locate(upto, len(prompt), m["content"])
            if found is None:
                turns[TURN_SKIP_CONTENT] += 1
                continue
            start, content_end, end, inserted, has_end_token = found
            if cut[answer] and has_end_token:
                end = content_end
                turns[TURN_CUT_END_MASKED] += 1
            spans.append((start, end))
            turns[TURN_SUPERVISED] += 1
            if inserted:
                turns[TURN_INSERTED_TEXT_MASKED] += 1
            if not has_end_token:
                turns[TURN_NO_END_TOKEN] += 1
        if not spans:
            skips = Counter({k: v for k, v in turns.items() if k in _SKIP_TO_ROW_REASON})
            reason = _SKIP_TO_ROW_REASON[skips.most_common(1)[0][0]] if skips else "no_assistant_turn"
            raise BadRow(reason, turns=turns)
        return _Spans(full, spans, turns)

    def _locate(self, upto: str, turn_start: int, content: str) -> tuple[int, int, int, bool, bool] | None:
        """Where the content sits in `upto`: (start, content end, end with its end token, inserted text before
        it?, end token?), searching from `turn_start`.

        Among the places the content occurs, take the last one that is followed by only whitespace and/or a
        special token, so that a template header or tail that happens to contain the content's text is skipped.
        """
        turn = upto[turn_start:]
        match = _find_exact(turn, content, self._tail_ok) or _find_ignoring_space(
            turn, content, self._tail_ok
        )
        if match is None:
            return None
        c0, c1 = match
        inserted = bool(turn[:c0].strip())
        tail = turn[c1:]
        stripped = tail.lstrip()
        end = c1
        has_end_token = False
        for tok in self.end_tokens:
            if stripped.startswith(tok):
                end = c1 + (len(tail) - len(stripped)) + len(tok)
                has_end_token = True
                break
        return turn_start + c0, turn_start + c1, turn_start + end, inserted, has_end_token

    def _whole_turn(self, upto: str, turn_start: int) -> tuple[int, int, int, bool, bool] | None:
        """A call turn the template wrote itself: all its text (surrounding whitespace aside), with the end-of-turn
        token that closes it, if one does; the same tuple as `_locate`."""
        turn = upto[turn_start:]
        body = turn.rstrip()
        start = len(body) - len(body.lstrip())
        if start == len(body):
            return None
        end_token = next((t for t in self.end_tokens if body.endswith(t)), "")
        content_end = len(body[: len(body) - len(end_token)].rstrip()) if end_token else len(body)
        return turn_start + start, turn_start + content_end, turn_start + len(body), False, bool(end_token)

    def _tail_ok(self, tail: str) -> bool:
        stripped = tail.lstrip()
        return not stripped or any(stripped.startswith(t) for t in self.end_tokens)

    # -- tokenising -----------------------------------------------------------------------------
    def encode_many(self, rows: list[Any], system_prompt: str | None = None) -> list[EncodedRow | BadRow]:
        """Normalise, render and tokenise a batch of raw rows (one batched tokenizer call per kind: templated
        text, whose template writes its own specials, and raw text, which gets the tokenizer's)."""
        results: list[EncodedRow | BadRow | None] = [None] * len(rows)
        pending: dict[bool, list[tuple[int, _Spans, Counter[str]]]] = {False: [], True: []}  # raw? -> rows
        for k, row in enumerate(rows):
            repairs: Counter[str] = Counter()
            try:
                segments = completion_segments(row)
                if segments is None:
                    messages = normalize_conversation(row, system_prompt, repairs)
                    tools = conversation_tools(row)
                    if self.plain:
                        plain, _ = self.for_template(messages, tools)
                        segments = [(m["content"], m["role"] == "assistant") for m in plain]
                if segments is not None:
                    pending[True].append((k, _raw_spans(segments), repairs))
                else:
                    pending[False].append((k, self.supervised_spans(messages, tools), repairs))
            except BadRow as e:
                results[k] = e
        for raw, batch in pending.items():
            if not batch:
                continue
            enc = self.tokenizer([spans.text for _, spans, _ in batch], add_special_tokens=raw,
                                 return_offsets_mapping=True, verbose=False)
            for (k, spans, repairs), ids, offsets in zip(batch, enc["input_ids"], enc["offset_mapping"], strict=True):
                mask = _token_mask(len(spans.text), spans.spans, offsets)
                results[k] = EncodedRow(np.asarray(ids, dtype=np.int32), mask, spans.turns, repairs)
        return results  # type: ignore[return-value]

    def encode(self, row: Any, system_prompt: str | None = None) -> EncodedRow:
        """One raw row (or a message list) to tokens and mask; raises BadRow."""
        if isinstance(row, list):
            row = {"messages": row}
        (result,) = self.encode_many([row], system_prompt)
        if isinstance(result, BadRow):
            raise result
        return result


def _raw_spans(segments: list[tuple[str, bool]]) -> _Spans:
    """Raw text pieces back to back; the trained ones are the supervised spans."""
    spans, at = [], 0
    for text, trained in segments:
        if trained and text:
            spans.append((at, at + len(text)))
        at += len(text)
    return _Spans("".join(text for text, _ in segments), spans, Counter({TURN_SUPERVISED: len(spans)}))


def _find_exact(turn: str, content: str, tail_ok: Any) -> tuple[int, int] | None:
    for needle in dict.fromkeys((content, content.strip())):  # unique, in order
        if not needle:
            continue
        hi = len(turn)
        while True:
            p = turn.rfind(needle, 0, hi)
            if p < 0:
                break
            if tail_ok(turn[p + len(needle) :]):
                return p, p + len(needle)
            hi = p + len(needle) - 1
    return None


_NON_SPACE = re.compile(r"\S")


def _find_ignoring_space(turn: str, content: str, tail_ok: Any) -> tuple[int, int] | None:
    """Match with all whitespace removed from both sides; map back to `turn` positions."""
    needle = "".join(content.split())
    if not needle:
        return None
    positions = [m.start() for m in _NON_SPACE.finditer(turn)]  # compact index -> turn index
    compact = "".join(turn[i] for i in positions)
    hi = len(compact)
    while True:
        p = compact.rfind(needle, 0, hi)
        if p < 0:
            return None
        start, end = positions[p], positions[p + len(needle) - 1] + 1
        if tail_ok(turn[end:]):
            return start, end
        hi = p + len(needle) - 1


def _token_mask(n_chars: int, spans: list[tuple[int, int]], offsets: Any) -> np.ndarray:
    """1 for every token whose character range overlaps a supervised span."""
    chars = np.zeros(n_chars + 1, dtype=np.int32)  # [C+1] +1 at span starts, -1 at span ends
    for a, b in spans:
        chars[a] += 1
        chars[b] -= 1
    inside = np.cumsum(chars[:-1]) > 0  # [C] char is supervised
    prefix = np.concatenate([[0], np.cumsum(inside, dtype=np.int64)])  # [C+1]
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)  # [T, 2] (start, end) chars
    return (prefix[off[:, 1]] - prefix[off[:, 0]] > 0).astype(np.uint8)  # [T]
