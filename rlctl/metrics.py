"""Metric rows and events as orjson JSONL, on any fsspec storage.

One line per step in ``metrics.jsonl``. JSON has no NaN or Infinity, and orjson would silently write them
as null; rlctl writes them as the strings "NaN", "Infinity" and "-Infinity" (the spelling Python's json
uses) so a poisoned metric stays visible, and ``parse_rows`` turns them back into floats. A line that
cannot be read (a crash mid-write, a hand edit: not JSON, not an object, a metric row without an
integer ``step``) is skipped and reported, never fatal; a log opened after a truncated last line starts
on a line of its own.

On a local disk every row is appended and flushed as it is written. Object stores cannot append, so
there rows are buffered and the file is rewritten at most every ``flush_interval`` seconds, before every
snapshot and at exit, each time behind the run's fence.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from rlctl.errors import StorageError
from rlctl.numbers import is_step

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


def parse_rows(data: bytes, on_bad_line=None, *, require_step: bool = False) -> Iterator[dict[str, Any]]:
    """Rows of JSONL bytes; a line that is not a JSON object (or, with ``require_step``, has no integer
    ``step``: a metric row) goes to ``on_bad_line(lineno, line)``."""
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or (require_step and not is_step(row.get("step"))):
            if on_bad_line is not None:
                on_bad_line(lineno, line)
            continue
        yield {k: _decode(v) for k, v in row.items()}


def read_rows(storage: Storage, rel: str, on_bad_line=None, *, require_step: bool = False) -> list[dict[str, Any]]:
    """The rows of a JSONL file ([] when it does not exist); see ``parse_rows``."""
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError:
        return []
    return list(parse_rows(data, on_bad_line, require_step=require_step))


class BadLines:
    """The line numbers of a JSONL file that could not be read (an ``on_bad_line``), for one warning."""

    def __init__(self, name: str):
        self.name = name
        self.lines: list[int] = []

    def __call__(self, lineno: int, _line: bytes) -> None:
        self.lines.append(lineno)

    def warning(self) -> str | None:
        """'warning: skipped 2 unreadable lines of NAME (lines 6, 9): ...', or None when none was."""
        if not self.lines:
            return None
        n = len(self.lines)
        shown = ", ".join(map(str, self.lines[:5])) + (", ..." if n > 5 else "")
        plural = "s" if n > 1 else ""
        return (
            f"warning: skipped {n} unreadable line{plural} of {self.name} (line{plural} {shown}): "
            "a crash mid-write, or an edit by hand"
        )


def split_after_step(data: bytes, step: int) -> tuple[bytes, list[bytes]]:
    """JSONL bytes -> (the lines of rows with step <= ``step``, each ending in a newline; the other
    lines). A line that does not parse (a crash mid-write) counts as after."""
    kept, moved = [], []
    for line in data.splitlines(keepends=True):
        if not line.strip():
            continue
        try:
            row_step = orjson.loads(line).get("step")
        except (orjson.JSONDecodeError, AttributeError):
            row_step = None
        if is_step(row_step) and row_step <= step:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
        else:
            moved.append(line)
    return b"".join(kept), moved


class EventSink(Protocol):
    """Where a run's events go: an ``EventLog``, or one that also shows them."""

    def emit(self, event: dict[str, Any]) -> None: ...


class JsonlLog:
    """Appends rows to a JSONL file on a Storage. Thread-safe; ``tell()`` is the logical end offset.
    ``fence`` (the lease's check) is called before every row and every flush of buffered rows: it
    raises once this process may no longer write the run (a lost lease; a storage outage longer than
    the retry budget, whichever writer met it). A flush that fails keeps its rows buffered; its
    retries share the process's outage clock (``rlctl.storage.failures``), so a flush on the way out
    of a run that an outage ended does not wait a budget of its own."""

    def __init__(self, storage: Storage, rel: str, flush_interval: float = 10.0, fence=None):
        self.storage, self.rel = storage, rel
        self.flush_interval = flush_interval
        self.fence = fence
        self._lock = threading.Lock()
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self._fh = None
        if storage.is_local:
            storage.makedirs()
            self._fh = open(storage.path(rel), "ab", buffering=0)  # noqa: SIM115 - held for the run
            self._offset = self._fh.tell()
            if self._offset and not _ends_with_newline(storage.path(rel)):
                self._append_local(b"\n")  # a truncated last line stays alone: the next row is not lost with it
        else:
            self._offset = storage.size(rel) if storage.exists(rel) else 0

    def write(self, row: dict[str, Any]) -> None:
        if self.fence is not None:
            self.fence()
        line = dumps_row(row)
        with self._lock:
            if self._fh is not None:
                self._append_local(line)
                return
            self._offset += len(line)
            self._buffer.append(line)
            if time.monotonic() - self._last_flush >= self.flush_interval:
                self._flush_locked()

    def _append_local(self, data: bytes) -> None:
        """Append ``data`` whole or not at all: a failed write (a full disk) is cut back and is a
        StorageError naming the file."""
        try:
            view = memoryview(data)
            while view:
                view = view[self._fh.write(view) :]
        except OSError as exc:
            from rlctl.storage import describe

            with contextlib.suppress(OSError):
                self._fh.truncate(self._offset)
            raise StorageError(f"cannot write {self.storage.url_of(self.rel)}: {describe(exc)}") from exc
        self._offset += len(data)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._buffer:
            if self.fence is not None:
                self.fence()  # (a flush on the way out too: never after the lease is lost or the budget spent)
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
        JsonlLog.__init__(self, self.storage, self.rel, self.flush_interval, self.fence)


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, 2)
        return fh.read(1) == b"\n"


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

    def __init__(self, storage: Storage, rel: str = "events.jsonl", fence=None):
        super().__init__(storage, rel, flush_interval=0.0, fence=fence)

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
def timed(timings: dict[str, float], name: str, sync: Callable[[], None] | None = None) -> Iterator[None]:
    """Time the block into ``timings["timing_s/<name>"]`` (seconds). ``sync``: an accelerator's
    ``synchronize``, called as the block begins and ends, so that its time holds the device work it
    queued (a GPU runs a block's kernels after the host has left it) and none queued before it."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    yield
    if sync is not None:
        sync()
    timings[f"timing_s/{name}"] = time.perf_counter() - start
