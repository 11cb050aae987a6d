"""A rank's session, the same for every kind of rank (in the ``rlctl`` process, a local rank process,
a Ray actor): build the trainer, resume it as the driver's plan says (restore, then turn the run away
from the steps after the snapshot), train, and record how it ended.

The plan (``rlctl.rundir.selection.ResumePlan``: the snapshots to try, best first, and the resume
--set changes) travels to ranks in other processes as plain data; every rank scans the snapshots
itself. Rank 0 alone writes the run's files (config, metrics, events); the other ranks wait at
barriers. Stops go through ``stops.STOPS``: raised at once while the trainer is built, kept for it
from then on. A fence (the lease's check) is called before every step and every commit.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlctl import events as names
from rlctl.checkpoint.snapshots import SnapshotManager
from rlctl.checkpoint.writer import writer as snapshot_writer
from rlctl.config import RunConfig, validate_config
from rlctl.engine.accelerator import deepspeed_accelerator
from rlctl.errors import Halted, LeaseError, Preempted, RlctlError
from rlctl.metrics import EventLog, read_rows
from rlctl.policies import load_policies
from rlctl.policies.guard import PolicyGuard
from rlctl.ranks.report import ReportedEvents, Reporter, SilentReporter
from rlctl.ranks.stops import STOPS, on_stop_signals
from rlctl.rundir.handle import RunDir
from rlctl.rundir.layout import METRICS
from rlctl.rundir.lease import owner_fence
from rlctl.rundir.selection import ResumePlan
from rlctl.rundir.snapshots import ZeroStages, snapshot_manager, snapshot_storage, trained_stages
from rlctl.rundir.summary import run_summary
from rlctl.storage import Storage
from rlctl.yamlsrc import SAVED, load_yaml

if TYPE_CHECKING:
    from rlctl.trackers import Trackers

Fence = Callable[[], None]  # raises (LeaseError) once this process may no longer write the run

# What the snapshot writer process imports as it starts, besides torch: DeepSpeed, whose objects the
# engines' optimizer state dicts hold, imported as the trainer imports it less the optimizer module it
# never builds (``import_deepspeed_for_state``), with its CPU accelerator whatever the run's device (the
# writer never touches one, and need not wait for this process to choose it)
WRITER_PRELOAD = ("rlctl.engine.runtime:import_deepspeed_for_state",)
WRITER_ENV = {"DS_ACCELERATOR": "cpu"}


# -- the session -------------------------------------------------------------------------------------
def train_rank(
    run: Storage,
    cfg: RunConfig,
    events: EventLog | None,
    reporter: Reporter,
    plan: ResumePlan | None,
    rank: int = 0,
    *,
    fence: Fence | None = None,
) -> dict[str, Any]:
    """Run the training loop in this process, as rank ``rank`` (rank 0 alone writes the run's files;
    ``events`` is None on the others), resuming as ``plan`` says (None: a new run). ``fence`` is called
    before every step and every snapshot commit. Returns the run's summary on rank 0, {} on the others."""
    main = rank == 0
    trackers = open_trackers(run, cfg) if main and cfg.trainer.loggers else None
    if trackers is not None:
        events = TrackedEvents(events, trackers)
    try:
        return _session(run, cfg, events, reporter, plan, rank, fence, trackers)
    finally:
        if trackers is not None:
            trackers.close()


def _session(run, cfg, events, reporter, plan, rank, fence, trackers) -> dict[str, Any]:
    main = rank == 0
    trainer, snapshots = _build_trainer(cfg, run, events, reporter, rank, fence, trackers, plan)
    STOPS.keep()  # from here a stop waits for the trainer: it snapshots where it is, then stops
    try:
        if plan is not None:
            trainer.resume(plan, reporter.note)
        reporter.ready(trainer.state.step, cfg.trainer.total_steps)
        emit = events.emit if main else (lambda event: None)
        with STOPS.running(trainer), on_stop_signals(STOPS.request):
            _train(trainer, snapshots, emit, rank if cfg.world_size > 1 else None)
    finally:
        snapshots.close()
    sha = trainer.actor.weights_sha256()  # (a collective under ZeRO-3: every rank computes it)
    emit({"event": names.COMPLETED, "step": trainer.state.step, "weights_sha256": sha})
    return run_summary(run, cfg) if main else {}


