"""Creating and loading a run directory, finding its snapshots, and summarising what it holds.

Every file read back here may be malformed: a ``config.yaml`` that is not YAML or not a valid config
is a ConfigError naming the file; unreadable metric rows are skipped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import yaml

from rlctl.errors import ConfigError, RlctlError
from rlctl.metrics import EventSink, read_rows
from rlctl.rundir.layout import CHECKPOINTS, CONFIG, EVENTS, METRICS, MODEL
from rlctl.storage import Storage

if TYPE_CHECKING:  # (imported where used: `rlctl inspect --check` reads a run without them)
    from rlctl.checkpoint.collectives import Collectives
    from rlctl.checkpoint.snapshots import SnapshotManager, Topology
    from rlctl.config import RunConfig


def run_storage(url: str, cfg: RunConfig | None = None) -> Storage:
    """The run directory's storage, with the run's retry budget for transient failures once its config
    is known (``checkpoint.retry_timeout``)."""
    if cfg is None:
        return Storage(url)
    return Storage(url, retry_timeout=cfg.checkpoint.retry_timeout)


# -- a new run, or a start that never trained -----------------------------------------------------------
def refuse_used_run_dir(run: Storage) -> bool:
    """Whether ``run`` holds an earlier start of a run that never trained (it may be started again:
    True), or nothing (False). A directory holding a run that trained a step, or has a committed
    snapshot, is a ConfigError: it is resumed, never started over."""
    if not (run.exists(CONFIG) or run.exists(METRICS)):
        return False
    used = f"--run-dir {run.url} already holds a run"
    hint = f"choose a new directory (or rlctl resume {run.url})"
    trained = last_step(run)
    if trained:
        raise ConfigError(f"{used} that trained {trained} step(s); {hint}")
    if run.exists(METRICS) and run.read_bytes(METRICS).strip():
        raise ConfigError(f"{used}: its {METRICS} holds lines that are not metric rows; {hint}")
    if not run.exists(CONFIG):
        return True
    try:
        old = load_run_config(run)
    except ConfigError as exc:
        raise ConfigError(f"{used} whose config cannot be read ({exc.message}); {hint}") from None
    committed = [i.name for i in snapshot_manager(run, old).scan() if i.committed or i.unreadable]
    if committed:  # (a manifest that cannot be read may be a damaged commit: never started over either)
        raise ConfigError(f"{used} with a committed snapshot ({committed[-1]}); {hint}")
    return True


def claim_run_dir(run: Storage, cfg: RunConfig) -> bool:
    """Under the run's lease: check the directory again (``refuse_used_run_dir``), write ``cfg`` as its
    config, and, when an earlier start that never trained is reused, drop the built-in model it built
    from other settings (rlctl's own product, rebuilt from the new config). Whether it was reused."""
    reused = refuse_used_run_dir(run)
    if reused and run.exists(CONFIG) and run.exists(MODEL):
        old = load_run_config(run)
        if old.model.path is None and (old.model.builtin, old.seed) != (cfg.model.builtin, cfg.seed):
            run.rm(MODEL, recursive=True)
    run.write_bytes(CONFIG, cfg.to_yaml().encode())
    return reused


# -- reading a run back --------------------------------------------------------------------------------
def read_config_data(run: Storage) -> dict[str, Any]:
    """The parsed ``config.yaml`` of a run (a mapping), or a ConfigError naming the file: missing, not
    YAML (or not UTF-8), not a mapping."""
    where = run.url_of(CONFIG)
    try:
        raw = run.read_bytes(CONFIG)
    except FileNotFoundError:
        raise ConfigError(f"{run.url} is not an rlctl run directory (it has no {CONFIG})") from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a directory, not a run's config") from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        cause = getattr(exc, "problem", None) or getattr(exc, "reason", None) or type(exc).__name__
        raise ConfigError(f"{where} is not valid YAML{line}: {cause}; was it edited by hand?") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} holds a {type(data).__name__}, not a config mapping; was it edited by hand?")
    return data


