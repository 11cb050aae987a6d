"""What the safety machinery costs per step, against a real step measured in the same run.

    .venv/bin/python benchmarks/overheads.py [--steps 40] [--snapshots 15]

Runs the tiny built-in workload (8 prompts x 4 samples x 16 new tokens) through the real Trainer, with a
real snapshot manager on local disk, to get the steady-state step time. Then it times, on the same rows,
the rollback-policy checks (policies/default.yaml, every rule) and one metrics row written to
metrics.jsonl (orjson, flushed), each as a fraction of the step (target for checks + logging: under 1%).

Then snapshots of the whole run state (ZeRO-2 engine, optimizer, RNG, data cursor ...), taken as a run
takes them, alternating:

- asynchronous: the stall is the time `snapshot()` blocks, plus how much longer the step after it
  takes than the control steps taken just before each snapshot (medians): that step waits at the
  optimizer-step fence for files still being written, and shares the CPU and the GIL with the writer.
  The commit is awaited after that step;
- synchronous: the training thread calls `snapshot()` and then waits for the commit.

Target: the asynchronous stall under 5% of a synchronous save.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rlctl.config import load_config
from rlctl.engine.runtime import open_rank
from rlctl.engine.trainer import Trainer
from rlctl.metrics import JsonlLog
from rlctl.policies import load_policies
from rlctl.policies.guard import PolicyGuard
from rlctl.rundir.directory import snapshot_manager
from rlctl.storage import Storage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--snapshots", type=int, default=15, help="snapshots of each kind")
    args = ap.parse_args()
    cfg = load_config(
        None,
        [
            f"trainer.total_steps={args.steps}",
            "trainer.prompts_per_step=8",
            "algorithm.group_size=4",
            "rollout.max_new_tokens=16",
            "checkpoint.every=0",
        ],
    )
    root = tempfile.mkdtemp(prefix="rlctl-overheads-")
    run = Storage(root)
    rank = open_rank(cfg)
    snapshots = snapshot_manager(run, cfg, collectives=rank.dist)
    trainer = Trainer(cfg, run, rank, snapshots=snapshots)
    trainer.metrics = trainer._metrics_log()  # as train() opens it: a snapshot records its offset
    rows, steps = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        rows.append(trainer.train_step(step))
        steps.append(time.perf_counter() - t0)
    step_s = statistics.median(steps[5:])

    policies = load_policies(["policies/default.yaml"])
    guard = PolicyGuard(policies)
    reps = 50
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

    # snapshots, alternating: a control step, an async snapshot, the step after it (whose excess over the
    # control steps is the rest of the stall), the commit awaited, one more step, a sync snapshot
    step, control, blocked, after, sync_save = args.steps, [], [], [], []
    for _ in range(args.snapshots):
        step += 1
        t0 = time.perf_counter()
        trainer.train_step(step)
        control.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer.snapshot(good=True)
        blocked.append(time.perf_counter() - t0)
        step += 1
        t0 = time.perf_counter()
        trainer.train_step(step)
        after.append(time.perf_counter() - t0)
        assert snapshots.wait(), "the asynchronous snapshot did not commit"
        step += 1
        trainer.train_step(step)
        t0 = time.perf_counter()
        trainer.snapshot(good=True)
        assert snapshots.wait(), "the synchronous snapshot did not commit"
        sync_save.append(time.perf_counter() - t0)
    snapshots.close()
    size = sum(f.stat().st_size for f in Path(root, "checkpoints").glob(f"step-{step:06d}/**/*") if f.is_file())
    excess = statistics.median(after) - statistics.median(control)
    stall, sync = statistics.median(blocked) + max(0.0, excess), statistics.median(sync_save)

    print(f"steady-state step (tiny model, 8x4x16): {step_s * 1e3:.1f} ms (median of {args.steps - 5})")
    print(
        f"policy checks (default.yaml, {len(policies)} rules):  {check_s * 1e6:.1f} us = {check_s / step_s:.3%} of a step"
    )
    print(f"metrics row (orjson, flushed):          {log_s * 1e6:.1f} us = {log_s / step_s:.3%} of a step")
    print(f"checks + logging:                       {(check_s + log_s) / step_s:.3%} of a step (target < 1%)")
    print(f"snapshot ({size / 1e6:.1f} MB, medians of {args.snapshots} each):")
    print(f"  synchronous save:                     {sync * 1e3:.1f} ms = {sync / step_s:.1%} of a step")
    print(
        f"  asynchronous: blocked in snapshot()   {statistics.median(blocked) * 1e3:.1f} ms; the step after it "
        f"{statistics.median(after) * 1e3:.1f} ms against {statistics.median(control) * 1e3:.1f} ms for the control "
        "steps"
    )
    print(
        f"  asynchronous stall (blocked + excess): {stall * 1e3:.1f} ms = {stall / step_s:.1%} of a step, "
        f"{stall / sync:.1%} of the synchronous save (target < 5%)"
    )


if __name__ == "__main__":
    main()
