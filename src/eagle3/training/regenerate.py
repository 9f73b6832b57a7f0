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

Its parts, in `eagle3.training`: `regenerate_rows` (the input), `regenerate_loop` (the prompts and the
drivers that answer them) and `regenerate_output` (the resumable output and the report).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError
from eagle3.training.backends import Backend, Generation, LocalBackend
from eagle3.training.endpoint import EndpointBackend, EndpointError
from eagle3.training.regenerate_loop import (
    _Conversation,
    _drive_batched,
    _drive_chains,
    _drive_concurrent,
    _Run,
)
from eagle3.training.regenerate_output import RegenerateReport, _Output, _write_json
from eagle3.training.regenerate_rows import RAW_ROW_SKIPPED, _load_rows, normalise_conversation

__all__ = ["Backend", "EndpointBackend", "EndpointError", "Generation", "LocalBackend", "RegenerateReport",
           "normalise_conversation", "regenerate"]


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
