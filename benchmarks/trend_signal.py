"""Would a trigger on a metric's trend (its slope) warn of a collapse earlier than the level triggers,
without firing on healthy runs? Read from finished runs' metrics.jsonl, nothing trained here.

    .venv/bin/python benchmarks/collapse_zoo.py --variants none --out runs/collapse-zoo
    .venv/bin/python benchmarks/trend_signal.py runs/collapse-zoo/*-none HEALTHY_RUN... [--window 10]

The trend of a metric at step t is its mean change of log value per step over the last ``--window``
steps: log(x[t] / x[t - w]) / w (a rate: 0.05 is 5% a step, compounded), the entropy's taken as a fall,
the gradient norm's and ``actor/ppo_kl``'s as a rise. For each run and each rate threshold the table
gives the first step whose trend passes it (``-``: never), and the largest trend of the run. A trigger
earns its place if some threshold is passed on every collapse before it is visible and on no healthy run.
Steps with a value of 0 or below (a log needs a positive value) are skipped.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rlctl.metrics import read_rows
from rlctl.rundir.layout import METRICS
from rlctl.storage import Storage

SIGNALS = (("actor/entropy", -1), ("actor/grad_norm", 1), ("actor/ppo_kl", 1))  # (metric, direction)
THRESHOLDS = (0.03, 0.05, 0.08, 0.12)


def series(run: Path, metric: str) -> dict[int, float]:
    """The metric's finite values by step, from the run's metrics.jsonl (rlctl's own reading of it:
    unreadable lines skipped)."""
    rows = read_rows(Storage(str(run)), METRICS, require_step=True)
    return {
        r["step"]: float(r[metric]) for r in rows if isinstance(r.get(metric), int | float) and math.isfinite(r[metric])
    }


def trends(values: dict[int, float], window: int, direction: int) -> list[tuple[int, float]]:
    """(step, rate) for every step with a positive value ``window`` steps before and now."""
    steps = sorted(values)
    out = []
    for i in range(window, len(steps)):
        before, now = values[steps[i - window]], values[steps[i]]
        if before > 0 and now > 0:
            out.append((steps[i], direction * math.log(now / before) / window))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with its metrics.jsonl)")
    ap.add_argument("--window", type=int, default=10, help="steps the trend is taken over (default 10)")
    args = ap.parse_args()
    width = max(len(r.name) for r in args.runs)
    for metric, direction in SIGNALS:
        way = "falls" if direction < 0 else "rises"
        print(f"\n{metric} {way}: first step past each rate per step over {args.window} steps, and the largest")
        print(f"{'run':{width}}  " + "  ".join(f"{t:>6}" for t in THRESHOLDS) + "  largest (step)")
        for run in args.runs:
            found = trends(series(run, metric), args.window, direction)
            firsts = [next((s for s, rate in found if rate > t), None) for t in THRESHOLDS]
            top = max(found, key=lambda x: x[1], default=None)
            cells = "  ".join(f"{'-' if s is None else s:>6}" for s in firsts)
            largest = f"{top[1]:.3f} ({top[0]})" if top else "-"
            print(f"{run.name:{width}}  {cells}  {largest}")


if __name__ == "__main__":
    main()
