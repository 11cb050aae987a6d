"""Starting and resuming a run under its lease.

``start_run`` checks what can be checked before any work, then takes its run directory: a new one, or
one whose earlier start never trained a step. ``resume_run`` applies the allowed ``--set`` changes and
chooses the snapshots to try (``plan_resume``): a run that never committed a snapshot starts over from
step 0 (it is seeded: it trains the same steps again; the rows it wrote move aside, said by a warning
and a ``started_over`` event), one whose snapshots were committed but none is usable now is refused
(never trained again silently from step 0). Both then train while holding the
run's lease and fenced by it: the one rank in this process, or several handed over to ``rlctl.ranks``
(local processes or Ray actors), which this process follows while rank 0 writes the events and metrics.

How a run ends is recorded in events.jsonl whatever ends it: a stop signal that came before a trainer
could take it (``preempted``), Ctrl-C (``interrupted``), a rank that died without saying; unless the
session recorded it already, or nothing may be written (a lost lease).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from rlctl import events as names
from rlctl.checkpoint.catalog import Catalog, SnapshotInfo, parse_step_spec
from rlctl.config import RunConfig
from rlctl.errors import ConfigError, ExitCode, NodeLost, Preempted, RankFailed, RlctlError, SnapshotError
from rlctl.metrics import EventLog
from rlctl.ranks.local import launch_local
from rlctl.ranks.local import main as local_rank_main
from rlctl.ranks.ray import launch_ray
from rlctl.ranks.report import Reporter, SilentReporter
from rlctl.ranks.starter import rank_starter
from rlctl.ranks.stops import STOPS, Stopped
from rlctl.ranks.tmpdir import run_tempdir
from rlctl.ranks.worker import rest_snapshot_writer, start_snapshot_writer, train_rank
from rlctl.rundir.directory import (
    claim_run_dir,
    last_step,
    load_run_config,
    refuse_used_run_dir,
    run_storage,
)
from rlctl.rundir.history import abandon_rows_after, ever_committed, turn_tag
from rlctl.rundir.lease import Lease, describe_lease
from rlctl.rundir.overrides import apply_resume_overrides
from rlctl.rundir.record import RunRecord, ended_since, standing
from rlctl.rundir.selection import ResumePlan, select
from rlctl.rundir.snapshots import snapshot_catalog, snapshot_storage
from rlctl.rundir.summary import run_summary
from rlctl.storage import Storage
from rlctl.storage.clients import url_problem
from rlctl.storage.outages import store_of


def start_run(
    cfg: RunConfig, url: str, *, reporter: Reporter | None = None, wait_for_lease: bool = False
) -> dict[str, Any]:
    run = run_storage(url, cfg)
    refuse_used_run_dir(run)  # before the preflight imports torch; again under the lease, before any write
    with run_tempdir(run.url), _snapshot_writer(run, cfg), _ranks_starter(cfg):
        _trackers_need_a_local_run_dir(run, cfg)  # (sentences about the config before any request)
        _storage_reaches_every_node(run, cfg)
        _preflight(cfg, run)
        reporter = reporter or SilentReporter()
        run.makedirs()
        with _lease(run, cfg, reporter, wait=wait_for_lease) as lease:
            reused = claim_run_dir(run, cfg)
            if reused:
                reporter.note(f"reusing {url}: its earlier start never trained a step")
            with _recording(run, cfg, lease) as events:
                _record_takeover(lease, events)
                reused_field = {"reused": True} if reused else {}
                events.emit({"event": names.START, "total_steps": cfg.trainer.total_steps, **reused_field})
                snapshot_catalog(run, cfg, events).remove_uncommitted()
                return _train(run, cfg, events, reporter, None, lease)


def resume_run(
    url: str,
    spec: str = "latest",
    overrides: list[str] = (),
    *,
    force: bool = False,
    wait_for_lease: bool = False,
    reporter: Reporter | None = None,
) -> dict[str, Any]:
    parse_step_spec(spec, "--from")  # a bad spec is refused before any work
    run = Storage(url)
    cfg, changes = apply_resume_overrides(load_run_config(run), list(overrides))
    completed = _completed_step(run, cfg) is not None
    with run_tempdir(run.url), _snapshot_writer(run, cfg, unless=completed), _ranks_starter(cfg, unless=completed):
        taking = {"force": force, "wait": wait_for_lease}
        return _resume(run_storage(url, cfg), cfg, spec, changes, taking, reporter or SilentReporter())


def _resume(
    run: Storage, cfg: RunConfig, spec: str, changes: dict[str, Any], taking: dict[str, bool], reporter: Reporter
) -> dict[str, Any]:
    """``resume_run`` once the config is read: the preflight, then under the lease (taken as ``taking``
    says: ``force``, ``wait``) the plan, and training."""
    _trackers_need_a_local_run_dir(run, cfg)  # (sentences about the config before any request)
    _storage_reaches_every_node(run, cfg)
    _preflight(cfg, run)
    with _lease(run, cfg, reporter, **taking) as lease, _recording(run, cfg, lease) as events:
        _record_takeover(lease, events)
        catalog = snapshot_catalog(run, cfg, events)
        removed = catalog.remove_uncommitted()
        if removed:
            events.emit({"event": names.UNCOMMITTED_REMOVED, "steps": removed})
        plan = plan_resume(run, cfg, catalog, spec, changes, reporter, events)
        if plan is None:
            reporter.note(f"run already complete ({cfg.trainer.total_steps} steps); nothing to do")
            return run_summary(run, cfg)
        return _train(run, cfg, events, reporter, plan, lease)


def start_snapshot_writer_early(cfg: RunConfig, url: str) -> None:
    """Start the snapshot writer process of a run that this process will train (one rank) before this
    process imports torch (``start_snapshot_writer``); ``start_run`` puts it to rest when the run ends. For a
    command that imports the engine before it calls ``start_run``."""
    if (problem := url_problem(url)) is not None:  # (what opening the storage would say, before any output)
        raise ConfigError(problem)
    if cfg.world_size == 1:
        start_snapshot_writer(url, cfg)  # (no storage opened: an object store's client starts a thread)


def resume_snapshot_writer_early(url: str, overrides: list[str]) -> None:
    """``start_snapshot_writer_early`` for `rlctl resume`, before its progress display starts a thread (a
    process of one thread forks its writer, which then imports nothing again): nothing when the run is
    complete, or its config cannot be read (``resume_run`` says why), or it lies on an object store (its
    client's thread would keep the writer from being forked, and a store that is down would be waited
    for twice)."""
    if store_of(url) is not None:
        return
    with contextlib.suppress(RlctlError, OSError):
        run = Storage(url)
        cfg, _ = apply_resume_overrides(load_run_config(run), list(overrides))
        if _completed_step(run, cfg) is None:
            start_snapshot_writer_early(cfg, url)


@contextlib.contextmanager
def _snapshot_writer(run: Storage, cfg: RunConfig, unless: bool = False) -> Iterator[None]:
    """For a run trained in this process (one rank), its snapshot writer process started at once
    (``start_snapshot_writer``: it imports torch while this process does, before the preflight; a writer
    an earlier run of this process started in the same environment is kept), and put to rest when the
    run ends, trained or turned away (no snapshot is in flight by then): it frees what it held for the
    run and serves this process's next run. ``unless``: none is started (the run is most likely
    complete: its writer would only import)."""
    started = not unless and cfg.world_size == 1 and start_snapshot_writer(run, cfg)
    try:
        yield
    finally:
        if started:
            rest_snapshot_writer()


def _ranks_starter(cfg: RunConfig, unless: bool = False) -> contextlib.AbstractContextManager:
    """For a run of several local ranks, the process that forks them (``rlctl.ranks.starter``), forked
    now, while this process runs one thread: it imports what a rank imports beside the preflight."""
    return rank_starter(not unless and cfg.world_size > 1 and cfg.cluster.backend == "local", local_rank_main)


def _completed_step(run: Storage, cfg: RunConfig) -> int | None:
    """The step of events.jsonl's last outcome when it is ``completed`` at the total steps, else None."""
    last = RunRecord(run).last_outcome() or {}
    step = last.get("step")
    done = last.get("event") == names.COMPLETED and isinstance(step, int) and step >= cfg.trainer.total_steps
    return step if done else None


