"""Metric rows and events as orjson JSONL, on any fsspec storage.

One line per step in ``metrics.jsonl``. JSON has no NaN or Infinity, and orjson would silently write them
as null; rlctl writes them as the strings "NaN", "Infinity" and "-Infinity" (the spelling Python's json
uses) so a poisoned metric stays visible, and ``parse_rows`` turns them back into floats. A truncated
last line (a crash mid-write) is skipped and reported, never fatal.

On a local disk every row is appended and flushed as it is written. Object stores cannot append, so
there rows are buffered and the file is rewritten at most every ``flush_interval`` seconds, before every
snapshot and at exit.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from rlctl.storage import Storage

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_value(value: Any) -> Any:
    """A non-finite float spelled as a string ("NaN", "Infinity", "-Infinity"); anything else as is."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _decode(value: Any) -> Any:
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


def encode_row(row: dict[str, Any]) -> dict[str, Any]:
    """The row with non-finite floats spelled as strings (JSON has no NaN)."""
    return {k: encode_value(v) for k, v in row.items()}


def dumps_row(row: dict[str, Any]) -> bytes:
    return orjson.dumps(encode_row(row)) + b"\n"


def parse_rows(data: bytes, on_bad_line=None) -> Iterator[dict[str, Any]]:
    """Rows of JSONL bytes; a line that does not parse goes to ``on_bad_line(lineno, line)``."""
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            if on_bad_line is not None:
                on_bad_line(lineno, line)
            continue
        if isinstance(row, dict):
            yield {k: _decode(v) for k, v in row.items()}


def read_rows(storage: Storage, rel: str, on_bad_line=None) -> list[dict[str, Any]]:
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError:
        return []
    return list(parse_rows(data, on_bad_line))


def split_after_step(data: bytes, step: int) -> tuple[bytes, list[bytes]]:
    """JSONL bytes -> (the lines of rows with step <= ``step``, the other lines). A line that does not
    parse (a crash mid-write) counts as after."""
    kept, moved = [], []
    for line in data.splitlines(keepends=True):
        if not line.strip():
            continue
        try:
            row_step = orjson.loads(line).get("step")
        except (orjson.JSONDecodeError, AttributeError):
            row_step = None
        (kept if isinstance(row_step, int) and row_step <= step else moved).append(line)
    return b"".join(kept), moved


class JsonlLog:
    """Appends rows to a JSONL file on a Storage. Thread-safe; ``tell()`` is the logical end offset."""

    def __init__(self, storage: Storage, rel: str, flush_interval: float = 10.0):
        self.storage, self.rel = storage, rel
        self.flush_interval = flush_interval
        self._lock = threading.Lock()
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self._fh = None
        if storage.is_local:
            storage.makedirs()
            self._fh = open(storage.path(rel), "ab")  # noqa: SIM115 - held for the run
            self._offset = self._fh.tell()
        else:
            self._offset = storage.size(rel) if storage.exists(rel) else 0

    def write(self, row: dict[str, Any]) -> None:
        line = dumps_row(row)
        with self._lock:
            self._offset += len(line)
            if self._fh is not None:
                self._fh.write(line)
                self._fh.flush()
                return
            self._buffer.append(line)
            if time.monotonic() - self._last_flush >= self.flush_interval:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._buffer:
            self.storage.append_bytes(self.rel, b"".join(self._buffer))
            self._buffer.clear()
        self._last_flush = time.monotonic()

    def tell(self) -> int:
        return self._offset

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def reopen(self) -> None:
        """Open again after ``close`` (another process appended in between: the offset is re-read)."""
        self.close()
        JsonlLog.__init__(self, self.storage, self.rel, self.flush_interval)


class NullLog:
    """The metrics log of a rank other than 0: rank 0 writes the run's rows."""

    def write(self, row: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def tell(self) -> int:
        return 0

    def close(self) -> None: ...


class EventLog(JsonlLog):
    """``events.jsonl``: snapshot commits, resumes, preemptions, completions. Each event is flushed at
    once, on every storage (events are rare and they are what a person reads after a bad night)."""

    def __init__(self, storage: Storage, rel: str = "events.jsonl"):
        super().__init__(storage, rel, flush_interval=0.0)

    def emit(self, event: dict[str, Any]) -> None:
        self.write({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **event})


def row_is_finite(row: dict[str, Any]) -> bool:
    """A step is good when every metric is finite and no non-finite value was counted anywhere. (The
    rollback policies refine this; a snapshot records the verdict.)"""
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if key.startswith("actor/nonfinite/") and value:
            return False
    return True


@contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Time the block into ``timings["timing_s/<name>"]`` (seconds)."""
    start = time.perf_counter()
    yield
    timings[f"timing_s/{name}"] = time.perf_counter() - start
