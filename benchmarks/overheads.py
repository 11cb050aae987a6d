"""What the safety machinery costs, against a real step and a real save or load measured in the same run.

    .venv/bin/python benchmarks/overheads.py [--steps 40] [--snapshots 15] [--restarts 5] [--rollbacks 8]
                                             [--only-buffer]

Everything runs the tiny built-in workload (the built-in config with 8 prompts x 4 samples x 16 new
tokens) through the real Trainer, with real snapshot managers on local disk (a temp dir).

1. Steady-state step time; on its rows, the rollback-policy checks (policies/default.yaml, every
   rule) and one metrics row written to metrics.jsonl (orjson, flushed), each as a fraction of the step
   (target for checks + logging: under 1%).
2. Snapshots of the whole run state (ZeRO-2 engine, optimizer, RNG, data cursor ...), for both
   writers side by side (``checkpoint.writer=thread``: a thread of the training process;
   ``process``: the rank's writer process), one trainer each, built one after the other in this
   process; after a warm-up snapshot each (printed: the process writer starts and moves the state into
   shared memory then), rounds alternate between the writers, and within a round:
   - asynchronous: the stall is the time ``snapshot()`` blocks, plus how much longer the step after it
     takes than the control step taken just before (medians): that step waits at the optimizer-step
     fence for the state still being read, and shares the CPU with the writer. The commit is awaited
     after that step;
   - synchronous: the training thread calls ``snapshot()`` and then waits for the commit.
   Each writer's stall is printed as a fraction of its own synchronous save (target <= 5%), beside
   what part of any stall DeepSpeed's own state capture is (its ``save_checkpoint`` with every file
   deferred, nothing written: the training thread must take the state, whoever writes it).
3. Restart: ``rlctl start`` and ``rlctl resume`` as real subprocesses of the CLI. A fresh start of 3
   steps (its last one snapshotted) is timed from launch to its step-1 metrics row, then ``rlctl resume
   RUN --set trainer.total_steps=4`` from launch to its step-4 row; the time is the row's own
   ``timestamp`` (taken when the step ends) minus the launch time. Medians of --restarts pairs, and
   their ratio.
4. In-process rollback: a trainer with ``checkpoint.every=2`` and a policy that rolls back when
   ``actor/ppo_kl > 1.0`` runs ``train()`` while the ``metric`` fault drill reports ppo_kl = 5.0 at steps
   5, 9, 13 ... (each fires once, then rolls back to the snapshot 1 step earlier). The time from the
   policy's firing (its ``policy`` event) to the start of the next step (waiting for a snapshot in
   flight, the restore, re-syncing the rollout weights, moving later rows and snapshots aside) is
   printed against the pure load of that same snapshot: ``SnapshotManager.restore`` on the trainer's
   Statefuls and engine (checksums verified, state loaded), as the rollback calls it; the engines'
   ``load_from_dir`` alone is printed too, and how long the rollback waited for the commit of the
   snapshot it rolls back to (its ``snapshot_committed`` event after the firing). Medians; target <= 1.5x.
5. rollout.mode one_step_off: the bytes of the batch made ahead in a snapshot (its state, serialised as
   the snapshot serialises it) and the time to take and serialise it once made, against the whole
   snapshot's bytes and a synchronous save (``--only-buffer``: this section alone).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from rlctl.config import load_config
from rlctl.engine.runtime import open_rank
from rlctl.engine.trainer import Trainer
from rlctl.metrics import JsonlLog
from rlctl.policies import load_policies
from rlctl.policies.guard import PolicyGuard
from rlctl.rundir.handle import RunDir
from rlctl.rundir.snapshots import snapshot_manager
from rlctl.storage import Storage

TINY = ["trainer.prompts_per_step=8", "algorithm.group_size=4", "rollout.max_new_tokens=16"]
WRITERS = ("thread", "process")
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
KL_ROLLBACK = 'policies=[{rules: [{name: kl-spike, when: "actor/ppo_kl > 1.0", actions: [{type: rollback}]}]}]'


def median(xs) -> float:
    return statistics.median(xs)


class Events:
    """The events a trainer and its snapshot manager emit, each with the perf_counter it came at."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, dict[str, Any]]] = []

    def emit(self, event: dict[str, Any]) -> None:
        self.seen.append((time.perf_counter(), event))

    def of(self, kind: str) -> list[tuple[float, dict[str, Any]]]:
        return [(t, e) for t, e in self.seen if e["event"] == kind]


