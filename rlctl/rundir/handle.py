"""The run directory as the engine sees it: one handle (``RunDir``) over a run's files.

The rank that trains a run opens its storage and hands the engine this handle. The engine asks it for
what it writes and reads back: the config, the metric and event logs, the policy state, turning the
run away from the steps after one, the tool-call record, the trajectories and the built-in model's
directory. It never names a file of the run (``rundir.layout`` does) and never opens storage.

What else the engine needs of this floor (what a resume plans, the stages its engines train at, the
snapshots a rollback may take, the tag of a turn) is re-exported here: this is the one module of
``rundir/`` the engine imports (tests/unit/test_house_rules.py holds it to that)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from rlctl.metrics import JsonlLog, read_rows
from rlctl.rundir import history, model_store
from rlctl.rundir.history import turn_tag
from rlctl.rundir.layout import CONFIG, EVENTS, METRICS, POLICY_STATE, TOOL_CALLS, TOOL_RESULTS, step_rank_file
from rlctl.rundir.selection import ResumePlan, rollback_candidates
from rlctl.rundir.snapshots import ZeroStages, trained_stages
from rlctl.rundir.trajectories import step_file
from rlctl.storage import Storage

if TYPE_CHECKING:
    from rlctl.checkpoint.snapshots import SnapshotManager
    from rlctl.config import RunConfig

__all__ = ["RunDir", "ResumePlan", "ZeroStages", "rollback_candidates", "trained_stages", "turn_tag"]


class RunDir:
    """A run's files on its storage (any fsspec URL), for the process that trains it."""

    def __init__(self, storage: Storage):
        self.storage = storage

    @property
    def url(self) -> str:
        return self.storage.url

    # -- the config, the logs ----------------------------------------------------------------------------
    def write_config(self, cfg: RunConfig) -> None:
        """Record ``cfg`` as the run's config (its knobs as they are now)."""
        self.storage.write_bytes(CONFIG, cfg.to_yaml().encode())

    def files_in_snapshot(self, cfg: RunConfig) -> dict[str, bytes]:
        """The run's files a snapshot carries, by name: its config as it is now."""
        return {CONFIG: cfg.to_yaml().encode()}

    def metrics_log(self, fence: Callable[[], None] | None = None) -> JsonlLog:
        """The log the step rows are appended to; ``fence`` is called before every write."""
        return JsonlLog(self.storage, METRICS, fence=fence)

    def events(self) -> list[dict[str, Any]]:
        """The events recorded so far (unreadable lines skipped)."""
        return read_rows(self.storage, EVENTS)

    # -- the policies' state, turning back -----------------------------------------------------------------
    @property
    def policy_state_url(self) -> str:
        return self.storage.url_of(POLICY_STATE)

    def write_policy_state(self, step: int, state: dict[str, Any]) -> None:
        """The rollback policies' ``state`` as of ``step``."""
        self.storage.write_bytes(POLICY_STATE, orjson.dumps({"step": step, **state}))

    def read_policy_state(self) -> bytes | None:
        """The policy state's bytes as written (they may be malformed), or None when there are none."""
        try:
            return self.storage.read_bytes(POLICY_STATE)
        except FileNotFoundError:
            return None

    def turn_away_after(self, snapshots: SnapshotManager, step: int, tag: dict[str, Any]) -> dict[str, Any]:
        """Move the metric rows and committed snapshots of the steps after ``step`` aside, tagged with
        ``tag`` (``turn_tag``); what moved, as the fields of the event that reports the turn."""
        return history.turn_away_after(self.storage, snapshots, step, tag)

    def policy_acted_after(self, step: int) -> bool:
        """Whether a policy rolled back, adjusted or skipped after ``step``."""
        return history.policy_acted_after(self.storage, step)

    # -- a multi-turn run's record of tool calls, its trajectories -----------------------------------------------
    def add_tool_answer(self, sha: str, text: bytes) -> None:
        """An answer's text, stored once under its sha256 (one stored before is kept)."""
        with contextlib.suppress(FileExistsError):
            self.storage.write_bytes(f"{TOOL_RESULTS}/{sha}", text, exclusive=True)

    def append_tool_calls(self, step: int, rank: int, lines: bytes) -> None:
        self.storage.append_bytes(step_rank_file(TOOL_CALLS, step, rank), lines)

    def tool_calls(self, step: int, rank: int) -> bytes | None:
        """The lines of the calls ``rank`` answered at ``step`` (None: it answered none)."""
        try:
            return self.storage.read_bytes(step_rank_file(TOOL_CALLS, step, rank))
        except FileNotFoundError:
            return None

    def tool_answer(self, sha: str) -> bytes | None:
        """The text stored under ``sha`` as it is on storage (None: none is)."""
        try:
            return self.storage.read_bytes(TOOL_RESULTS, sha)
        except FileNotFoundError:
            return None

    def write_trajectories(self, step: int, rank: int, lines: bytes) -> None:
        """``rank``'s trajectories of ``step`` (replacing an earlier run's of the same step)."""
        self.storage.write_bytes(step_file(step, rank), lines)

    # -- the built-in model ------------------------------------------------------------------------------------
    def model_dir(self, build: Callable[[Path], None], problem: Callable[[Path], str | None]) -> Path:
        """A local directory holding the run's built-in model, built once (``build(dir)``) and reused;
        ``problem(dir)``: why a directory found without its completion marker does not load, or None
        (``rundir.model_store``)."""
        return model_store.model_dir(self.storage, build, problem)
