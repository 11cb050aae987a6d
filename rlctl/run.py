"""Starting and resuming a run under its lease.

``start_run`` creates the run directory; ``resume_run`` applies the allowed ``--set`` changes and
chooses the snapshots to try. Both then train while holding the run's lease: the one rank in this
process, or several handed over to ``rlctl.ranks`` (local processes or Ray actors), which this process
follows while rank 0 writes the events and metrics.
"""

from __future__ import annotations

from typing import Any

from rlctl.checkpoint.snapshots import parse_step_spec
from rlctl.config import RunConfig
from rlctl.errors import ExitCode, RankFailed, SnapshotError
from rlctl.metrics import EventLog, parse_rows, read_rows
from rlctl.ranks.local import launch_local
from rlctl.ranks.ray import launch_ray
from rlctl.ranks.report import Reporter, SilentReporter
from rlctl.ranks.worker import train_rank
from rlctl.rundir.directory import create_run_dir, load_run_config, run_summary, snapshot_manager
from rlctl.rundir.layout import EVENTS
from rlctl.rundir.lease import Lease
from rlctl.rundir.overrides import apply_resume_overrides
from rlctl.storage import Storage


def start_run(cfg: RunConfig, url: str, *, reporter: Reporter | None = None) -> dict[str, Any]:
    run = create_run_dir(url, cfg)
    events = EventLog(run)
    try:
        with Lease(run, cfg.trainer.lease_timeout, cfg.trainer.lease_heartbeat).acquire():
            events.emit({"event": "start", "total_steps": cfg.trainer.total_steps})
            snapshots = snapshot_manager(run, cfg, events)
            snapshots.remove_uncommitted()
            return _train(run, cfg, events, reporter or SilentReporter(), restore=None)
    finally:
        events.close()


def resume_run(
    url: str,
    spec: str = "latest",
    overrides: list[str] = (),
    *,
    force: bool = False,
    reporter: Reporter | None = None,
) -> dict[str, Any]:
    run = Storage(url)
    cfg, changes = apply_resume_overrides(load_run_config(run), list(overrides))
    wanted = parse_step_spec(spec)
    reporter = reporter or SilentReporter()
    events = EventLog(run)
    try:
        with Lease(run, cfg.trainer.lease_timeout, cfg.trainer.lease_heartbeat).acquire(force) as lease:
            if lease.taken_over is not None:
                events.emit({"event": "lease_taken_over", "previous": lease.taken_over})
            snapshots = snapshot_manager(run, cfg, events)
            removed = snapshots.remove_uncommitted()
            if removed:
                events.emit({"event": "uncommitted_removed", "steps": removed})
            candidates = snapshots.candidates(wanted)
            if isinstance(wanted, int) and candidates[0].problem:
                raise SnapshotError(f"snapshot {candidates[0].name} is not usable: {candidates[0].problem}")
            if wanted == "last-good" and not candidates:
                raise SnapshotError(f"no good snapshot in {snapshots.storage.url}")
            if wanted == "latest" and _completed(run, cfg):
                reporter.note(f"run already complete ({cfg.trainer.total_steps} steps); nothing to do")
                return run_summary(run)
            for bad in (c for c in candidates if not c.usable):
                reporter.note(f"warning: skipping snapshot {bad.name}: {bad.problem}")
            restore = {"names": [c.name for c in candidates if c.usable], "wanted": wanted, "changes": changes}
            return _train(run, cfg, events, reporter, restore)
    finally:
        events.close()


def _completed(run: Storage, cfg: RunConfig) -> bool:
    return any(
        e.get("event") == "completed" and e.get("step", 0) >= cfg.trainer.total_steps for e in read_rows(run, EVENTS)
    )


def _train(
    run: Storage, cfg: RunConfig, events: EventLog, reporter: Reporter, restore: dict[str, Any] | None
) -> dict[str, Any]:
    """Train here (one rank), or launch the ranks and follow them (several: local processes or Ray
    actors; rank 0 then writes the events and metrics while this process keeps the lease)."""
    if cfg.world_size == 1:
        return train_rank(run, cfg, events, reporter, restore)
    launch = launch_ray if cfg.cluster.backend == "ray" else launch_local
    offset = events.tell()
    events.close()  # rank 0 appends to it now: one writer at a time
    try:
        return launch(run, cfg, restore, reporter)
    except RankFailed as exc:
        # rank 0 may not have lived to record how the run ended: then the driver does
        ended = {"completed", "preempted", "halted", "crashed"}
        since = run.read_bytes(EVENTS)[offset:] if run.exists(EVENTS) else b""
        if not any(e.get("event") in ended for e in parse_rows(since)):
            events.reopen()
            kind = "preempted" if exc.exit_code == ExitCode.PREEMPTED else "crashed"
            events.emit({"event": kind, "error": exc.message, "exit_code": int(exc.exit_code)})
        raise
    finally:
        events.reopen()
