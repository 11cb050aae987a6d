"""A run: its directory on any fsspec storage, and starting or resuming it under a lease.

RUN_DIR/
  config.yaml              the resolved config (every key; updated by `resume --set`, changes in events)
  model/                   the built-in model and tokenizer (when model.path is empty)
  metrics.jsonl            one orjson row per step, each step exactly once
  metrics.abandoned.jsonl  rows of steps a resume turned away from, tagged with the resume
  events.jsonl             start, resume, snapshot commits and failures, preemption, completion
  lease.json               the live writer (host, pid, heartbeat); absent when nobody writes
  checkpoints/             snapshots (unless checkpoint.dir is set)
"""

from __future__ import annotations

import signal
import time
from typing import Any, Protocol

import yaml

from rlctl.rundir.lease import Lease
from rlctl.checkpoint.snapshots import Retention, SnapshotInfo, SnapshotManager, parse_step_spec
from rlctl.storage import Storage
from rlctl.config import RunConfig, parse_set, validate_config
from rlctl.errors import ConfigError, ExitCode, Halted, Preempted, RankFailed, SnapshotError
from rlctl.rundir.layout import CHECKPOINTS, CONFIG, EVENTS, METRICS
from rlctl.metrics import EventLog, parse_rows, read_rows
from rlctl.rundir.history import abandon_rows_after


# What `rlctl resume --set` may change: knobs of the optimisation, not the identity of the run.
SAFE_ON_RESUME = frozenset({
    "trainer.total_steps", "trainer.num_threads", "trainer.lease_timeout", "trainer.lease_heartbeat",
    "actor.lr", "actor.grad_clip", "algorithm.kl_coef", "algorithm.clip_ratio", "rollout.temperature",
    "rollout.max_new_tokens", "checkpoint.every", "checkpoint.keep_last", "checkpoint.keep_every",
    "checkpoint.asynchronous", "checkpoint.staging_dir", "cluster.address",
})  # fmt: skip


class Reporter(Protocol):
    def ready(self, step: int, total: int) -> None: ...

    def step(self, row: dict[str, Any]) -> None: ...

    def note(self, text: str) -> None: ...


class _Silent:
    def ready(self, step: int, total: int) -> None: ...

    def step(self, row: dict[str, Any]) -> None: ...

    def note(self, text: str) -> None: ...


# -- the run directory -----------------------------------------------------------------------------
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


def snapshot_manager(run: Storage, cfg: RunConfig, events: EventLog | None = None, rank: int = 0) -> SnapshotManager:
    c = cfg.checkpoint
    return SnapshotManager(
        checkpoint_storage(run, cfg),
        world_size=cfg.world_size,
        rank=rank,
        zero_stage=cfg.actor.zero_stage,
        retention=Retention(keep_last=c.keep_last, keep_every=c.keep_every),
        on_event=events.emit if events is not None else None,
        staging_dir=c.staging_dir,
        asynchronous=c.asynchronous,
    )


def apply_resume_overrides(cfg: RunConfig, overrides: list[str]) -> tuple[RunConfig, dict[str, Any]]:
    data = cfg.model_dump(mode="json")
    changes: dict[str, Any] = {}
    origins = {}
    for item in overrides:
        key, value = parse_set(item)
        dotted = ".".join(key)
        if dotted not in SAFE_ON_RESUME:
            raise ConfigError(
                f"'{dotted}' cannot change on resume: the run would no longer continue the same training. "
                f"Keys that can: {', '.join(sorted(SAFE_ON_RESUME))}"
            )
        node = data
        for part in key[:-1]:
            node = node[part]
        changes[dotted] = {"from": node.get(key[-1]), "to": value}
        node[key[-1]] = value
        origins[key] = f"--set {item}"
    new = validate_config(data, origins)
    for dotted, change in changes.items():  # record typed values
        section, name = dotted.split(".")
        change["to"] = getattr(getattr(new, section), name)
    return new, changes


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


# -- start and resume ------------------------------------------------------------------------------
def start_run(cfg: RunConfig, url: str, *, reporter: Reporter | None = None) -> dict[str, Any]:
    run = create_run_dir(url, cfg)
    events = EventLog(run)
    try:
        with Lease(run, cfg.trainer.lease_timeout, cfg.trainer.lease_heartbeat).acquire():
            events.emit({"event": "start", "total_steps": cfg.trainer.total_steps})
            snapshots = snapshot_manager(run, cfg, events)
            snapshots.remove_uncommitted()
            return _train(run, cfg, events, snapshots, reporter or _Silent(), restore=None)
    finally:
        events.close()


def resume_run(
    url: str, spec: str = "latest", overrides: list[str] = (), *, force: bool = False,
    reporter: Reporter | None = None,
) -> dict[str, Any]:  # fmt: skip
    run = Storage(url)
    cfg, changes = apply_resume_overrides(load_run_config(run), list(overrides))
    wanted = parse_step_spec(spec)
    reporter = reporter or _Silent()
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
            usable = [c for c in candidates if c.usable]
            for bad in (c for c in candidates if not c.usable):
                reporter.note(f"warning: skipping snapshot {bad.name}: {bad.problem}")
            return _train(run, cfg, events, snapshots, reporter, restore=(usable, wanted, changes))
    finally:
        events.close()


