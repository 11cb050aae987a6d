"""A run's snapshots: the checkpoint storage its config names, the topology its files are written for,
its catalog (the read side: listing, choosing, checking) and its snapshot manager with the run's
cadence, retention and failure budget (the write side, for the ranks that train)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlctl.metrics import EventSink
from rlctl.rundir.layout import CHECKPOINTS
from rlctl.storage import Storage

if TYPE_CHECKING:  # (imported where used: `rlctl inspect --check` reads a run without them)
    from rlctl.checkpoint.catalog import Catalog, Topology
    from rlctl.checkpoint.collectives import Collectives
    from rlctl.checkpoint.snapshots import SnapshotManager
    from rlctl.config import RunConfig


def snapshot_storage(run: Storage, cfg: RunConfig) -> Storage:
    """Where the run's snapshots lie, retried for checkpoint.retry_timeout (a reader's run storage, made
    ``Storage.for_reading``, lends it its own bounds)."""
    c = cfg.checkpoint
    if c.dir is not None:
        return run.beside(c.dir, c.storage_options, c.retry_timeout)
    if c.storage_options:
        return run.beside(run.url_of(CHECKPOINTS), c.storage_options, c.retry_timeout)
    return run.child(CHECKPOINTS)


# the manifest keys of the ZeRO stage each engine's files are laid out for (the critic's: PPO runs only)
ACTOR_STAGE, CRITIC_STAGE = "zero_stage", "critic_zero_stage"


@dataclass(frozen=True)
class ZeroStages:
    """The ZeRO stage each engine of a run trains at (``trained_stage``): the actor's, the critic's (None
    without one)."""

    actor: int
    critic: int | None = None


def trained_stage(configured: int, world: int, fp16: bool, recorded: int | None) -> int:
    """The ZeRO stage an engine configured for stage ``configured`` trains at in a world of ``world`` ranks:
    a world of one needs none of ZeRO-1/2's partitioning bookkeeping, so it trains at stage 0 when it
    starts fresh (``recorded`` None) or resumes a snapshot that recorded stage 0; one that resumes a
    snapshot of its configured stage (a run begun before this rule) keeps it. fp16 is never stage 0 (its
    wrapper lacks the loss-scale hysteresis), ZeRO-3 and more ranks keep the configured stage."""
    if world > 1 or fp16 or configured not in (1, 2):
        return configured
    return 0 if recorded in (None, 0) else configured


def trained_stages(cfg: RunConfig, fp16: bool, recorded: dict[str, Any] | None = None) -> ZeroStages:
    """The stages the run's engines train at (``trained_stage``), ``fp16``: whether they train in fp16 (the
    dtype ``auto`` resolved to); ``recorded``: the manifest facts of the snapshot resumed (None: a fresh
    start). A manifest without the critic's stage was written at the configured one."""
    recorded = recorded or {}
    fresh = not recorded
    actor = trained_stage(cfg.actor.zero_stage, cfg.world_size, fp16, None if fresh else recorded.get(ACTOR_STAGE))
    if cfg.algorithm.name != "ppo":
        return ZeroStages(actor)
    was = None if fresh else recorded.get(CRITIC_STAGE, cfg.critic.zero_stage)
    return ZeroStages(actor, trained_stage(cfg.critic.zero_stage, cfg.world_size, fp16, was))


def zero_topology(stage: int, key: str = ACTOR_STAGE, absent: int | None = None) -> Topology:
    """The layout DeepSpeed's snapshot files have: the ZeRO stage they were partitioned for. An engine of
    stage 1 or 2 also loads a stage-0 snapshot (``rlctl.engine.stage0``); no other stage changes."""
    from rlctl.checkpoint.catalog import Topology

    engine = "" if key == ACTOR_STAGE else "the critic's files "
    return Topology(
        key,
        stage,
        engine + "written with ZeRO stage {recorded}; this run uses stage {value} (the stage cannot change on resume)",
        also=(0,) if stage in (1, 2) else (),
        absent=absent,
    )


def zero_topologies(cfg: RunConfig, stages: ZeroStages | None = None) -> list[Topology]:
    """What a run's snapshots must record of its engines' ZeRO stages to be usable: ``stages`` (those its
    engines train at: what its snapshot manager records), else the configured ones (the read side, before
    any engine: a resume, an export, a listing)."""
    actor = stages.actor if stages is not None else cfg.actor.zero_stage
    facts = [zero_topology(actor)]
    if cfg.algorithm.name == "ppo":
        critic = stages.critic if stages is not None and stages.critic is not None else cfg.critic.zero_stage
        facts.append(zero_topology(critic, CRITIC_STAGE, absent=cfg.critic.zero_stage))
    return facts


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
        snapshot_storage(run, cfg),
        world_size=cfg.world_size,
        topology=zero_topologies(cfg),
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
    stages: ZeroStages | None = None,
) -> SnapshotManager:
    """The run's snapshot manager: on its checkpoint storage, with the run's cadence, retention (and
    keep_best: what "best" means), topology and failure budget. A rank passes its collectives, how far
    its policies may roll back (retention keeps a snapshot that far back), the (metric, mode) of each
    policy that rolls back to the best snapshot (retention keeps that one) and its fence (called before
    any commit: the lease's check) and the ZeRO stages its engines train at (``trained_stages``; None: a
    fresh start's), which its manifests record."""
    from rlctl.checkpoint.retention import KeepBest, Retention
    from rlctl.checkpoint.snapshots import SnapshotManager

    c = cfg.checkpoint
    best = KeepBest(c.keep_best.metric, c.keep_best.mode, c.keep_best.k) if c.keep_best is not None else None
    elastic, fixed_world = elastic_world(cfg)
    return SnapshotManager(
        snapshot_storage(run, cfg),
        world_size=cfg.world_size,
        rank=rank,
        collectives=collectives,
        topology=zero_topologies(cfg, stages or trained_stages(cfg, cfg.model.dtype == "fp16")),
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