def load_run_config(run: Storage) -> RunConfig:
    """The run's validated config; a ConfigError naming ``config.yaml`` when it is malformed."""
    return validate_run_config(run, read_config_data(run))


def validate_run_config(run: Storage, data: dict[str, Any]) -> RunConfig:
    """``data`` (read from the run's config.yaml) as a RunConfig; a ConfigError naming the file."""
    from rlctl.config import validate_config

    try:
        return validate_config(data, {})
    except RlctlError as exc:
        raise ConfigError(f"{run.url_of(CONFIG)}: {exc.message}") from None


def last_step(run: Storage) -> int:
    """The highest step the run's metrics record (0: it never trained a step)."""
    return max((r["step"] for r in read_rows(run, METRICS, require_step=True)), default=0)


def checkpoint_storage(run: Storage, cfg: RunConfig) -> Storage:
    c = cfg.checkpoint
    if c.dir is not None:
        return Storage(c.dir, c.storage_options, retry_timeout=c.retry_timeout)
    if c.storage_options:
        return Storage(run.url_of(CHECKPOINTS), c.storage_options, retry_timeout=c.retry_timeout)
    return run.child(CHECKPOINTS)


def zero_topology(stage: int | None) -> Topology:
    """The layout DeepSpeed's snapshot files have: the ZeRO stage they were partitioned for."""
    from rlctl.checkpoint.snapshots import Topology

    return Topology("zero_stage", stage, "written with ZeRO stage {recorded}; this run uses stage {value}")


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
    any commit: the lease's check); the driver, which only scans, passes none of them."""
    from rlctl.checkpoint.snapshots import KeepBest, Retention, SnapshotManager

    c = cfg.checkpoint
    best = KeepBest(c.keep_best.metric, c.keep_best.mode, c.keep_best.k) if c.keep_best is not None else None
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
    )


def run_summary(run: Storage, cfg: RunConfig | None = None, window: int = 10) -> dict[str, Any]:
    """What a person wants to know when a run ends: steps and time, the reward (mean of the first and the
    last ``window`` steps) and the validation score (first and last) from start to end, snapshots
    committed, each rollback (step, rule, where it went back to), the best snapshot (with ``cfg``), and
    the trackers the run feeds."""
    rows = read_rows(run, METRICS, require_step=True)
    events = read_rows(run, EVENTS)
    scores = [r["critic/score/mean"] for r in rows if _number(r.get("critic/score/mean"))]
    val = [r["val/score/mean"] for r in rows if _number(r.get("val/score/mean"))]
    first, last = scores[:window], scores[-window:]
    return {
        "run_dir": run.url,
        "steps": rows[-1]["step"] if rows else 0,
        "reward_start": sum(first) / len(first) if first else float("nan"),
        "reward_end": sum(last) / len(last) if last else float("nan"),
        "val_start": val[0] if val else None,
        "val_end": val[-1] if val else None,
        "window": window,
        "seconds": sum(r["timing_s/step"] for r in rows if _number(r.get("timing_s/step"))),
        "snapshots": sum(e.get("event") == "snapshot_committed" for e in events),
        "rollbacks": [
            {"rule": e.get("rule"), "from_step": e.get("from_step"), "to_step": e.get("to_step")}
            for e in events
            if e.get("event") == "rollback"
        ],
        "best": _best_snapshot(run, cfg) if cfg is not None else None,
        "loggers": list(cfg.trainer.loggers) if cfg is not None else [],
    }


def _best_snapshot(run: Storage, cfg: RunConfig) -> dict[str, Any] | None:
    """{"step", "metric", "value"} of the run's best snapshot by its validation metric, or None."""
    manager = snapshot_manager(run, cfg)
    rule = manager.best_rule
    try:
        best = manager.best(rule.metric, rule.mode)
    except RlctlError:  # the storage is failing: the summary does without
        return None
    return {"step": best[0].step, "metric": rule.metric, "value": best[0].val_metric(rule.metric)} if best else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