def build(root: str, overrides: list[str], events: Events, workload: list[str] = TINY) -> Trainer:
    """A trainer of the workload (the tiny one by default) on run directory ``root``, with its snapshot
    manager built as a rank builds it (how far its policies may roll back), both emitting to ``events``."""
    cfg = load_config(None, [*workload, *overrides])
    run = Storage(root)
    rank = open_rank(cfg)
    guard = PolicyGuard(load_policies(cfg.policies)) if cfg.policies else None
    reach = guard.max_steps_back if guard is not None else 0
    snapshots = snapshot_manager(run, cfg, events, collectives=rank.dist, max_steps_back=reach)
    return Trainer(cfg, RunDir(run), rank, snapshots=snapshots, guard=guard, on_event=events.emit)


def steady_steps(trainer: Trainer, steps: int) -> tuple[list[dict[str, Any]], float]:
    """The rows of ``steps`` steps and the median step time after 5 warm-up steps."""
    trainer.metrics = trainer._metrics_log()  # as train() opens it: a snapshot records its offset
    rows, times = [], []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        rows.append(trainer.train_step(step))
        times.append(time.perf_counter() - t0)
    return rows, median(times[5:])


def checks_and_logging(rows: list[dict[str, Any]], root: str, reps: int = 50) -> tuple[float, float, int]:
    """Seconds per row of the default policies' checks and of writing the row to a metrics log."""
    policies = load_policies(["policies/default.yaml"])
    guard = PolicyGuard(policies)
    t0 = time.perf_counter()
    for rep in range(reps):
        for i, row in enumerate(rows):
            guard.check(rep * len(rows) + i + 1, {**row, "step": rep * len(rows) + i + 1})
    check_s = (time.perf_counter() - t0) / (reps * len(rows))
    log = JsonlLog(Storage(root), "bench-metrics.jsonl")
    t0 = time.perf_counter()
    for _rep in range(reps):
        for row in rows:
            log.write(row)
    log_s = (time.perf_counter() - t0) / (reps * len(rows))
    log.close()
    return check_s, log_s, len(policies)


def timed_sync_snapshot(trainer: Trainer) -> float:
    t0 = time.perf_counter()
    trainer.snapshot(good=True)
    assert trainer.snapshots.wait(), "the synchronous snapshot did not commit"
    return time.perf_counter() - t0


