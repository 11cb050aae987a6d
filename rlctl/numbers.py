"""What counts as a number in a row or an event read back: an int or a float, never a bool (JSON's
``true`` is no metric value, though Python's bool is an int); and which keys of a metric row are no
metrics."""

from __future__ import annotations

import math
from typing import Any

# keys of a metric row that are not metrics: the x-axis and the wall time
NOT_METRICS = frozenset({"step", "timestamp"})


def is_number(value: Any, finite: bool = False) -> bool:
    """Whether ``value`` is an int or a float and not a bool; with ``finite``, also not NaN or +-inf."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return not finite or math.isfinite(value)


def is_step(value: Any) -> bool:
    """Whether ``value`` is a step: an int (not a bool) of 0 or more."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