def _preflight(cfg: RunConfig, run: Storage) -> None:
    """Everything that can be checked before any work (the reward function, the device, the model's
    context, that the run's storage answers and its bucket exists), before the run directory is written."""
    from rlctl.preflight import check_before_start  # imports the reward module

    check_before_start(cfg, run)


def _trackers_need_a_local_run_dir(run: Storage, cfg: RunConfig) -> None:
    """Trackers write their files into the run directory: a ConfigError before any work when it is on
    object storage."""
    if cfg.trainer.loggers and not run.is_local:
        raise ConfigError(
            f"'trainer.loggers' ({', '.join(cfg.trainer.loggers)}) write into the run directory, which must be "
            f"local; {run.url} is not (snapshots may still go to object storage: checkpoint.dir)"
        )


def _storage_reaches_every_node(run: Storage, cfg: RunConfig) -> None:
    """Ranks on several nodes each write their own files of a snapshot (and rank 0 the metrics): a
    ConfigError before any work when the run directory or the snapshots' storage is on one machine's
    own disk (ext4, tmpfs...; NFS, Lustre or an object store reach every node), or in this process."""
    if cfg.cluster.backend != "ray" or cfg.trainer.nnodes < 2:
        return
    from rlctl.storage.mounts import node_local

    for what, where in (("the run directory", run), ("the snapshots' storage", snapshot_storage(run, cfg))):
        kind = node_local(where.local_path()) if where.is_local else None
        if kind is not None or where.in_process:
            on = f"this machine's own {kind} filesystem" if kind else "the memory of this process"
            raise ConfigError(
                f"{what} {where.url} is on {on}, but the run's ranks are on {cfg.trainer.nnodes} nodes: each would "
                "write its part of a snapshot on its own node. Use storage every node reaches: an object "
                "store (checkpoint.dir: s3://...) or a shared filesystem (NFS, Lustre)"
            )


