"""The trajectories of a multi-turn run's conversations (RUN_DIR/trajectories/), named and read here;
written by ``rlctl.engine.rollout.trajectory`` (which says what a line holds). Every line may be torn
or malformed (a kill mid-write, a hand edit): such a line is skipped."""

from __future__ import annotations

from typing import Any

import orjson

from rlctl.rundir.layout import STEP_RANK_FILE, TRAJECTORIES, step_rank_file
from rlctl.storage import Storage


def step_file(step: int, rank: int) -> str:
    return step_rank_file(TRAJECTORIES, step, rank)


def recorded_steps(run: Storage) -> list[int]:
    """The steps with trajectories, in order."""
    return sorted({int(m.group(1)) for n in run.listdir(TRAJECTORIES) if (m := STEP_RANK_FILE.fullmatch(n))})


def read_step(run: Storage, step: int) -> list[dict[str, Any]]:
    """Every rank's conversations of ``step``, by prompt and sample."""
    rows = []
    for name in run.listdir(TRAJECTORIES):
        m = STEP_RANK_FILE.fullmatch(name)
        if m is None or int(m.group(1)) != step:
            continue
        for raw in run.read_bytes(TRAJECTORIES, name).splitlines():
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if _well_formed(row):
                rows.append(row)
    return sorted(rows, key=lambda r: (r.get("prompt_index", 0), r.get("sample_index", 0)))


def _well_formed(row: Any) -> bool:
    """A line a reader can show: an object whose segments (and calls, if any) are objects."""
    if not isinstance(row, dict) or not isinstance(row.get("segments"), list):
        return False
    calls = row.get("calls", [])
    return (
        all(isinstance(x, dict) for x in row["segments"])
        and isinstance(calls, list)
        and all(isinstance(x, dict) for x in calls)
    )
