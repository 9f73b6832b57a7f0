"""Regenerate the assistant turns of chat data with the target itself: the EAGLE-3 data recipe.

A drafter learns to predict what the *target* says, so the assistant turns of the training data are
replaced by the target's own answers (EAGLE-3 paper; sgl-project/SpecForge PR #223). Every
user turn is answered multi-turn and on-policy: the prompt for turn i holds the target's own answers to
turns 0..i-1, never the dataset's original ones (as vllm-project/speculators
`scripts/response_regeneration/script.py` and sgl-project/SpecForge `scripts/regenerate_train_data.py` do).
Each user turn gets its own answer, so two user turns in a row come out alternating.

Two backends answer the prompts:

* `LocalBackend`: an HF causal LM + tokenizer in this process (GPU or CPU). With the "hf" engine, prompts
  of the same turn index are batched with left padding, sorted by length; with the "fast" engine a
  conversation's next turn joins the continuous batch as soon as its previous answer is in, and the
  conversation is written when its last turn is answered (an interrupted run loses only the conversations
  in flight). Generation stops at the chat template's end-of-turn token; over-long prompts are skipped
  (the first turn) or end the conversation (a later turn).
* `EndpointBackend`: any OpenAI-compatible server (vLLM, SGLang, ...) through `/v1/chat/completions`,
  one conversation per worker thread, retries with backoff on 5xx and timeouts, a clear error on 4xx.

Usage::

    backend = LocalBackend.from_pretrained("path/to/target", max_prompt_tokens=4096)
    # or: backend = EndpointBackend("http://127.0.0.1:8000", model="served-name", concurrency=64)
    report = regenerate("sharegpt.json", "regen.jsonl", backend, temperature=0.0, max_new_tokens=1024)

Input: whatever `eagle3.training.data.iter_rows` reads (a JSON array, also one cut off mid-record like the
ShareGPT dump on PyPI; JSONL; parquet; arrow; a `save_to_disk` folder), with rows holding ShareGPT
`conversations` ({from, value}), OpenAI `messages` ({role, content}) or FastChat benchmark `turns` (a list
of user strings). Unlike `data.normalize_conversation`, which prepares rows for training, a trailing user
turn is kept (it gets answered) and a row needs no assistant turn. A completion row (`prompt` or `text`, or a
block of a `.txt` file; for a base model) is a prompt the target continues as raw text: it needs a backend with
`raw_text` (`LocalBackend(chat_template="plain")`) and is written as `{"id", "row", "prompt", "completion"}`.

Output: one line per conversation, in completion order::

    {"id": ..., "row": <index in the inputs>, "conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}

An answer cut at `max_new_tokens` carries `"finish_reason": "length"`, so that `prepare` does not teach the
drafter an end-of-turn token where the target would have gone on.

Rerunning the same call resumes: rows already in the output are not regenerated, a partially written
last line (a kill mid-write) is dropped, failed rows are retried. A report is printed and written to
`<out>.report.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError
from eagle3.training.backends import Backend, EndpointBackend, EndpointError, Generation, LocalBackend
from eagle3.training.data import ROLE_MAP, iter_rows

try:  # POSIX advisory lock: two runs must not append to the same output
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["Backend", "EndpointBackend", "EndpointError", "Generation", "LocalBackend", "RegenerateReport",
           "normalise_conversation", "regenerate"]

Message = dict[str, str]

# Speaker names mapped to chat-template roles: `eagle3 prepare`'s table, plus "bing", whose (often broken)
# answers are worth regenerating but not worth training on as written.
ROLES = {**ROLE_MAP, "bing": "assistant"}
SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}
ID_FIELDS = ("id", "question_id", "uuid", "conversation_id")

PROMPT_TOO_LONG = "first prompt longer than the limit (max_prompt_tokens or the server's context length)"
WINDOW_BATCHES = 4  # the batched driver keeps batch_size * WINDOW_BATCHES conversations in flight
MAX_LISTED_FAILURES = 100


# ------------------------------------------------------------------------------------------------
# Input
# ------------------------------------------------------------------------------------------------


class _SkipRow(Exception):
    """A row that cannot be regenerated; the message is the reason counted in the report."""


@dataclass
class _Row:
    index: int
    id: str
    messages: list[Message] | None
    skip: str | None = None
    raw: bool = False  # a completion row: messages is one user turn, the prompt to continue


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
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise _SkipRow("a turn is not a JSON object")
        speaker = turn.get("from", turn.get("role"))
        role = ROLES.get(str(speaker).lower())
        if role is None:
            raise _SkipRow(f"unsupported role {speaker!r}")
        messages.append(
            {"role": role, "content": _text(turn["value"] if "value" in turn else turn.get("content"))}
        )
    if not any(m["role"] == "user" for m in messages):
        raise _SkipRow("no user turn")
    if messages[0]["role"] != "system" and isinstance(row.get("system"), str) and row["system"].strip():
        messages.insert(0, {"role": "system", "content": row["system"]})  # some ShareGPT variants
    return messages


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
                rows.append(_Row(index, _row_id(obj, index, messages), messages))
            except _SkipRow as exc:
                rows.append(_Row(index, _row_id(obj, index, None), None, skip=str(exc)))
    return rows


# ------------------------------------------------------------------------------------------------
# Output (append-only, resumable) and the report
# ------------------------------------------------------------------------------------------------


class _Output:
    """The output JSONL: finished rows read back, a partial last line dropped, each new line flushed."""

    def __init__(self, path: Path, fsync_every_s: float):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if fcntl is not None:
            try:
                fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                self._fh.close()
                raise ConfigError(
                    f"{path} is being written by another regenerate run; wait for it or pick another output"
                ) from exc
        self.done: dict[int, str] = {}
        self.dropped_partial = self._read_back()
        self._fsync_every_s = fsync_every_s
        self._last_sync = time.monotonic()

    def _read_back(self) -> bool:
        """Collect finished rows; truncate a last line that has no newline (written when the run was killed)."""
        good_end = 0
        with open(self.path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.endswith(b"\n"):
                    break
                good_end += len(line)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    self.done[int(record["row"])] = str(record["id"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    raise ConfigError(
                        f"{self.path}:{lineno} is not a regenerated row (JSON with `row` and `id`); only the last "
                        "line can be damaged by an interruption. Remove that line or write to a new output"
                    ) from exc
        if good_end < self.path.stat().st_size:
            os.truncate(self.path, good_end)
            return True
        return False

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        if time.monotonic() - self._last_sync >= self._fsync_every_s:
            os.fsync(self._fh.fileno())
            self._last_sync = time.monotonic()

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()  # releases the lock


@dataclass
class RegenerateReport:
    """What a regenerate run did; `rows_done` counts rows written by this run, `rows_resumed` earlier ones."""

    inputs: list[str]
    out: str
    backend: str
    temperature: float
    max_new_tokens: int
    rows_in: int = 0
    input_problems: dict[str, int] = field(default_factory=dict)  # unreadable input parts (iter_rows)
    rows_resumed: int = 0
    rows_done: int = 0
    rows_skipped: int = 0
    rows_failed: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    failure_reasons: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(
        default_factory=list
    )  # the first MAX_LISTED_FAILURES: row, id, reason
    turns_generated: int = 0
    turns_cut: int = 0  # later turns dropped because the conversation outgrew the prompt limit
    answers_truncated: int = 0  # answers that hit max_new_tokens
    tokens_generated: int = 0
    seconds: float = 0.0
    dropped_partial_line: bool = False
    interrupted: bool = False
    error: str | None = None

    @property
    def rows_per_s(self) -> float:
        return self.rows_done / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows_per_s": self.rows_per_s, "tokens_per_s": self.tokens_per_s}

    def summary(self) -> str:
        status = (
            "interrupted" if self.interrupted else (f"stopped: {self.error}" if self.error else "finished")
        )
        lines = [
            f"regenerate {status}: {self.out}",
            f"  backend   {self.backend}",
            f"  rows      {self.rows_in} in, {self.rows_done} done now, {self.rows_resumed} done before, "
            f"{self.rows_skipped} skipped, {self.rows_failed} failed",
            f"  turns     {self.turns_generated} generated, {self.answers_truncated} hit max_new_tokens "
            f"({self.max_new_tokens}), {self.turns_cut} cut for length",
            f"  tokens    {self.tokens_generated} in {self.seconds:.1f} s "
            f"({self.rows_per_s:.2f} rows/s, {self.tokens_per_s:.1f} tokens/s)",
        ]
        lines += [f"  input     {n} x {problem}" for problem, n in self.input_problems.items()]
        lines += [f"  skipped   {n} x {reason}" for reason, n in self.skip_reasons.items()]
        lines += [f"  failed    {n} x {reason}" for reason, n in self.failure_reasons.items()]
        if self.dropped_partial_line:
            lines.append("  note      dropped a partially written last line of the output (regenerated)")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# One conversation, turn by turn
# ------------------------------------------------------------------------------------------------


class _Conversation:
    """The on-policy state of one row: the prompt grows by the target's own answers."""

    def __init__(self, row: _Row, max_turns: int | None):
        self.row = row
        pending, users = [], 0
        for m in row.messages or []:
            if m["role"] == "assistant":
                continue  # the dataset's answers are replaced, never shown to the target
            if m["role"] == "user":
                if max_turns is not None and users >= max_turns:
                    break
                users += 1
            pending.append(m)
        self.pending = deque(pending)
        self.users_left = users
        self.messages: list[Message] = []
        self.reasoning: dict[int, str] = {}  # message index -> reasoning_content
        self.cut: set[int] = set()  # indices of answers that hit max_new_tokens
        self.committed = 0  # messages up to here end with an answer
        self.answered = self.turns_cut = self.tokens = 0
        self.status = ""  # "done" | "skipped" | "failed"
        self.reason = ""
        self.fatal = False

    def next_prompt(self) -> list[Message]:
        """The messages up to and including the next user turn (system turns before it included)."""
        while self.pending:
            message = self.pending.popleft()
            self.messages.append(message)
            if message["role"] == "user":
                self.users_left -= 1
                return [dict(m) for m in self.messages]
        raise RuntimeError("no user turn left")  # callers check `users_left` first

    def apply(self, gen: Generation) -> bool:
        """Take the answer to the last prompt; True while more user turns remain to be answered."""
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
        self.messages.append({"role": "assistant", "content": gen.text})
        self.committed = len(self.messages)
        self.answered += 1
        if self.users_left > 0:
            return True
        self.status = "done"
        return False

    def record(self) -> dict[str, Any]:
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

    backend.answer_chains([c.next_prompt() for c in convs], on_answer, temperature, max_new_tokens, batch_size)