def _lease(run: Storage, cfg: RunConfig, reporter: Reporter, force: bool = False, wait: bool = False) -> Lease:
    """The run's lease; a takeover is said on stderr in one line (``_record_takeover`` records it)."""
    lease = Lease(run, cfg.trainer.lease_timeout, cfg.trainer.lease_heartbeat).acquire(force, wait, reporter.note)
    if lease.taken_over is not None:
        reporter.note(f"took over the lease of {describe_lease(lease.taken_over, run)}: {lease.takeover_reason}")
    return lease


def _record_takeover(lease: Lease, events: EventLog) -> None:
    if lease.taken_over is not None:
        previous, reason = lease.taken_over, lease.takeover_reason
        events.emit({"event": names.LEASE_TAKEN_OVER, "previous": previous, "reason": reason})


# -- which snapshot ------------------------------------------------------------------------------------
def plan_resume(
    run: Storage,
    cfg: RunConfig,
    catalog: Catalog,
    spec: str,
    changes: dict[str, Any],
    reporter: Reporter,
    events: EventLog,
) -> ResumePlan | None:
    """The plan to train from (the usable snapshots ``spec`` chooses in ``catalog``, best first, each one
    it skips said; none: the run starts over, ``_start_over``), or None when ``--from latest`` finds the
    run complete."""
    selection = select(catalog, spec, "--from")
    if selection.wanted == "latest" and _completed(run, cfg, list(selection.candidates)):
        return None
    selection.skip(reporter.note)
    if not selection.usable:
        _start_over(run, catalog, reporter, events)
    elif (was := (selection.usable[0].manifest or {}).get("world_size")) != cfg.world_size:
        reporter.note(
            f"{selection.usable[0].name} was written by {was} rank(s); it loads on {cfg.world_size}: an elastic resume"
        )
    return ResumePlan.of(selection, changes)


def _start_over(run: Storage, catalog: Catalog, reporter: Reporter, events: EventLog) -> None:
    """No usable snapshot: the run starts over from step 0 when it never committed one (killed before
    its first commit, or one that never snapshots). It is seeded, so it trains the same steps again: the
    rows it wrote move to metrics.abandoned.jsonl (tagged as a resume from step 0), said by a warning and
    a ``started_over`` event. A run whose snapshots were committed, none usable now, is refused
    (SnapshotError): starting it over would silently throw away what it had kept."""
    trained = last_step(run)
    if not trained:
        reporter.note("no snapshot yet: the run never trained a step; starting it over")
        return
    if ever_committed(run, catalog.storage):
        raise SnapshotError(
            f"no usable snapshot in {catalog.storage.url}, though the run committed snapshots before and "
            f"trained {trained} step(s); resuming would train them again from step 0 (rlctl checkpoints "
            f"{run.url} says why each is not usable; rlctl start begins a new run)"
        )
    moved = abandon_rows_after(run, -1, turn_tag(names.RESUME, from_step=0, started_over=True))
    events.emit({"event": names.STARTED_OVER, "trained": trained, "abandoned_metric_rows": moved})
    reporter.note(
        f"warning: no snapshot was ever committed; starting the run over from step 0 (it trained {trained} "
        f"step(s); {moved} metric row(s) moved to metrics.abandoned.jsonl)"
    )


