"""Recorded traffic: finished requests as rows of Parquet shards, written by `eagle3 serve --record DIR` and read
by `eagle3 adapt` (and anything else that reads Parquet).

A shard is written whole to a temporary name and renamed into place, so a folder never holds a partial shard,
and a recorder closed on shutdown loses nothing it was given. Rows carry token ids, not text: they are exactly
what the target saw and produced, ready for training without a tokenizer round trip.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3.config import ConfigError

log = logging.getLogger("eagle3")

SHARD_GLOB = "traffic-*.parquet"
FIELDS = ("request_id", "time_unix", "model", "drafter", "prompt_ids", "completion_ids", "temperature", "top_p",
          "top_k", "finish_reason", "cycles", "accepted")


def _schema():
    import pyarrow as pa

    return pa.schema([
        ("request_id", pa.string()), ("time_unix", pa.float64()), ("model", pa.string()), ("drafter", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())), ("completion_ids", pa.list_(pa.int32())),
        ("temperature", pa.float32()), ("top_p", pa.float32()), ("top_k", pa.int32()),
        ("finish_reason", pa.string()), ("cycles", pa.int32()), ("accepted", pa.int32()),
    ])


class TrafficRecorder:
    """Buffers finished requests and writes them as Parquet shards of at most `shard_rows` rows into `folder`;
    keeps at most `max_shards` shards (the oldest go first; None keeps all). Thread-safe."""

    def __init__(self, folder: str | os.PathLike, shard_rows: int = 4096, max_shards: int | None = None):
        from eagle3.config import require_extra

        require_extra("data", ("pyarrow",), "recording traffic (--record)")
        if shard_rows < 1:
            raise ConfigError(f"shard_rows={shard_rows} must be >= 1")
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--record {folder}: cannot create that folder ({e.strerror}); choose a writable "
                              "one") from None
        self.shard_rows, self.max_shards = shard_rows, max_shards
        self.rows: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.written = 0  # rows in shards so far

    def add(self, row: dict[str, Any]) -> None:
        """One finished request: the FIELDS (missing ones are null; `time_unix` defaults to now)."""
        unknown = set(row) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown traffic fields {sorted(unknown)}; expected {FIELDS}")
        row = {"time_unix": time.time(), **row}
        with self.lock:
            self.rows.append(row)
            if len(self.rows) >= self.shard_rows:
                self._write()

    def flush(self) -> Path | None:
        """Write what is buffered as a shard now (None when nothing is)."""
        with self.lock:
            return self._write()

    close = flush

    def _write(self) -> Path | None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.rows:
            return None
        rows, self.rows = self.rows, []
        table = pa.Table.from_pylist([{k: r.get(k) for k in FIELDS} for r in rows], schema=_schema())
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        path = self.folder / f"traffic-{stamp}-{time.monotonic_ns() % 10**9:09d}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
        self.written += len(rows)
        if self.max_shards is not None:
            for old in shards(self.folder)[: -self.max_shards]:
                old.unlink(missing_ok=True)
        return path


def shards(folder: str | os.PathLike) -> list[Path]:
    """The folder's complete shards, oldest first."""
    return sorted(Path(folder).glob(SHARD_GLOB))


def read_traffic(folder: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Every recorded row of `folder`, oldest shard first, rows in the order they finished."""
    from eagle3.config import require_extra

    require_extra("data", ("pyarrow",), "reading recorded traffic")
    import pyarrow.parquet as pq

    found = shards(folder)
    if not found:
        raise ConfigError(f"{folder}: no recorded traffic ({SHARD_GLOB}); record some with eagle3 serve --record")
    for path in found:
        yield from pq.read_table(path).to_pylist()
