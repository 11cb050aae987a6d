"""Turning a run away from the steps after N: a resume from an older snapshot, or a rollback; and
whether a policy acted after N (then a resume from N does not replay the steps after it exactly); and
whether the run ever committed a snapshot (a run that never did starts over when it resumes).

Nothing is deleted: the metric rows of the later steps move to ``metrics.abandoned.jsonl`` (each tagged
with the resume or rollback that turned away from it) and the later snapshots to
``checkpoints/abandoned/<time>/``. Rank 0 alone calls this; the other ranks wait at a barrier.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from rlctl import events
from rlctl.checkpoint.layout import MANIFEST, QUARANTINE, step_of
from rlctl.metrics import encode_row, parse_rows, read_rows, split_after_step
from rlctl.rundir.layout import ABANDONED, EVENTS, METRICS

if TYPE_CHECKING:
    from rlctl.checkpoint.snapshots import SnapshotManager
    from rlctl.storage import Storage


def turn_tag(event: str, **fields: Any) -> dict[str, Any]:
    """The tag of a turn (``{"event": "resume" | "rollback", ..., "time": ISO-8601 UTC}``)."""
    return {"event": event, **fields, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def turn_away_after(run: Storage, snapshots: SnapshotManager, step: int, tag: dict[str, Any]) -> dict[str, Any]:
    """Move the metric rows and committed snapshots of steps after ``step`` aside, tagged with ``tag``
    (from ``turn_tag``). Returns what moved, as the fields of the event that reports the turn."""
    moved = abandon_rows_after(run, step, tag)
    later = snapshots.abandon_after(step, tag["time"].replace(":", ""))
    return {"abandoned_metric_rows": moved, "abandoned_snapshots": later}


def abandon_rows_after(storage: Storage, step: int, tag: dict[str, Any]) -> int:
    """Move the metric rows of steps after ``step`` from metrics.jsonl to metrics.abandoned.jsonl, each
    tagged with ``tag``. Nothing is lost: they are appended there first, then dropped from the main
    log. Returns the number of lines moved."""
    if not storage.exists(METRICS):
        return 0
    kept, moved = split_after_step(storage.read_bytes(METRICS), step)
    if not moved:
        return 0
    out = []
    for line in moved:
        rows = list(parse_rows(line))
        row = rows[0] if rows else {"unparsed_line": line.decode(errors="replace").rstrip("\n")}
        out.append(orjson.dumps({**encode_row(row), "abandoned": tag}) + b"\n")
    storage.append_bytes(ABANDONED, b"".join(out))
    storage.write_bytes(METRICS, kept)
    return len(moved)


def policy_acted_after(run: Storage, step: int) -> bool:
    """Whether a policy rolled back, adjusted or skipped after ``step`` (in events.jsonl): the steps a
    resume from ``step`` re-does then take another path than they took the first time."""
    acted = (events.ROLLBACK, events.ADJUST, events.SKIP)
    return any(
        e.get("event") in acted and isinstance(at := e.get("step", e.get("from_step")), int) and at > step
        for e in read_rows(run, EVENTS)
    )


def ever_committed(run: Storage, checkpoints: Storage) -> bool:
    """Whether the run ever committed a snapshot: a step directory with a manifest is on its checkpoint
    storage ``checkpoints`` (usable or not), one was quarantined there, or events.jsonl records a
    commit. One that never did (killed before its first commit, or that never snapshots:
    checkpoint.every 0) has nothing a resume could lose by starting it over from step 0."""
    if any(e.get("event") == events.SNAPSHOT_COMMITTED for e in read_rows(run, EVENTS)):
        return True
    if checkpoints.listdir(QUARANTINE):
        return True
    steps = [name for name in checkpoints.listdir() if step_of(name) is not None]
    return any(checkpoints.exists(name, MANIFEST) for name in steps)