def _build_trainer(
    cfg: RunConfig,
    run: Storage,
    events: EventLog | None,
    reporter: Reporter,
    rank: int,
    fence: Fence | None,
    trackers: Trackers | None = None,
    plan: ResumePlan | None = None,
):
    """This process as a rank of the run: its snapshot writer process first (unless it runs already:
    ``start_snapshot_writer``), then device, threads, seeds and process group, its policies (built
    once: the snapshot manager keeps what they may roll back to, the trainer judges by them), the ZeRO
    stages its engines train at (``trained_stages``: those of the snapshot ``plan`` resumes), its
    snapshot manager (with the rank's collectives and the fence), then the trainer. Rank 0's events
    also reach the reporter (a failed snapshot is said at once) and its rows the trackers; the fence is
    checked before every step."""
    start_snapshot_writer(run, cfg)
    from rlctl.engine.runtime import open_rank  # heavy: torch, DeepSpeed, transformers
    from rlctl.engine.trainer import Trainer

    context = open_rank(cfg)
    stages = _engine_stages(cfg, context.runtime.dtype, plan, reporter if rank == 0 else None)
    guard = PolicyGuard(load_policies(cfg.policies)) if cfg.policies else None
    reach = guard.max_steps_back if guard is not None else 0
    shown = ReportedEvents(events, reporter) if events is not None else None
    snapshots = snapshot_manager(
        run,
        cfg,
        shown,
        rank=rank,
        collectives=context.dist,
        max_steps_back=reach,
        rollback_best=guard.best_metrics if guard is not None else (),
        fence=fence,
        stages=stages,
    )

    def on_step(row: dict[str, Any]) -> None:
        reporter.step(row)
        if trackers is not None:
            trackers.log_row(row)
        if fence is not None:
            fence()  # before the next step writes anything

    on_event = shown.emit if shown is not None else None
    trainer = Trainer(
        cfg,
        RunDir(run),
        context,
        snapshots=snapshots,
        guard=guard,
        on_step=on_step,
        on_event=on_event,
        fence=fence,
        stages=stages,
    )
    return trainer, snapshots


def _engine_stages(cfg: RunConfig, dtype, plan: ResumePlan | None, reporter: Reporter | None) -> ZeroStages:
    """The ZeRO stages the run's engines train at (``trained_stages``), for its ``dtype`` and the snapshot
    ``plan`` resumes; an engine that trains at another stage than its config says is said once (to
    ``reporter``: rank 0's)."""
    import torch

    stages = trained_stages(cfg, dtype == torch.float16, plan.stages if plan is not None and plan.names else None)
    configured = {"actor": cfg.actor.zero_stage, "critic": cfg.critic.zero_stage}
    for section, stage in (("actor", stages.actor), ("critic", stages.critic)):
        if stage is not None and stage != configured[section] and reporter is not None:
            reporter.note(
                f"{section}.zero_stage {configured[section]} trains at ZeRO stage {stage}: a world of one rank "
                "needs no partitioning (its snapshots still resume onto more ranks at the configured stage)"
            )
    return stages


def start_snapshot_writer(run: Storage | str, cfg: RunConfig) -> bool:
    """Start this process's snapshot writer process now, before the rank is set up, when the run's
    snapshots are written there (it snapshots, with checkpoint.writer process, to storage that other
    processes see): it imports torch and DeepSpeed (``WRITER_PRELOAD``) while this process imports its
    own and loads the models, not in the first snapshot's time. ``run``: the run's storage, or its URL
    before any storage is opened (an object store's client starts a thread, and a writer is forked
    only from a process of one thread). Whether it runs; one that cannot start now is tried again at
    the first snapshot, which says what fails."""
    c = cfg.checkpoint
    in_process = _in_memory(c.dir or run) if isinstance(run, str) else snapshot_storage(run, cfg).in_process
    if not c.every or c.writer != "process" or in_process:
        return False
    try:
        snapshot_writer().start(_writer_preload(cfg), WRITER_ENV, fork=_writer_env_still_read())
    except OSError:
        return False
    return True


def _writer_preload(cfg: RunConfig) -> tuple[str, ...]:
    """What the run's writer imports as it starts: DeepSpeed (``WRITER_PRELOAD``) when the state dicts it
    will unpickle name DeepSpeed's classes, those of engines that ZeRO partitions or that scale an fp16
    loss. A fresh world of one trains at stage 0 (``trained_stages``), whose state dicts name only
    torch's: its writer is spared DeepSpeed's import (about 1 s of CPU per writer that cannot be forked
    from this process). A resume of a snapshot of another stage, or a dtype ``auto`` that the device
    turns to fp16, has the writer import DeepSpeed at its first job instead (pickle imports what it
    meets)."""
    fp16 = cfg.model.dtype == "fp16"
    stages = trained_stages(cfg, fp16)
    return WRITER_PRELOAD if fp16 or stages.actor or stages.critic else ()


def _in_memory(url: str) -> bool:
    """Whether ``url`` (chained links too) lies in this process's memory (memory://), read from the URL."""
    return any(part.split("://", 1)[0] == "memory" for part in str(url).split("::") if "://" in part)


def _writer_env_still_read() -> bool:
    """Whether a writer forked from this process would still run DeepSpeed on ``WRITER_ENV``'s
    accelerator: DeepSpeed reads DS_ACCELERATOR once, as it first picks one (``set_accelerator`` in
    rlctl.engine.runtime). Imports no torch: the early start runs before the run's imports."""
    return deepspeed_accelerator() in (None, WRITER_ENV["DS_ACCELERATOR"])