def _completed(run: Storage, cfg: RunConfig, candidates: list[SnapshotInfo]) -> bool:
    """Whether the run's last recorded outcome is ``completed`` at its total steps, with its final
    snapshot committed (when it snapshots at all): only then is there nothing to resume."""
    step = _completed_step(run, cfg)
    if step is None:
        return False
    snapshots_kept = cfg.checkpoint.every > 0 or any(c.committed for c in candidates)
    return not snapshots_kept or any(c.usable and c.step >= step for c in candidates)


# -- training and how it ended -------------------------------------------------------------------------
def _train(
    run: Storage, cfg: RunConfig, events: EventLog, reporter: Reporter, plan: ResumePlan | None, lease: Lease
) -> dict[str, Any]:
    """Train here (one rank), or launch the ranks and follow them (several: local processes or Ray
    actors; rank 0 then writes the events and metrics while this process keeps the lease). Either is
    fenced by the lease: it stops before its next write once the lease is lost."""
    if cfg.world_size == 1:
        return train_rank(run, cfg, events, reporter, plan, fence=lease.check)
    launch = launch_ray if cfg.cluster.backend == "ray" else launch_local
    events.close()  # rank 0 appends to it now: one writer at a time
    try:
        return launch(run, cfg, plan, reporter, fence=lease.check, lease_owner=lease.owner)
    finally:
        events.reopen()


@contextlib.contextmanager
def _recording(run: Storage, cfg: RunConfig, lease: Lease) -> Iterator[EventLog]:
    """The run's event log for the block, fenced by the lease; how the block ended is recorded unless
    the session did: a stop signal before a trainer took it (then raised as Preempted, naming the
    snapshot a resume starts from), Ctrl-C, or a rank that died without saying."""
    events = EventLog(run, fence=lease.check)
    offset = events.tell()
    try:
        yield events
    except Stopped as stop:
        raise _stopped_early(run, cfg, events, stop.signal_name) from None
    except KeyboardInterrupt:
        if not ended_since(run, offset):
            _record(events, {"event": names.INTERRUPTED})
        raise
    except NodeLost as exc:  # recorded even after a survivor's crash: the lost node is why it crashed
        trained, last, _ = standing(run, cfg)
        _record(
            events,
            {
                "event": names.NODE_LOST,
                "step": trained,
                "snapshot": last and last.step,
                "nodes": exc.nodes,
                "error": exc.message,
                "exit_code": int(exc.exit_code),
            },
        )
        raise
    except RankFailed as exc:
        if not ended_since(run, offset):
            kind = names.PREEMPTED if exc.exit_code == ExitCode.PREEMPTED else names.CRASHED
            _record(events, {"event": kind, "error": exc.message, "exit_code": int(exc.exit_code)})
        raise
    except Exception as exc:
        if STOPS.early is None or isinstance(exc, RlctlError):
            raise
        # a stop raised in the middle of third-party start-up code (an import) can surface as that
        # code's own error: the stop is what happened
        raise _stopped_early(run, cfg, events, STOPS.early) from None
    finally:
        events.close()


def _stopped_early(run: Storage, cfg: RunConfig, events: EventLog, signal_name: str) -> Preempted:
    """Record a stop that came before a trainer could take it (before training began, or while a step waited
    on a reward URL's backoff) as a preemption; the error that says so."""
    trained, last, kept = standing(run, cfg)
    _record(
        events,
        {
            "event": names.PREEMPTED,
            "step": last.step if last else 0,
            "signal": signal_name,
            "snapshot": last and last.step,
        },
    )
    if last is not None:
        where = f"the last committed snapshot is {last.name}"
    elif trained and kept:
        where = "the run has no usable snapshot to resume from"
    else:
        where = "no snapshot yet; resume will start over"
    when = "before the step in progress finished" if trained else "before training began"
    return Preempted(f"stopped by {signal_name} {when}; {where}. Resume with: rlctl resume {run.url} --from latest")


def _record(events: EventLog, event: dict[str, Any]) -> None:
    """Record how the run ended; a record that cannot be written does not replace the error that ended
    the run (the storage may be what failed)."""
    with contextlib.suppress(Exception):
        events.emit(event)