def snapshot_round(trainer: Trainer, step: int, out: dict[str, list[float]]) -> int:
    """One alternating round: a control step, an asynchronous snapshot, the step after it (whose excess
    over the control step is the rest of the stall), the commit awaited, one more step, a synchronous
    snapshot. The last step taken."""
    step += 1
    t0 = time.perf_counter()
    trainer.train_step(step)
    out["control"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    trainer.snapshot(good=True)
    out["blocked"].append(time.perf_counter() - t0)
    step += 1
    t0 = time.perf_counter()
    trainer.train_step(step)
    out["after"].append(time.perf_counter() - t0)
    assert trainer.snapshots.wait(), "the asynchronous snapshot did not commit"
    step += 1
    trainer.train_step(step)
    out["sync"].append(timed_sync_snapshot(trainer))
    return step


def snapshot_bytes(trainer: Trainer) -> int:
    newest = trainer.snapshots.catalog.scan()[-1]
    return sum(f.stat().st_size for f in Path(trainer.run.path(), "checkpoints", newest.name).rglob("*") if f.is_file())


def measure_writers(args, root: str) -> tuple[list[dict[str, Any]], float, dict[str, dict[str, Any]]]:
    """Both writers' trainers (``checkpoint.writer`` set in each config), their steady steps and a
    warm-up snapshot each, then rounds alternating between them. The first trainer's rows and step time,
    and each writer's figures."""
    trainers, steps, figures, rows, step_s = {}, {}, {}, [], 0.0
    for writer in WRITERS:
        events = Events()
        overrides = [f"trainer.total_steps={args.steps}", "checkpoint.every=0", f"checkpoint.writer={writer}"]
        trainers[writer] = trainer = build(f"{root}/{writer}", overrides, events)
        writer_rows, writer_step_s = steady_steps(trainer, args.steps)
        rows, step_s = rows or writer_rows, step_s or writer_step_s
        first = timed_sync_snapshot(trainer)
        figures[writer] = {"step": writer_step_s, "first": first, "events": events}
        figures[writer].update(control=[], blocked=[], after=[], sync=[])
        steps[writer] = args.steps
    for _ in range(args.snapshots):
        for writer in WRITERS:
            steps[writer] = snapshot_round(trainers[writer], steps[writer], figures[writer])
    figures["floor"] = state_capture(trainers[WRITERS[-1]], root, args.snapshots)
    for writer, trainer in trainers.items():
        figures[writer]["size"] = snapshot_bytes(trainer)
        trainer.snapshots.close()
        trainer.metrics.close()
    return rows, step_s, figures


def state_capture(trainer: Trainer, root: str, repeats: int) -> float:
    """Median seconds the training thread needs to take its engines' state for a snapshot, nothing
    written: DeepSpeed's ``save_checkpoint`` with every file deferred (the deferred state dicts
    dropped). Part of any snapshot's time blocked, whichever writer writes the files."""
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        for key, engine in trainer.dir_stateful().items():
            engine.save_to_dir(os.path.join(root, f"capture-{i}", key), lambda path, state: None)
        times.append(time.perf_counter() - t0)
    return median(times)


def print_writers(args, step_s: float, check_s: float, log_s: float, n_rules: int, figures) -> None:
    print(f"steady-state step (tiny model, 8x4x16): {step_s * 1e3:.1f} ms (median of {args.steps - 5})")
    print(f"policy checks (default.yaml, {n_rules} rules):  {check_s * 1e6:.1f} us = {check_s / step_s:.3%} of a step")
    print(f"metrics row (orjson, flushed):          {log_s * 1e6:.1f} us = {log_s / step_s:.3%} of a step")
    print(f"checks + logging:                       {(check_s + log_s) / step_s:.3%} of a step (target < 1%)")
    size = figures[WRITERS[0]]["size"]
    print(f"snapshot ({size / 1e6:.1f} MB), both writers, rounds alternating, medians of {args.snapshots} each:")
    floor = figures["floor"]
    print(f"  DeepSpeed's state capture alone (save_checkpoint, every file deferred): {floor * 1e3:.1f} ms")
    for writer in WRITERS:
        f = figures[writer]
        fell = f["events"].of("snapshot_writer_fallback")
        note = f" (FELL BACK to the thread: {fell[0][1]['reason']})" if fell else ""
        sync, blocked, after, control = (median(f[k]) for k in ("sync", "blocked", "after", "control"))
        stall = blocked + max(0.0, after - control)
        print(f"  [{writer}]{note} warm-up snapshot (the first): {f['first'] * 1e3:.1f} ms")
        print(f"  [{writer}] synchronous save: {sync * 1e3:.1f} ms = {sync / f['step']:.1%} of a step")
        print(
            f"  [{writer}] asynchronous: blocked in snapshot() {blocked * 1e3:.1f} ms; the step after it "
            f"{after * 1e3:.1f} ms against {control * 1e3:.1f} ms for the control steps"
        )
        print(
            f"  [{writer}] asynchronous stall (blocked + excess): {stall * 1e3:.1f} ms = {stall / f['step']:.1%} "
            f"of a step = {stall / sync:.1%} of the synchronous save (target <= 5%)"
        )
        print(f"  [{writer}] DeepSpeed's state capture alone / synchronous save: {floor / sync:.1%}")


# -- restart: rlctl start / rlctl resume in subprocesses --------------------------------------------------
def cli() -> list[str]:
    exe = Path(sys.executable).parent / "rlctl"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "rlctl"]


def row_after(metrics: Path, after: int) -> dict[str, Any] | None:
    """The first metrics row of a step after ``after``, once it is on disk."""
    if not metrics.exists():
        return None
    for line in metrics.read_bytes().splitlines():
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line still being written
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > after:
            return row
    return None


