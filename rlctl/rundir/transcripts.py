"""The transcripts of a multi-turn run's conversations (RUN_DIR/trajectories/), named and read here;
written by ``rlctl.engine.rollout.transcript`` (which says what a line holds). Every line may be torn
or malformed (a kill mid-write, a hand edit): such a line is skipped."""

from __future__ import annotations

import re
from typing import Any

import orjson

from rlctl.rundir.layout import TRAJECTORIES
from rlctl.storage import Storage

_STEP_FILE = re.compile(r"step-(\d{6})\.rank-(\d+)\.jsonl")


def step_file(step: int, rank: int) -> str:
    return f"{TRAJECTORIES}/step-{step:06d}.rank-{rank}.jsonl"


def recorded_steps(run: Storage) -> list[int]:
    """The steps with transcripts, in order."""
    return sorted({int(m.group(1)) for n in run.listdir(TRAJECTORIES) if (m := _STEP_FILE.fullmatch(n))})


def read_step(run: Storage, step: int) -> list[dict[str, Any]]:
    """Every rank's conversations of ``step``, by prompt and sample."""
    rows = []
    for name in run.listdir(TRAJECTORIES):
        m = _STEP_FILE.fullmatch(name)
        if m is None or int(m.group(1)) != step:
            continue
        for raw in run.read_bytes(TRAJECTORIES, name).splitlines():
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("segments"), list):
                rows.append(row)
    return sorted(rows, key=lambda r: (r.get("prompt_index", 0), r.get("sample_index", 0)))
