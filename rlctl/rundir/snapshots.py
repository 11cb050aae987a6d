"""A run's snapshots: the checkpoint storage its config names, the topology its files are written for,
its catalog (the read side: listing, choosing, checking) and its snapshot manager with the run's
cadence, retention and failure budget (the write side, for the ranks that train)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlctl.metrics import EventSink
from rlctl.rundir.layout import CHECKPOINTS
from rlctl.storage import Storage

if TYPE_CHECKING:  # (imported where used: `rlctl inspect --check` reads a run without them)
    from rlctl.checkpoint.catalog import Catalog, Topology
    from rlctl.checkpoint.collectives import Collectives
    from rlctl.checkpoint.snapshots import SnapshotManager
    from rlctl.config import RunConfig


def checkpoint_storage(run: Storage, cfg: RunConfig) -> Storage:
    """Where the run's snapshots lie, retried for checkpoint.retry_timeout (a reader's run storage, made
    ``Storage.for_reading``, lends it its own bounds)."""
    c = cfg.checkpoint
    if c.dir is not None:
        return run.beside(c.dir, c.storage_options, c.retry_timeout)
    if c.storage_options:
        return run.beside(run.url_of(CHECKPOINTS), c.storage_options, c.retry_timeout)
    return run.child(CHECKPOINTS)


def zero_topology(stage: int | None) -> Topology:
    """The layout DeepSpeed's snapshot files have: the ZeRO stage they were partitioned for."""
    from rlctl.checkpoint.catalog import Topology

    return Topology(
        "zero_stage",
        stage,
        "written with ZeRO stage {recorded}; this run uses stage {value} (the stage cannot change on resume)",
    )


def elastic_world(cfg: RunConfig) -> tuple[bool, str]:
    """Whether the run resumes from snapshots of another world size (DeepSpeed's universal checkpoint
    converts the engines' files of ZeRO 0 to 3 as they load, ``rlctl.engine.universal``), and when not,
    why not: with rollout.mode one_step_off or async a snapshot holds each rank's share of the batches
    generated ahead, which another number of ranks would split otherwise."""
    if cfg.rollout.mode != "sync":
        return False, (
            f"a resume onto another number of ranks needs rollout.mode sync; this run's is {cfg.rollout.mode}, whose "
            "snapshots hold each rank's share of the batches generated ahead"
        )
    return True, ""


def snapshot_catalog(run: Storage, cfg: RunConfig, events: EventSink | None = None) -> Catalog:
    """The run's snapshots as they lie on its checkpoint storage, for listing, choosing and checking:
    usable when written for the run's ZeRO stage (and world size, unless ``elastic_world``), "best" by
    checkpoint.keep_best.
    ``events`` hear of what ``remove_uncommitted`` quarantines (the run's writer alone tidies)."""
    from rlctl.checkpoint.catalog import BestRule, Catalog

    best = cfg.checkpoint.keep_best
    elastic, fixed_world = elastic_world(cfg)
    return Catalog(
        checkpoint_storage(run, cfg),
        world_size=cfg.world_size,
        topology=[zero_topology(cfg.actor.zero_stage)],
        keep_best=BestRule(best.metric, best.mode) if best is not None else None,
        on_event=events.emit if events is not None else None,
        elastic=elastic,
        fixed_world=fixed_world,
    )


def snapshot_manager(
    run: Storage,
    cfg: RunConfig,
    events: EventSink | None = None,
    rank: int = 0,
    *,
    collectives: Collectives | None = None,
    max_steps_back: int = 0,
    rollback_best: Sequence[tuple[str, str]] = (),
    fence=None,
) -> SnapshotManager:
    """The run's snapshot manager: on its checkpoint storage, with the run's cadence, retention (and
    keep_best: what "best" means), topology and failure budget. A rank passes its collectives, how far
    its policies may roll back (retention keeps a snapshot that far back), the (metric, mode) of each
    policy that rolls back to the best snapshot (retention keeps that one) and its fence (called before
    any commit: the lease's check)."""
    from rlctl.checkpoint.retention import KeepBest, Retention
    from rlctl.checkpoint.snapshots import SnapshotManager

    c = cfg.checkpoint
    best = KeepBest(c.keep_best.metric, c.keep_best.mode, c.keep_best.k) if c.keep_best is not None else None
    elastic, fixed_world = elastic_world(cfg)
    return SnapshotManager(
        checkpoint_storage(run, cfg),
        world_size=cfg.world_size,
        rank=rank,
        collectives=collectives,
        topology=[zero_topology(cfg.actor.zero_stage)],
        every=c.every,
        max_steps_back=max_steps_back,
        retention=Retention(
            keep_last=c.keep_last,
            keep_every=c.keep_every,
            best=best,
            rollback_best=tuple(KeepBest(metric, mode, 1) for metric, mode in rollback_best),
        ),
        on_event=events.emit if events is not None else None,
        staging_dir=c.staging_dir,
        asynchronous=c.asynchronous,
        max_failures=c.max_failures,
        fence=fence,
        writer=c.writer,
        elastic=elastic,
        fixed_world=fixed_world,
    )
