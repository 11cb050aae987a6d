"""Metric rows and events as orjson JSONL.

One line per step in ``metrics.jsonl``, flushed as it is written. JSON has no NaN or Infinity, and
orjson would silently write them as null; rlctl writes them as the strings "NaN", "Infinity" and
"-Infinity" (the spelling Python's json uses) so a poisoned metric stays visible, and ``read_rows``
turns them back into floats. A truncated last line (a crash mid-write) is skipped and reported.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _decode(value: Any) -> Any:
    return _NONFINITE.get(value, value) if isinstance(value, str) else value


def dumps_row(row: dict[str, Any]) -> bytes:
    return orjson.dumps({k: _encode(v) for k, v in row.items()}) + b"\n"


class JsonlWriter:
    """Appends rows to a JSONL file, one flushed line each."""

    def __init__(self, path: Path):
        self.path = path
        self._fh: BinaryIO = path.open("ab")

    def write(self, row: dict[str, Any]) -> None:
        self._fh.write(dumps_row(row))
        self._fh.flush()

    def tell(self) -> int:
        return self._fh.tell()

    def close(self) -> None:
        self._fh.close()


def read_rows(path: Path, on_bad_line=None) -> Iterator[dict[str, Any]]:
    """Rows of a JSONL file; a line that does not parse is passed to ``on_bad_line(lineno, line)``."""
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                if on_bad_line is not None:
                    on_bad_line(lineno, line)
                continue
            yield {k: _decode(v) for k, v in row.items()}
