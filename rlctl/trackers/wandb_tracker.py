"""Weights & Biases: offline runs in RUN_DIR/wandb/ unless WANDB_MODE or the user's wandb settings
choose a mode, quiet and light (no console capture, code, git, requirements or system stats).

The trainer step is W&B's step. The W&B run id lives in RUN_DIR/trackers.json, so a resume continues
the same W&B run (resume="allow"). A rollback, or a resume that changes the run, finishes the current
W&B run tagged as turned away at step N and starts a branch: a new W&B run (same group: the rlctl run;
named "<run>-branch-2", ...) with the settled history through N replayed into it.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from rlctl.trackers.base import History
from rlctl.trackers.run_ids import TrackerIds

KEY = "wandb"
QUIET = {
    "console": "off",
    "save_code": False,
    "disable_code": True,
    "disable_git": True,
    "disable_job_creation": True,
    "x_save_requirements": False,
    "x_disable_stats": True,
    "x_disable_meta": True,
    "x_disable_machine_info": True,
    "silent": True,
}


def _settings(wandb: Any) -> Any:
    """Quiet settings the installed wandb knows, offline unless the user chose a mode."""
    wanted: dict[str, Any] = dict(QUIET)
    if _user_mode(wandb) is None:
        wanted["mode"] = "offline"
    known = getattr(wandb.Settings, "model_fields", None) or ("console", "save_code", "silent", "mode")
    wanted = {k: v for k, v in wanted.items() if k in known}
    return wandb.Settings(**wanted)


def _user_mode(wandb: Any) -> str | None:
    """The mode the user chose: $WANDB_MODE, or "mode" in their wandb settings files (``wandb online``
    writes it); None when neither does."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    config_dir = os.environ.get("WANDB_CONFIG_DIR") or os.path.join("~", ".config", "wandb")
    try:
        settings = wandb.Settings(settings_system=os.path.expanduser(os.path.join(config_dir, "settings")))
        files = settings.read_system_settings().all()
    except Exception:  # a wandb without these: none chosen, as far as we can tell
        return None
    return files.get("mode") or None


def _stamped(values: dict[str, float], wall: float | None) -> dict[str, float]:
    """The values with the row's wall time as W&B's ``_timestamp`` (a replayed row keeps its time)."""
    return values if wall is None else {**values, "_timestamp": wall}


class WandbTracker:
    name = "W&B"

    def __init__(self, run_dir: str, run_name: str, config: dict[str, Any], ids: TrackerIds, history: History):
        self.run_dir, self.run_name, self.config = run_dir, run_name, config
        self.ids, self.history = ids, history
        self.run = None
        self._settings = None

    def _init(self, run_id: str, branch: int, notes: str | None = None):
        """wandb.init of W&B run ``run_id`` (created, or continued when it exists), branch ``branch``."""
        import wandb

        if self._settings is None:
            self._settings = _settings(wandb)
            wandb.setup(settings=self._settings)  # process-wide: no analytics threads when offline
        return wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "rlctl",
            group=self.run_name,
            name=self.run_name if branch == 1 else f"{self.run_name}-branch-{branch}",
            id=run_id,
            dir=self.run_dir,
            resume="allow",
            config=self.config,
            allow_val_change=True,  # a resume after an adjust: the config's knobs moved
            tags=[f"branch-{branch}"] if branch > 1 else None,
            notes=notes,
            settings=self._settings,
        )

    def _current(self):
        """The W&B run being fed: the one in trackers.json (a resume), else a new one."""
        if self.run is None:
            record = self.ids.get(KEY)
            if record is not None:
                self.run = self._init(record["run_id"], int(record.get("branch", 1)))
            else:
                self._branch(1, parent=None)
        return self.run

    def _branch(self, branch: int, parent: str | None) -> None:
        """Start W&B run number ``branch`` with the settled history replayed, and make it current."""
        run_id = uuid.uuid4().hex[:12]  # os.urandom, not the run's random
        notes = f"branched from W&B run {parent} at step {self.history.settled}" if parent else None
        self.run = self._init(run_id, branch, notes=notes)
        for step, values, wall in self.history.rows():
            if values:
                self.run.log(_stamped(values, wall), step=step)
        self.ids.put(KEY, {"run_id": run_id, "branch": branch})

    def log(self, step: int, values: dict[str, float], wall: float | None) -> None:
        self._current().log(_stamped(values, wall), step=step)

    def event(self, step: int, kind: str, text: str) -> None:
        run = self._current()
        # W&B drops a step below its last one (a snapshot committed in the background, reported after
        # the next row): such an event goes to the last step; its text names its own
        run.log({f"events/{kind}": 1, f"events/{kind}/text": text}, step=max(step, run.step))

    def turn(self, step: int, *, branch: bool, why: str) -> None:
        if not branch:
            return  # a bit-exact resume: the same W&B run goes on
        record = self.ids.get(KEY)
        if self.run is None and record is not None:
            self.run = self._init(record["run_id"], int(record.get("branch", 1)))
        parent = None
        if self.run is not None:
            parent = self.run.id
            self.run.summary["rlctl/turned_away_at_step"] = step
            self.run.summary["rlctl/turned_away_by"] = why
            self.run.tags = (*(self.run.tags or ()), f"turned-away-at-{step}")
            self.run.finish()
            self.run = None
        self._branch(int(record.get("branch", 1)) + 1 if record else 1, parent)

    def close(self, ok: bool) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish(exit_code=0 if ok else 1)
