"""Creating and loading a run directory, finding its snapshots, and summarising what it holds."""

from __future__ import annotations

from typing import Any

import yaml

from rlctl.checkpoint.collectives import Collectives
from rlctl.checkpoint.snapshots import Retention, SnapshotManager, Topology
from rlctl.config import RunConfig, validate_config
from rlctl.errors import ConfigError
from rlctl.metrics import EventLog, read_rows
from rlctl.rundir.layout import CHECKPOINTS, CONFIG, METRICS
from rlctl.storage import Storage


def create_run_dir(url: str, cfg: RunConfig) -> Storage:
    run = Storage(url)
    if run.exists(CONFIG) or run.exists(METRICS):
        raise ConfigError(f"--run-dir {url} already holds a run; choose a new directory (or rlctl resume it)")
    run.makedirs()
    run.write_bytes(CONFIG, cfg.to_yaml().encode())
    return run


def load_run_config(run: Storage) -> RunConfig:
    try:
        raw = run.read_bytes(CONFIG)
    except FileNotFoundError:
        raise ConfigError(f"{run.url} is not an rlctl run directory (it has no {CONFIG})") from None
    return validate_config(yaml.safe_load(raw) or {}, {})


def checkpoint_storage(run: Storage, cfg: RunConfig) -> Storage:
    c = cfg.checkpoint
    if c.dir is not None:
        return Storage(c.dir, c.storage_options)
    return Storage(run.url_of(CHECKPOINTS), c.storage_options) if c.storage_options else run.child(CHECKPOINTS)


def zero_topology(stage: int | None) -> Topology:
    """The layout DeepSpeed's snapshot files have: the ZeRO stage they were partitioned for."""
    return Topology("zero_stage", stage, "written with ZeRO stage {recorded}; this run uses stage {value}")


def snapshot_manager(
    run: Storage,
    cfg: RunConfig,
    events: EventLog | None = None,
    rank: int = 0,
    *,
    collectives: Collectives | None = None,
    max_steps_back: int = 0,
) -> SnapshotManager:
    """The run's snapshot manager: on its checkpoint storage, with the run's cadence, retention and
    topology. A rank passes its collectives and how far its policies may roll back (retention keeps a
    snapshot that far back); the driver, which only scans, passes neither."""
    c = cfg.checkpoint
    return SnapshotManager(
        checkpoint_storage(run, cfg),
        world_size=cfg.world_size,
        rank=rank,
        collectives=collectives,
        topology=[zero_topology(cfg.actor.zero_stage)],
        every=c.every,
        max_steps_back=max_steps_back,
        retention=Retention(keep_last=c.keep_last, keep_every=c.keep_every),
        on_event=events.emit if events is not None else None,
        staging_dir=c.staging_dir,
        asynchronous=c.asynchronous,
    )


def run_summary(run: Storage, window: int = 10) -> dict[str, Any]:
    rows = read_rows(run, METRICS)
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    first, last = scores[:window], scores[-window:]
    return {
        "run_dir": run.url,
        "steps": rows[-1]["step"] if rows else 0,
        "reward_start": sum(first) / len(first) if first else float("nan"),
        "reward_end": sum(last) / len(last) if last else float("nan"),
        "window": window,
        "seconds": sum(r.get("timing_s/step", 0.0) for r in rows),
    }
