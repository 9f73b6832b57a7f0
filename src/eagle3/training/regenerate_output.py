"""The output of `eagle3 regenerate`: the append-only, resumable JSONL of finished rows, and the run's report."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError

try:  # POSIX advisory lock: two runs must not append to the same output
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


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


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