def time_to_new_row(argv: list[str], run_dir: Path, after: int) -> float:
    """Seconds from launching the CLI with ``argv`` to the end of its first step after ``after`` (that
    row's own timestamp); the process is then let finish, and must exit 0."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}  # (this process joined a group)
    log = run_dir.parent / f"{run_dir.name}-{argv[0]}.stderr"
    with open(log, "w") as err:
        launched = time.time()
        proc = subprocess.Popen([*cli(), *argv], stdout=subprocess.DEVNULL, stderr=err, env=env)
        while (row := row_after(run_dir / "metrics.jsonl", after)) is None:
            if proc.poll() is not None:
                raise RuntimeError(f"rlctl {argv[0]} exited {proc.returncode} before a new step: see {log}")
            time.sleep(0.02)
        rc = proc.wait(timeout=600)
    if rc != 0:
        raise RuntimeError(f"rlctl {argv[0]} exited {rc}: see {log}")
    return row["timestamp"] - launched


def measure_restarts(args, root: str) -> tuple[list[float], list[float]]:
    """Pairs of a fresh start (3 steps, the last snapshotted; timed to step 1) and a resume of it to
    step 4 (timed to step 4)."""
    starts, resumes = [], []
    sets = [a for kv in [*TINY, "trainer.total_steps=3", "checkpoint.every=3"] for a in ("--set", kv)]
    for i in range(args.restarts):
        run_dir = Path(root, f"restart-{i}")
        starts.append(time_to_new_row(["start", "--run-dir", str(run_dir), *sets], run_dir, 0))
        resumes.append(time_to_new_row(["resume", str(run_dir), "--set", "trainer.total_steps=4"], run_dir, 3))
    return starts, resumes


def print_restarts(starts: list[float], resumes: list[float]) -> None:
    start, resume = median(starts), median(resumes)
    print(f"restart (rlctl in a subprocess, launch to the end of its first new step; medians of {len(starts)}):")
    print(f"  rlctl start (fresh run) to step 1:    {start:.2f} s  ({', '.join(f'{s:.2f}' for s in starts)})")
    print(f"  rlctl resume RUN to its next step:    {resume:.2f} s  ({', '.join(f'{s:.2f}' for s in resumes)})")
    print(f"  resume / start:                       {resume / start:.2f}x")


# -- in-process rollback ------------------------------------------------------------------------------------
def measure_rollbacks(args, root: str, after: int) -> dict[str, Any]:
    """A real train() whose policy rolls back ``after`` steps after a snapshot (1: at steps 5, 9, 13 ...,
    to the snapshot taken one step earlier, still in flight; 2: at steps 6, 10, 14 ..., to the one
    taken two steps earlier, committed by then); ``time_rollbacks`` says what is measured."""
    fire_at = [4 * k + after for k in range(1, args.rollbacks + 1)]
    events = Events()
    trainer = build(f"{root}/rollback-{after}", rollback_overrides(fire_at), events)
    return time_rollbacks(trainer, events, fire_at, loads=max(5, args.rollbacks))


def rollback_overrides(fire_at: list[int]) -> list[str]:
    """Config overrides for a run that snapshots every 2 steps and whose policy rolls back when the
    ``metric`` drill reports ppo_kl = 5.0, at each step of ``fire_at`` (once each)."""
    drill = ",".join(f"metric@{s}=actor/ppo_kl:5.0" for s in fire_at)
    return [f"trainer.total_steps={fire_at[-1] + 1}", "checkpoint.every=2", KL_ROLLBACK, f"faults='{drill}'"]


def time_rollbacks(trainer: Trainer, events: Events, fire_at: list[int], loads: int) -> dict[str, list[float]]:
    """Run ``trainer.train()`` (built with ``rollback_overrides(fire_at)``): from each firing to the next
    step's start, of which in the rollback and waiting for the target's commit; then ``loads`` times the
    pure load of the last snapshot rolled back to (``SnapshotManager.restore`` on the Statefuls and
    engines a rollback restores, checksums verified), the engines' load alone, and the trainer's whole
    restore (load, knobs, rollout weights re-synced)."""
    starts: list[float] = []
    train_step = trainer.train_step

    def timed_train_step(step: int) -> dict[str, Any]:
        starts.append(time.perf_counter())
        return train_step(step)

    trainer.train_step = timed_train_step  # (an instance attribute: train() calls it)
    trainer.train()
    fired = events.of("policy")
    rolled = events.of("rollback")
    assert [e["step"] for _, e in fired] == fire_at and len(rolled) == len(fire_at), "the drill did not fire"
    total = [min(s for s in starts if s > t) - t for t, _ in fired]
    in_rollback = [t_rb - t for (t, _), (t_rb, _) in zip(fired, rolled, strict=True)]
    committed = {e["step"]: t for t, e in events.of("snapshot_committed")}  # (the last commit of each step)
    commit_wait = [max(0.0, committed[e["to_step"]] - t) for (t, _), (_, e) in zip(fired, rolled, strict=True)]
    target = rolled[-1][1]["to_step"]
    (info,) = [i for i in trainer.snapshots.catalog.scan() if i.step == target]
    states = {k: v for k, v in trainer.stateful().items() if k != "policy"}  # as a rollback restores
    figures: dict[str, list[float]] = {"load": [], "engines": [], "restore": []}
    for _ in range(loads):
        t0 = time.perf_counter()
        trainer.snapshots.restore(info, states, trainer.dir_stateful())
        figures["load"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for key, engine in trainer.dir_stateful().items():
            engine.load_from_dir(trainer.snapshots.storage.path(info.name, key))
        figures["engines"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer.restore(info, rollback=True)
        figures["restore"].append(time.perf_counter() - t0)
    trainer.snapshots.close()
    return {"total": total, "in_rollback": in_rollback, "commit_wait": commit_wait, **figures}


def print_rollbacks(r: dict[str, Any], title: str, unit: str = "ms") -> None:
    scale = 1e3 if unit == "ms" else 1.0
    m = {k: median(v) * scale for k, v in r.items()}
    rest = max(0.0, m["total"] - m["commit_wait"] - m["restore"])  # (medians of separate measurements)
    print(f"{title} (medians of {len(r['total'])} rollbacks, {len(r['load'])} loads):")
    print(f"  policy fires -> next step starts:     {m['total']:.3f} {unit}")
    print(f"    waiting for the target's commit:    {m['commit_wait']:.3f} {unit}")
    print(f"    Trainer.restore (load, knobs, weight sync): {m['restore']:.3f} {unit}")
    print(f"    the rest (rows and later snapshots moved aside, policy state written): {rest:.3f} {unit}")
    print(f"  pure load (SnapshotManager.restore):  {m['load']:.3f} {unit}")
    print(f"    the engines' load_from_dir alone:   {m['engines']:.3f} {unit}")
    print(f"  rollback / pure load:                 {m['total'] / m['load']:.2f}x (target <= 1.5x)")


def measure_buffer(root: str, reps: int = 5) -> dict[str, float]:
    """rollout.mode one_step_off: what the batch made ahead adds to a snapshot (bytes of its state, the
    time to take and serialise it once made) against the whole snapshot (bytes; a synchronous save)."""
    import io

    import torch

    trainer = build(str(Path(root, "buffer")), ["rollout.mode=one_step_off", "checkpoint.every=1"], Events())
    trainer.metrics = trainer._metrics_log()
    took, saves, size = [], [], 0
    for step in range(1, reps + 1):
        trainer.train_step(step)
        trainer.ahead.wait()  # the next step's batch made: what a snapshot then holds
        t0, buf = time.perf_counter(), io.BytesIO()
        torch.save(trainer.ahead.state_dict(), buf)
        took.append(time.perf_counter() - t0)
        size = buf.tell()
        saves.append(timed_sync_snapshot(trainer))
    out = {"buffer_bytes": size, "buffer_s": median(took), "snapshot_bytes": snapshot_bytes(trainer)}
    out["save_s"] = median(saves)
    trainer.ahead.close()
    return out


def print_buffer(b: dict[str, float]) -> None:
    print("\none_step_off: the batch made ahead in a snapshot (tiny workload, 8 prompts x 4 samples)")
    print(
        f"  its state: {b['buffer_bytes'] / 1024:.1f} KiB of a {b['snapshot_bytes'] / 2**20:.2f} MiB snapshot "
        f"({b['buffer_bytes'] / b['snapshot_bytes']:.2%}); taken and serialised in {b['buffer_s'] * 1e3:.2f} ms "
        f"({b['buffer_s'] / b['save_s']:.2%} of a synchronous save, {b['save_s'] * 1e3:.0f} ms)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--snapshots", type=int, default=15, help="snapshots of each kind, per writer")
    ap.add_argument("--restarts", type=int, default=5, help="start + resume pairs")
    ap.add_argument("--rollbacks", type=int, default=8)
    ap.add_argument("--only-buffer", action="store_true", help="only the one_step_off buffer's cost (section 5)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="rlctl-overheads-")  # (kept when something fails: the CLI's logs are there)
    if args.only_buffer:
        print_buffer(measure_buffer(root))
        shutil.rmtree(root, ignore_errors=True)
        return
    rows, step_s, figures = measure_writers(args, root)
    check_s, log_s, n_rules = checks_and_logging(rows, root)
    print_writers(args, step_s, check_s, log_s, n_rules, figures)
    for after, when in ((2, "committed"), (1, "still in flight")):
        title = f"in-process rollback to the snapshot {after} step(s) back, {when} at the firing (process writer)"
        print_rollbacks(measure_rollbacks(args, root, after), title)
    print_restarts(*measure_restarts(args, root))
    print_buffer(measure_buffer(root))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
