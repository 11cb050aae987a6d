"""Does a ready-made policy let healthy long runs finish? Real runs of the built-in task, with and without it.

    .venv/bin/python benchmarks/policy_table.py [--steps 2000] [--lrs 1e-3 2e-3] [--seeds 0 1 2]
        [--policies default] [--jobs 1] [--out runs/policy-table] [--only with|without]

Each cell is one `rlctl start` of the built-in task (16 prompts x 8 samples, ZeRO-2, a snapshot every
50 steps, the newest 4 kept) at one learning rate and seed: once with ``policies: [POLICY]`` and once
with no policy. A run already finished under --out is read, not run again, so the table can be built in
parts (``--only without`` first; the runs without a policy do not depend on the policy's code).

It prints, per cell: the exit code, the last step trained, the rollbacks, the adjustments and the
halts the policy made, and the final reward (the mean of critic/score/mean over the last 200 steps
trained, from metrics.jsonl: the rows a rollback abandoned are not in it). Target: every run with the
policy exits 0 at --steps, with a final reward no lower than the same run without it (within 0.02).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson

CONFIG = """\
name: policy-table
seed: {seed}
trainer:
  total_steps: {steps}
  prompts_per_step: 16
algorithm:
  group_size: 8
actor:
  lr: {lr}
  zero_stage: 2
rollout:
  max_new_tokens: 8
checkpoint:
  every: 50
  keep_last: 4
policies: {policies}
"""


def cell_dir(out: Path, lr: float, seed: int, policy: str | None) -> Path:
    return out / f"lr{lr:g}-seed{seed}-{policy or 'none'}"


def run_cell(out: Path, steps: int, lr: float, seed: int, policy: str | None) -> Path:
    """Run one cell unless it has finished before (its exit code is on record)."""
    run = cell_dir(out, lr, seed, policy)
    if (run / "exit_code").exists():
        return run
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"{run.name}.yaml"
    config.write_text(CONFIG.format(seed=seed, steps=steps, lr=lr, policies=f"[{policy}]" if policy else "[]"))
    rlctl = Path(sys.executable).with_name("rlctl")
    cmd = ["nice", "-n", "10", str(rlctl), "start", str(config), "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    with open(out / f"{run.name}.log", "wb") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    (run / "exit_code").write_text(str(code))
    return run


def read_cell(run: Path) -> dict:
    rows = [orjson.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines() if line.strip()]
    events = [orjson.loads(line) for line in (run / "events.jsonl").read_bytes().splitlines() if line.strip()]
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    return {
        "exit": int((run / "exit_code").read_text()),
        "last_step": max((r["step"] for r in rows), default=0),
        "rollbacks": sum(1 for e in events if e.get("event") == "rollback"),
        "adjusts": sum(1 for e in events if e.get("event") == "adjust"),
        "halts": sum(1 for e in events if e.get("event") == "halted"),
        "final_reward": statistics.fmean(scores[-200:]) if scores else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 2e-3])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--policies", default="default")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/policy-table"))
    ap.add_argument("--only", choices=["with", "without"])
    args = ap.parse_args()

    which = {"with": [args.policies], "without": [None]}.get(args.only, [None, args.policies])
    cells = [(lr, seed, p) for lr in args.lrs for seed in args.seeds for p in which]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda c: run_cell(args.out, args.steps, *c), cells))

    print(f"{'lr':>7} {'seed':>4} {'policy':>8} {'exit':>4} {'step':>5} {'rollbk':>6} {'adjust':>6} {'reward':>7}")
    for lr, seed, policy in cells:
        c = read_cell(cell_dir(args.out, lr, seed, policy))
        print(
            f"{lr:>7g} {seed:>4} {policy or '-':>8} {c['exit']:>4} {c['last_step']:>5} {c['rollbacks']:>6} "
            f"{c['adjusts']:>6} {c['final_reward']:>7.3f}"
        )


if __name__ == "__main__":
    main()
