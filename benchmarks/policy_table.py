"""Does a ready-made policy let healthy long runs finish? Real runs of the built-in task, with and without it.

    .venv/bin/python benchmarks/policy_table.py [--steps 2000] [--lrs 1e-3 2e-3] [--seeds 0 1 2]
        [--policies default] [--jobs 1] [--out runs/policy-table] [--only with|without]
        [--drills] [--compare OLD_POLICY.yaml]

Each cell is one `rlctl start` of the built-in task (16 prompts x 8 samples, ZeRO-2, a snapshot every
50 steps, the newest 4 kept) at one learning rate and seed: once with ``policies: [POLICY]`` and once
with no policy. A run already finished under --out is read, not run again, so the table can be built in
parts (``--only without`` first; the runs without a policy do not depend on the policy's code).

It prints, per cell: the exit code, the last step trained, the rollbacks, the adjustments and the
halts the policy made, and the final reward (the mean of critic/score/mean over the last 200 steps
trained, from metrics.jsonl: the rows a rollback abandoned are not in it), and for a run without a
policy, how many times the policy (and --compare's) would have fired on it (``rlctl policy replay``).
Target: every run with the policy exits 0 at --steps, with a final reward no lower than the same run
without it.

``--drills``: instead, short runs (40 steps, a snapshot every 10) with each drill the default policy is
meant to catch at step 30 (a NaN log-prob, a KL blow-up on two steps, an importance-ratio blow-up, a
gradient-norm spike), under the policy and under --compare's: which rule fired first, whether the run
rolled back, and its exit code. Target: the policy catches every drill --compare catches.
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
faults: {faults}
"""
DRILLS = {
    "nan-log-prob": "nan_log_prob@30",
    "kl-blowup": "metric@30=actor/ppo_kl:5.0,metric@31=actor/ppo_kl:5.0",
    "ratio-blowup": "metric@30=actor/ppo_ratio/max:10000.0",
    "grad-spike": "metric@30=actor/grad_norm:1000000.0",
}


def cell_dir(out: Path, lr: float, seed: int, policy: str | None) -> Path:
    return out / f"lr{lr:g}-seed{seed}-{Path(policy).stem if policy else 'none'}"


def run_cell(
    out: Path, steps: int, lr: float, seed: int, policy: str | None, faults: str = "", run: Path | None = None
) -> Path:
    """Run one cell unless it has finished before (its exit code is on record)."""
    run = run or cell_dir(out, lr, seed, policy)
    if (run / "exit_code").exists():
        return run
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"{run.name}.yaml"
    policies = f"[{policy}]" if policy else "[]"
    config.write_text(CONFIG.format(seed=seed, steps=steps, lr=lr, policies=policies, faults=faults or "null"))
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


def replayed_firings(run: Path, policy: str) -> int:
    """How many times ``policy`` would have fired on ``run`` (``rlctl policy replay --format json``)."""
    rlctl = Path(sys.executable).with_name("rlctl")
    out = subprocess.run(
        [str(rlctl), "policy", "replay", str(run), "--policy", policy, "--format", "json"],
        capture_output=True,
        check=True,
    ).stdout
    return len(orjson.loads(out))


def drills(args: argparse.Namespace) -> None:
    """Each drill under the policy and --compare's: the first rule that fired, rollbacks, exit code."""
    policies = [args.policies, *([str(args.compare)] if args.compare else [])]
    cells = [(name, policy) for name in DRILLS for policy in policies]

    def one(cell: tuple[str, str]) -> Path:
        name, policy = cell
        run = args.out / f"drill-{name}-{Path(policy).stem}{'-compare' if policy != args.policies else ''}"
        return run_cell(args.out, 40, 1e-3, 0, policy, DRILLS[name], run)

    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(one, cells))
    print(f"{'drill':>13} {'policy':>22} {'first rule':>13} {'at':>3} {'rollbk':>6} {'exit':>4}")
    for (name, policy), run in zip(cells, runs):
        events = [orjson.loads(x) for x in (run / "events.jsonl").read_bytes().splitlines() if x.strip()]
        fired = [e for e in events if e.get("event") == "policy"]
        first = fired[0] if fired else {}
        rollbacks = sum(1 for e in events if e.get("event") == "rollback")
        code = int((run / "exit_code").read_text())
        label = Path(policy).stem + (" (compare)" if policy != args.policies else "")
        print(
            f"{name:>13} {label:>22} {first.get('rule', '-'):>13} {first.get('step', '-'):>3} {rollbacks:>6} {code:>4}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 2e-3])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--policies", default="default")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/policy-table"))
    ap.add_argument("--only", choices=["with", "without"])
    ap.add_argument("--drills", action="store_true", help="the drill table instead of the long runs")
    ap.add_argument("--compare", type=Path, help="another policy file to set beside --policies")
    args = ap.parse_args()
    if args.drills:
        return drills(args)

    which = {"with": [args.policies], "without": [None]}.get(args.only, [None, args.policies])
    cells = [(lr, seed, p) for lr in args.lrs for seed in args.seeds for p in which]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda c: run_cell(args.out, args.steps, *c), cells))

    head = f"{'lr':>7} {'seed':>4} {'policy':>8} {'exit':>4} {'step':>5} {'rollbk':>6} {'adjust':>6} {'reward':>7}"
    print(head + f" {'replayed':>8}" + (f" {'compare':>8}" if args.compare else ""))
    for lr, seed, policy in cells:
        run = cell_dir(args.out, lr, seed, policy)
        c = read_cell(run)
        line = (
            f"{lr:>7g} {seed:>4} {Path(policy).stem if policy else '-':>8} {c['exit']:>4} {c['last_step']:>5} {c['rollbacks']:>6} "
            f"{c['adjusts']:>6} {c['final_reward']:>7.3f}"
        )
        if policy is None:  # what the policy (and --compare's) would have done on this run
            line += f" {replayed_firings(run, args.policies):>8}"
            line += f" {replayed_firings(run, str(args.compare)):>8}" if args.compare else ""
        print(line)


if __name__ == "__main__":
    main()
