"""What the scheduler serves: a request (`GenParams`), what it is told (`Event`), its `RequestHandle`, the refusal
of a full or closing server (`SchedulerUnavailable`), and `_Row`, a request's decoding state in the scheduler."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from eagle3.decoding.sampling import new_seed

__all__ = ["Event", "GenParams", "RequestHandle", "SchedulerUnavailable"]


@dataclass
class GenParams:
    """One validated request, in token ids."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stream: bool = False
    endpoint: str = "completions"  # a metrics label
    record: bool = True  # into the server's traffic record, when it keeps one (`ServeConfig.record`)
    # the answer follows this grammar (engine text, `eagle3.decoding.grammar`): response_format's JSON schema,
    # or a forced tool call (`eagle3.serving.tools`)
    grammar: str | None = None


@dataclass
class Event:
    """What the scheduler tells a request: a text `delta`, `done` (with usage), or an `error`."""

    kind: str
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    status: int = 500  # for errors: the HTTP status to answer with


class RequestHandle:
    """A submitted request: its parameters, where its events go, and a cancel flag the client side sets."""

    def __init__(self, params: GenParams, sink: Callable[[Event], None]):
        self.params = params
        self.sink = sink
        self.id = uuid.uuid4().hex
        self.seed = params.seed if params.seed is not None else new_seed()
        self.arrival = time.perf_counter()
        self.cancelled = False
        self.finished = False
        self.drafter_version: str | None = None  # the server's drafter when it was admitted to a batch


class SchedulerUnavailable(Exception):
    """The scheduler refuses new work: `status` is the HTTP status to answer with (503)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


class _Row:
    """A request in a batch: its tokens and how its text has been streamed so far."""

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.out: list[int] = []
        self.root = -1  # last emitted token, not yet in the KV cache
        self.cycles = self.accepted = 0  # speculative cycles it drafted in, drafts accepted in them
        self.sent = 0  # characters already streamed
        self.streamed = 0  # tokens of `out` covered by the last streamed chunk
        # incremental detokenization (`Scheduler._stable_text`): the text of out[:read_at], decoded in windows
        self.text = ""
        self.prefix_at = self.read_at = 0
