"""The answering loop of `eagle3 regenerate`: each conversation's on-policy prompts, and the drivers that answer
them (turn-synchronous batches, continuous batching across turns, one endpoint worker per conversation).

A conversation with tools (a `tools` list, or tool-call turns) is answered with the tools in the target's prompt.
A backend that takes tools (`takes_tools`: a local template with its own tool format, an OpenAI-compatible server)
gets a `Prompt` (OpenAI messages with the tools) and renders them in the target's own format; its answer's calls
come back in `Generation.tool_calls` (a server) or are read with the template's parser (local). Other backends get
the Hermes layout the server falls back to (`eagle3.serving.tools.hermes_messages`: the tools in the system turn,
calls as `<tool_call>` blocks, results as `<tool_response>` blocks) and their answers are read for Hermes calls.
The target answers after each user turn and after each run of tool results.
Where the dataset called tools at that point and the target makes the same calls (names and arguments), the
dataset's results answer them and the conversation goes on; otherwise it ends with the target's answer (there is
no tool to run the target's own calls). Such rows are written as OpenAI `messages` with the row's `tools`."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

from eagle3.config import ConfigError
from eagle3.serving.tools import HermesParser, ToolCalls, ToolParser, hermes_messages
from eagle3.training.backends import Backend, Generation, LocalBackend, Prompt
from eagle3.training.endpoint import EndpointBackend, EndpointError
from eagle3.training.regenerate_output import RegenerateReport, _Output
from eagle3.training.regenerate_rows import Message, _Row

SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}
PROMPT_TOO_LONG = "first prompt longer than the limit (max_prompt_tokens or the server's context length)"
WINDOW_BATCHES = 4  # the batched driver keeps batch_size * WINDOW_BATCHES conversations in flight
MAX_LISTED_FAILURES = 100


class _Conversation:
    """The on-policy state of one row: the prompt grows by the target's own answers."""

    def __init__(self, row: _Row, max_turns: int | None):
        self.row = row
        self.tools = getattr(row, "tools", [])
        self.with_tools = bool(self.tools) or any(m["role"] == "tool" or m.get("tool_calls")
                                                   for m in row.messages or [])
        pending, users = [], 0
        for m in row.messages or []:
            if m["role"] == "assistant" and not m.get("tool_calls"):
                continue  # the dataset's answers are replaced, never shown to the target
            if m["role"] == "user":
                if max_turns is not None and users >= max_turns:
                    break
                users += 1
            pending.append(m)  # a dataset call stays, to be compared with the target's answer at that point
        self.pending = deque(pending)
        self.prompts_left = sum(_is_prompt_point(pending, k) for k in range(len(pending)))
        self.messages: list[Message] = []
        self.reasoning: dict[int, str] = {}  # message index -> reasoning_content
        self.cut: set[int] = set()  # indices of answers that hit max_new_tokens
        self.committed = 0  # messages up to here end with an answer
        self.answered = self.turns_cut = self.tokens = 0
        self.status = ""  # "done" | "skipped" | "failed"
        self.reason = ""
        self.fatal = False
        self.native = False  # the backend takes the tools (a `Prompt`); else the Hermes layout
        self.parser: ToolParser = HermesParser()  # reads calls written in the answer's text

    def use(self, backend: Any) -> None:
        """Prompt `backend` as it takes tools: natively (`takes_tools`), else in the Hermes layout."""
        self.native = bool(getattr(backend, "takes_tools", False))
        self.parser = (getattr(backend, "tool_parser", None) if self.native else None) or HermesParser()

    def next_prompt(self) -> list[Message]:
        """The messages up to and including the next user turn or run of tool results (system turns before it
        included); with tools, a `Prompt` for a backend that takes them, else in the Hermes layout."""
        while self.pending:
            message = self.pending.popleft()
            self.messages.append(message)
            if message["role"] == "user" or (message["role"] == "tool" and
                                             not (self.pending and self.pending[0]["role"] == "tool")):
                self.prompts_left -= 1
                if self.with_tools and self.native:
                    return Prompt([dict(m) for m in self.messages], self.tools)
                if self.with_tools:
                    return hermes_messages([dict(m) for m in self.messages], self.tools)
                return [dict(m) for m in self.messages]
        raise RuntimeError("no user turn left")  # callers check `prompts_left` first

    def apply(self, gen: Generation) -> bool:
        """Take the answer to the last prompt; True while more prompts (user turns, tool results) remain."""
        self.tokens += gen.num_tokens
        if gen.finish_reason == "error":
            self.status, self.reason = "failed", gen.error or "unknown error"
            return False
        if gen.finish_reason == "prompt_too_long":
            if self.answered == 0:
                self.status, self.reason = "skipped", PROMPT_TOO_LONG
            else:
                del self.messages[self.committed :]
                self.turns_cut = 1
                self.status = "done"
            return False
        if gen.reasoning:
            self.reasoning[len(self.messages)] = gen.reasoning
        if gen.finish_reason == "length":
            self.cut.add(len(self.messages))
        answer: Message = {"role": "assistant", "content": gen.text}
        if self.with_tools:
            answer = self._with_calls(answer, gen.tool_calls)
        self.messages.append(answer)
        self.committed = len(self.messages)
        self.answered += 1
        if self.prompts_left > 0:
            return True
        self.status = "done"
        return False

    def _with_calls(self, answer: Message, given: list[dict] | None = None) -> Message:
        """The answer with its calls: `given` (a server's), else read out of its text. A dataset call at this point
        is consumed: the same calls take its ids and the conversation goes on to its results; other calls, or
        none, end the conversation."""
        expected = self.pending.popleft() if self.pending and self.pending[0]["role"] == "assistant" else None
        if given is not None:
            content, calls = answer["content"], [
                {"function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}} for c in given]
        else:
            names = {t["function"]["name"] for t in self.tools}
            names |= {c["function"]["name"] for c in (expected or {}).get("tool_calls", ())}
            content, parsed = ToolCalls(self.parser, names).parse(answer["content"])
            calls = [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                     for c in parsed]
        if calls:
            answer = {"role": "assistant", "content": content or "", "tool_calls": [
                {"id": f"call_{len(self.messages)}_{j}", "type": "function", "function": c["function"]}
                for j, c in enumerate(calls)]}
        answered = self.pending and self.pending[0]["role"] == "tool"  # the dataset has results for its calls
        if expected is not None and calls and answered and _same_calls(answer["tool_calls"], expected["tool_calls"]):
            for mine, theirs in zip(answer["tool_calls"], expected["tool_calls"], strict=True):
                mine["id"] = theirs["id"]
            return answer
        if expected is not None or calls:  # results that answer other calls, or none for these: stop here
            self.pending.clear()
            self.prompts_left = 0
        return answer

    def record(self) -> dict[str, Any]:
        if self.with_tools:
            return self._record_messages()
        if self.row.raw:
            rec: dict[str, Any] = {"id": self.row.id, "row": self.row.index, "prompt": self.messages[0]["content"],
                                   "completion": self.messages[1]["content"]}
            return {**rec, "finish_reason": "length"} if self.cut else rec
        turns = []
        for k, m in enumerate(self.messages[: self.committed]):
            turn: dict[str, Any] = {"from": SHAREGPT_FROM[m["role"]], "value": m["content"]}
            if k in self.reasoning:
                turn["reasoning_content"] = self.reasoning[k]
            if k in self.cut:
                turn["finish_reason"] = "length"  # `prepare` does not supervise an end-of-turn token here
            turns.append(turn)
        return {"id": self.row.id, "row": self.row.index, "conversations": turns}

    def _record_messages(self) -> dict[str, Any]:
        """A conversation with tools as OpenAI `messages` (arguments as JSON strings), with the row's tools."""
        messages = []
        for k, m in enumerate(self.messages[: self.committed]):
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {"name": c["function"]["name"], "arguments": json.dumps(
                    c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]
                m["content"] = m["content"] or None
            if k in self.reasoning:
                m["reasoning_content"] = self.reasoning[k]
            if k in self.cut:
                m["finish_reason"] = "length"
            messages.append(m)
        return {"id": self.row.id, "row": self.row.index, "tools": self.tools, "messages": messages}


def _is_prompt_point(messages: list[Message], k: int) -> bool:
    """Whether the target answers after message k: a user turn, or the last of a run of tool results."""
    role = messages[k]["role"]
    return role == "user" or (role == "tool" and (k + 1 == len(messages) or messages[k + 1]["role"] != "tool"))


def _same_calls(a: list[dict], b: list[dict]) -> bool:
    """The same functions with the same arguments, in the same order."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in a] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in b]


class _Run:
    """Bookkeeping shared by both drivers: writes finished rows, counts, progress, the failure brake."""

    def __init__(self, report: RegenerateReport, output: _Output, pbar: Any, max_consecutive_failures: int):
        self.report, self.output, self.pbar = report, output, pbar
        self.max_consecutive_failures = max_consecutive_failures
        self.consecutive_failures = 0
        self.start = time.perf_counter()

    def skip(self, reason: str) -> None:
        self.report.rows_skipped += 1
        self.report.skip_reasons[reason] = self.report.skip_reasons.get(reason, 0) + 1

    def complete(self, conv: _Conversation) -> None:
        r = self.report
        r.turns_generated += conv.answered
        r.turns_cut += conv.turns_cut
        r.answers_truncated += len(conv.cut)
        r.tokens_generated += conv.tokens
        if conv.status == "done":
            self.output.write(conv.record())
            r.rows_done += 1
            self.consecutive_failures = 0
        elif conv.status == "skipped":
            self.skip(conv.reason)
        else:
            r.rows_failed += 1
            key = conv.reason[:200]
            r.failure_reasons[key] = r.failure_reasons.get(key, 0) + 1
            if len(r.failures) < MAX_LISTED_FAILURES:
                r.failures.append({"row": conv.row.index, "id": conv.row.id, "reason": conv.reason})
            self.consecutive_failures += 1
            if conv.fatal or self.consecutive_failures >= self.max_consecutive_failures:
                raise ConfigError(
                    f"{self.consecutive_failures} conversation(s) in a row failed; last error: {conv.reason}. "
                    f"The {r.rows_done + r.rows_resumed} rows already written are kept: fix the cause and rerun "
                    "the same command to resume"
                )
        self.pbar.update(1)
        elapsed = time.perf_counter() - self.start
        self.pbar.set_postfix(tok_s=f"{r.tokens_generated / max(elapsed, 1e-9):.1f}", refresh=False)


def _drive_batched(
    run: _Run,
    convs: list[_Conversation],
    backend: Backend,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
) -> None:
    """Turn-synchronous: all conversations of a window answer turn i in batches, then turn i+1."""
    for conv in convs:
        conv.use(backend)
    window = backend.window(batch_size) if hasattr(backend, "window") else batch_size * WINDOW_BATCHES
    for start in range(0, len(convs), window):
        active = convs[start : start + window]
        while active:
            prompts = [c.next_prompt() for c in active]
            gens = backend.generate(prompts, temperature, max_new_tokens, batch_size)
            if len(gens) != len(prompts):
                raise RuntimeError(
                    f"{backend.describe()} returned {len(gens)} answers for {len(prompts)} prompts"
                )
            still = []
            for conv, gen in zip(active, gens, strict=True):
                if conv.apply(gen):
                    still.append(conv)
                else:
                    run.complete(conv)
            active = still


def _drive_chains(
    run: _Run,
    convs: list[_Conversation],
    backend: LocalBackend,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
) -> None:
    """Continuous batching across turns: a conversation's next turn joins the batch as soon as its answer
    is in, and a finished conversation is written at once, so an interrupted run keeps all but the
    conversations in flight (the turn-synchronous driver loses a whole window's first turns)."""

    def on_answer(k: int, gen: Generation) -> list[Message] | None:
        conv = convs[k]
        if conv.apply(gen):
            return conv.next_prompt()
        run.complete(conv)
        return None

    for conv in convs:
        conv.use(backend)
    backend.answer_chains([c.next_prompt() for c in convs], on_answer, temperature, max_new_tokens, batch_size)


def _drive_concurrent(
    run: _Run, convs: list[_Conversation], backend: EndpointBackend, temperature: float, max_new_tokens: int
) -> None:
    """One worker per conversation: turns run back to back, no waiting for other conversations' turns."""
    stop = threading.Event()
    for conv in convs:
        conv.use(backend)

    def work(conv: _Conversation) -> _Conversation:
        while not stop.is_set():
            try:
                gen = backend.chat(conv.next_prompt(), temperature, max_new_tokens, stop)
            except EndpointError as exc:
                conv.status, conv.reason, conv.fatal = "failed", str(exc), exc.fatal
                return conv
            if not conv.apply(gen):
                return conv
        conv.status, conv.reason = "failed", "stopped"
        return conv

    pool = ThreadPoolExecutor(max_workers=backend.concurrency)
    queue, in_flight = iter(convs), set()
    try:
        while True:
            while len(in_flight) < 2 * backend.concurrency:
                conv = next(queue, None)
                if conv is None:
                    break
                in_flight.add(pool.submit(work, conv))
            if not in_flight:
                return
            finished, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in finished:
                run.complete(future.result())
    finally:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