def _drive_concurrent(
    run: _Run, convs: list[_Conversation], backend: EndpointBackend, temperature: float, max_new_tokens: int
) -> None:
    """One worker per conversation: turns run back to back, no waiting for other conversations' turns."""
    stop = threading.Event()

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


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------


def regenerate(
    conversations_paths: str | os.PathLike | Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    backend: LocalBackend | EndpointBackend | Backend,
    temperature: float = 0.0,
    max_new_tokens: int = 512,
    batch_size: int = 32,
    max_turns: int | None = None,
    limit: int | None = None,
    progress: bool = True,
    *,
    max_consecutive_failures: int = 16,
    fsync_every_s: float = 5.0,
) -> RegenerateReport:
    """Answer every user turn of the input conversations with `backend`, on-policy; resumable.

    temperature 0 = greedy. batch_size: prompts per forward pass (LocalBackend). max_turns: answer at most
    this many user turns per conversation. limit: use only the first `limit` input rows (keep it when
    resuming). A backend with a `chat` method (EndpointBackend) runs one conversation per worker thread.
    Stops with ConfigError after `max_consecutive_failures` failed rows in a row (or one fatal HTTP error).
    """
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if max_new_tokens < 1 or batch_size < 1:
        raise ConfigError(f"max_new_tokens and batch_size must be >= 1 (got {max_new_tokens}, {batch_size})")
    if max_turns is not None and max_turns < 1:
        raise ConfigError(f"max_turns must be >= 1 or None (got {max_turns})")
    if isinstance(conversations_paths, str | os.PathLike):
        conversations_paths = [conversations_paths]
    paths = [Path(p) for p in conversations_paths]
    out = Path(out_path)
    if any(p.resolve() == out.resolve() for p in paths):
        raise ConfigError(f"the output {out} is also an input; write to a new file")
    from eagle3.training.inputs import check_data, check_out_file

    check_out_file(out)
    check_data(paths, "regenerate")  # before any output is created: a file with no usable row is an error
    problems: Counter[str] = Counter()
    rows = _load_rows(paths, limit, problems)
    report = RegenerateReport(
        inputs=[str(p) for p in paths],
        out=str(out),
        backend=backend.describe(),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        rows_in=len(rows),
        input_problems=dict(problems),
    )
    start = time.perf_counter()
    output = _Output(out, fsync_every_s)
    pbar = None
    try:
        report.dropped_partial_line = output.dropped_partial
        input_exhausted = limit is None or len(rows) < limit
        for index, row_id in output.done.items():
            if index < len(rows) and rows[index].id != row_id:
                raise ConfigError(
                    f"{out} holds row {index} with id {row_id!r} but input row {index} has id {rows[index].id!r}: "
                    "the output was made from other inputs. Use the same inputs to resume, or a new output"
                )
            if index >= len(rows) and input_exhausted:
                raise ConfigError(
                    f"{out} holds row {index} but the inputs have only {len(rows)} rows: the output was made "
                    "from other inputs. Use the same inputs to resume, or a new output"
                )
        report.rows_resumed = sum(1 for index in output.done if index < len(rows))
        if hasattr(backend, "check"):
            backend.check()
        pbar = _progress_bar(progress, report.rows_resumed, len(rows))
        run = _Run(report, output, pbar, max_consecutive_failures)
        convs = []
        for row in rows:
            if row.index in output.done:
                continue
            if row.skip is not None or (row.raw and not getattr(backend, "raw_text", False)):
                run.skip(row.skip or RAW_ROW_SKIPPED)
                pbar.update(1)
                continue
            convs.append(_Conversation(row, max_turns))
        chat = getattr(backend, "chat", None)
        if callable(chat) and hasattr(backend, "concurrency"):
            _drive_concurrent(run, convs, backend, temperature, max_new_tokens)  # type: ignore[arg-type]
        elif getattr(backend, "engine", None) == "fast" and callable(getattr(backend, "answer_chains", None)):
            _drive_chains(run, convs, backend, temperature, max_new_tokens, batch_size)  # type: ignore[arg-type]
        else:
            # Long conversations first: similar lengths share windows, and an OOM shows up at once.
            convs.sort(key=lambda c: -sum(len(m["content"]) for m in c.pending))
            _drive_batched(run, convs, backend, temperature, max_new_tokens, batch_size)
    except KeyboardInterrupt:
        report.interrupted = True
        raise
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        report.seconds = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
        output.close()
        _write_json(Path(str(out) + ".report.json"), report.to_dict())
        if progress:
            print(report.summary(), flush=True)
    return report


def _progress_bar(enabled: bool, initial: int, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total, initial=initial, unit="row", desc="regenerate", disable=not enabled, dynamic_ncols=True
    )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


__all__ = [
    "Backend",
    "EndpointBackend",
    "EndpointError",
    "Generation",
    "LocalBackend",
    "RegenerateReport",
    "normalise_conversation",
    "regenerate",
]