def rest_snapshot_writer() -> None:
    """A run trained here ended (no snapshot is in flight): this process's snapshot writer frees what it
    kept for the run's snapshots and stays for the process's next run (``WriterProcess.rest``)."""
    snapshot_writer().rest()


def _train(trainer, snapshots: SnapshotManager, emit, rank: int | None) -> None:
    """``trainer.train()``, recording how it ended unless the trainer did (a halt) or nothing may be
    written (a lost lease)."""
    try:
        trainer.train()
    except Preempted:
        record = {"event": names.PREEMPTED, "signal": trainer.stop_signal, "snapshot": snapshots.last_committed}
        _record(emit, {**record, "step": trainer.state.step})
        raise
    except (Halted, LeaseError):
        raise  # the trainer logged why; a writer that lost its lease writes nothing more
    except KeyboardInterrupt:
        _record(emit, {"event": names.INTERRUPTED, "step": trainer.state.step})
        raise
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        _record(emit, {"event": names.CRASHED, "step": trainer.state.step, "error": error, **_rank(rank)})
        raise


def _rank(rank: int | None) -> dict[str, int]:
    return {"rank": rank} if rank is not None else {}


def _record(emit, event: dict[str, Any]) -> None:
    """Record how the run ended; a record that cannot be written does not replace the error that ended
    it (the storage may be what failed)."""
    with contextlib.suppress(RlctlError, OSError):  # (a lost lease writes nothing either)
        emit(event)


# -- trackers ------------------------------------------------------------------------------------------
def open_trackers(run: Storage, cfg: RunConfig) -> Trackers:
    """The run's experiment trackers (rank 0), fed from its local run directory."""
    from rlctl.trackers import Trackers

    return Trackers(
        cfg.trainer.loggers,
        run.local_path(),
        run_name=cfg.name,
        config=cfg.model_dump(mode="json"),
        history=lambda: read_rows(run, METRICS, require_step=True),
    )


class TrackedEvents:
    """An event log whose events also reach the trackers."""

    def __init__(self, events, trackers: Trackers):
        self.events, self.trackers = events, trackers

    def emit(self, event: dict[str, Any]) -> None:
        self.events.emit(event)
        self.trackers.log_event(event)


# -- a rank of several ---------------------------------------------------------------------------------
def rank_spec(run: Storage, cfg: RunConfig, plan: ResumePlan | None, lease_owner: str | None = None) -> dict[str, Any]:
    """What every rank of a run needs to know, as plain data (it travels as JSON or by Ray). With
    ``lease_owner`` (the driver's lease), rank 0 commits a snapshot only while that lease is the run's."""
    url = run.url if "://" in run.url else os.path.abspath(run.url)  # ranks may not share our cwd
    return {
        "run_url": url,
        "config": cfg.to_yaml(),
        "plan": plan.as_data() if plan is not None else None,
        "world": cfg.world_size,
        "lease_owner": lease_owner,
        "cwd": os.getcwd(),  # (a Ray rank starts elsewhere)
    }


def rank_main(spec: dict[str, Any], rank: int, local_rank: int, local_world: int, addr: str, port: int) -> dict:
    """Run rank ``rank`` of ``spec`` (from ``rank_spec``) to its end in this process, meeting the others at
    the store server that listens at ``addr``:``port`` (``rlctl.engine.rendezvous.bind_rendezvous``: bound
    by the supervisor or by rank 0's Ray actor); returns {"code", "message", "summary"}. A domain error
    is a result (with its exit code); a bug propagates."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(spec["world"]),
            "LOCAL_WORLD_SIZE": str(local_world),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "RLCTL_RENDEZVOUS": "store",  # (rlctl.engine.rendezvous.RENDEZVOUS, named here without importing torch)
        }
    )
    # DeepSpeed's ZeRO all-gathers call a torch API that warns once per process and rank
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    cfg = validate_config(load_yaml(spec["config"], "the rank's config", SAVED)[0], {})
    run = Storage(spec["run_url"])
    owner = spec.get("lease_owner")
    fence = owner_fence(run, owner) if rank == 0 and owner else None
    events = EventLog(run, fence=fence) if rank == 0 else None
    plan = ResumePlan.from_data(spec["plan"]) if spec["plan"] is not None else None
    try:
        if events is not None and spec.get("placement"):  # (Ray: the driver's launcher knows where)
            events.emit({"event": names.RANKS_PLACED, "ranks": spec["placement"]})
        summary = train_rank(run, cfg, events, SilentReporter(), plan, rank=rank, fence=fence)
        return {"code": 0, "message": None, "summary": summary}
    except RlctlError as exc:
        return {"code": int(exc.exit_code), "message": exc.message, "summary": None}
    finally:
        if events is not None:
            events.close()