def _completed(run: Storage, cfg: RunConfig) -> bool:
    return any(e.get("event") == "completed" and e.get("step", 0) >= cfg.trainer.total_steps
               for e in read_rows(run, EVENTS))  # fmt: skip


def _restore(trainer, snapshots: SnapshotManager, usable: list[SnapshotInfo], reporter: Reporter) -> SnapshotInfo | None:
    for info in usable:
        try:
            trainer.restore(info)
            return info
        except SnapshotError as exc:
            if len(usable) == 1:
                raise
            reporter.note(f"warning: {exc.message}; trying an older snapshot")
    if usable:
        raise SnapshotError(f"no usable snapshot in {snapshots.storage.url}: every candidate failed its checks")
    return None


def _train(run, cfg, events, snapshots, reporter, restore) -> dict[str, Any]:
    """Train here (one rank), or launch the ranks and follow them (several: local processes or Ray
    actors; rank 0 then writes the events and metrics while this process keeps the lease)."""
    if cfg.world_size == 1:
        return train_rank(run, cfg, events, snapshots, reporter, restore)
    from rlctl.launch import launch_ranks

    if restore is not None:
        usable, wanted, changes = restore
        restore = {"names": [i.name for i in usable], "wanted": wanted, "changes": changes}
    offset = events.tell()
    events.close()  # rank 0 appends to it now: one writer at a time
    try:
        return launch_ranks(run, cfg, restore, reporter)
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


def train_rank(run, cfg, events, snapshots, reporter, restore, rank: int = 0) -> dict[str, Any]:
    """Run the training loop in this process, as rank ``rank`` (rank 0 alone writes the run's files)."""
    import threading

    from rlctl.engine.trainer import Trainer  # heavy: torch, DeepSpeed, transformers

    main = rank == 0
    trainer = Trainer(cfg, run, snapshots=snapshots, on_step=reporter.step, on_event=events.emit if main else None)
    if restore is not None:
        usable, wanted, changes = restore
        info = _restore(trainer, snapshots, usable, reporter)
        step = info.step if info else 0
        if info is None:
            reporter.note("warning: no snapshot to resume from; starting again from step 0")
        tag = {"event": "resume", "from_step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if "algorithm.kl_coef" in changes:  # also for an adaptive controller: the user said so
            trainer.kl_ctrl.value = cfg.algorithm.kl_coef
            trainer.apply_knobs()
        trainer.dist.barrier()  # every rank has restored before rank 0 moves later snapshots away
        if main:
            run.write_bytes(CONFIG, cfg.to_yaml().encode())  # only once the restore has succeeded
            moved = abandon_rows_after(run, step, tag)
            later = snapshots.abandon_after(step, tag["time"].replace(":", ""))
            events.emit({
            "event": "resume", "from": wanted, "step": step, "snapshot": info.name if info else None,
            "location": snapshots.storage.url_of(info.name) if info else None, "changes": changes,
                "abandoned_metric_rows": moved, "abandoned_snapshots": later,
            })  # fmt: skip
        trainer.dist.barrier()
    reporter.ready(trainer.state.step, cfg.trainer.total_steps)
    emit = events.emit if main else (lambda event: None)

    def on_signal(signum, _frame):
        trainer.request_stop(signal.Signals(signum).name)

    # (a rank inside a threaded Ray actor is not on the main thread: its driver forwards stops instead)
    on_main_thread = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGTERM, signal.SIGUSR1) if on_main_thread else ()
    previous = {s: signal.signal(s, on_signal) for s in signals}
    _RUNNING[0] = trainer
    if _PENDING_STOP[0] is not None:  # stopped while loading: snapshot where we are and stop
        trainer.request_stop(_PENDING_STOP[0])
        _PENDING_STOP[0] = None
    try:
        trainer.train()
    except Preempted as exc:
        emit({"event": "preempted", "step": trainer.state.step, "signal": trainer.stop_signal,
              "snapshot": snapshots.last_committed})  # fmt: skip
        raise exc
    except Halted:
        raise  # the trainer logged why
    except BaseException as exc:
        emit({"event": "crashed", "step": trainer.state.step, "error": f"{type(exc).__name__}: {exc}",
              **({"rank": rank} if cfg.world_size > 1 else {})})  # fmt: skip
        raise
    finally:
        _RUNNING[0] = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        snapshots.close()
    sha = trainer.actor.weights_sha256()  # (a collective under ZeRO-3: every rank computes it)
    emit({"event": "completed", "step": trainer.state.step, "weights_sha256": sha})
    return run_summary(run) if main else {}


_RUNNING: list = [None]  # the trainer of this process, for a stop request that is not a signal (Ray)
_PENDING_STOP: list = [None]  # a stop that came before the trainer was ready


def request_stop(reason: str) -> None:
    if _RUNNING[0] is not None:
        _RUNNING[0].request_stop(reason)
    else:
        _PENDING_STOP[0] = reason
