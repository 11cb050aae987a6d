"""What every tracker shares: the protocol the fan-out drives, a row's metric values, an event's text,
and the run's history as it stands (the rows a new tracker run replays)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Protocol

from rlctl.numbers import NOT_METRICS, is_step

# JSONL spells non-finite floats as strings (JSON has no NaN); trackers get them back as floats
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def metric_values(row: dict[str, Any]) -> dict[str, float]:
    """The metrics of a row as floats: numbers and the strings "NaN", "Infinity", "-Infinity"; bools,
    other strings and anything else are skipped, and so are "step" and "timestamp"."""
    values = {}
    for key, value in row.items():
        if key in NOT_METRICS or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            values[key] = float(value)
        elif isinstance(value, str) and value in _NONFINITE:
            values[key] = _NONFINITE[value]
    return values


def walltime(row: dict[str, Any]) -> float | None:
    value = row.get("timestamp")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def event_text(event: dict[str, Any], step: int) -> str:
    """One line for a person: the kind, the step and the event's other fields as JSON."""
    fields = {k: v for k, v in event.items() if k not in ("event", "step")}
    return f"{event.get('event')} at step {step}: {json.dumps(fields, default=str, sort_keys=True)}"


class History:
    """The run's metric rows as they stand (``history()``: metrics.jsonl, cut back after any turn) and
    the step through which they are settled: rows up to it are in the log and will not be logged
    again (before a row of step N, the rows before N; after a turn to N, the rows through N)."""

    def __init__(self, read: Callable[[], list[dict[str, Any]]]):
        self._read = read
        self.settled = -1

    def reached(self, step: int) -> None:
        """Rows through ``step`` are settled (it never goes back, except by a turn)."""
        self.settled = max(self.settled, step)

    def turned(self, step: int) -> None:
        """The run turned away from the steps after ``step``."""
        self.settled = step

    def rows(self, through: int | None = None) -> list[tuple[int, dict[str, float], float | None]]:
        """(step, metric values, wall time) of the rows through ``through`` (the settled step by
        default), in step order."""
        last = self.settled if through is None else through
        rows = [r for r in self._read() if is_step(r.get("step")) and r["step"] <= last]
        rows.sort(key=lambda r: r["step"])
        return [(r["step"], metric_values(r), walltime(r)) for r in rows]


class Tracker(Protocol):
    """One experiment tracker, opened lazily by its first call. Any call may raise: the fan-out then
    warns once and stops feeding it."""

    name: str  # as people know it ("TensorBoard", "W&B", "MLflow")

    def log(self, step: int, values: dict[str, float], wall: float | None) -> None:
        """The metrics of one step."""

    def event(self, step: int, kind: str, text: str) -> None:
        """An event: the scalar ``events/<kind>`` = 1 at ``step``, and ``text`` where the tracker
        shows text."""

    def turn(self, step: int, *, branch: bool, why: str) -> None:
        """The run turned away from the steps after ``step`` (a rollback, or a resume). ``branch``:
        those steps will be trained again with other values (a rollback, a resume with changes), not
        only re-done bit-exactly. ``why``: the event's text."""

    def close(self, ok: bool) -> None:
        """End of logging; ``ok``: the run completed (or its process ends without a failure)."""
