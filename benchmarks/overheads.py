"""What the safety machinery costs per step, against a real step measured in the same run.

    .venv/bin/python benchmarks/overheads.py [--steps 40]

Runs the tiny built-in workload (8 prompts x 4 samples x 16 new tokens) through the real Trainer to get
the steady-state step time, then times, on the same rows: the rollback-policy checks
(policies/default.yaml, all three rules) and one metrics row written to metrics.jsonl (orjson, flushed).
Prints each as a fraction of the step (target for checks + logging: under 1%).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from rlctl.checkpoint.storage import Storage
from rlctl.config import load_config
from rlctl.engine.trainer import Trainer
from rlctl.metrics import JsonlLog
from rlctl.policies import load_policies
from rlctl.policies.guard import PolicyGuard


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    cfg = load_config(None, [f"trainer.total_steps={args.steps}", "trainer.prompts_per_step=8", "algorithm.group_size=4",
                             "rollout.max_new_tokens=16", "checkpoint.every=0"])  # fmt: skip
    root = tempfile.mkdtemp(prefix="rlctl-overheads-")
    trainer = Trainer(cfg, Storage(root))
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
    for rep in range(reps):
        for row in rows:
            log.write(row)
    log_s = (time.perf_counter() - t0) / (reps * len(rows))
    log.close()

    print(f"steady-state step (tiny model, 8x4x16): {step_s * 1e3:.1f} ms (median of {args.steps - 5})")
    print(f"policy checks (default.yaml, {len(policies)} rules):  {check_s * 1e6:.1f} us = {check_s / step_s:.3%} of a step")
    print(f"metrics row (orjson, flushed):          {log_s * 1e6:.1f} us = {log_s / step_s:.3%} of a step")
    print(f"checks + logging:                       {(check_s + log_s) / step_s:.3%} of a step (target < 1%)")


if __name__ == "__main__":
    main()
