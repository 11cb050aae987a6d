"""What each experiment tracker costs per metric row, against rlctl's own JSONL log, in one process.

    .venv/bin/python benchmarks/trackers_overhead.py [--rows 200]

Feeds ROWS rows as wide as a real run's (38 metrics: the keys the trainer and validation log) to the JSONL metrics
log alone, then to a ``Trackers`` of each kind (TensorBoard; W&B offline; MLflow's local SQLite store),
each into a fresh run directory. Prints the first row's time (imports and start-up) and the mean time
per later row, and the per-row ratio to the JSONL log. Times vary on a shared machine: compare the
ratios of one run.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

from rlctl.metrics import JsonlLog
from rlctl.storage import Storage
from rlctl.trackers import Trackers

KEYS = [
    *(f"actor/{k}" for k in ("pg_loss", "kl_loss", "ppo_kl", "pg_clipfrac", "entropy", "grad_norm", "lr")),
    *(f"actor/nonfinite/{k}" for k in ("log_prob", "loss", "old_log_prob", "ref_log_prob")),
    "actor/skipped_updates",
    "actor/kl_coef",
    *(f"critic/score/{k}" for k in ("mean", "max", "min")),
    *(f"critic/advantages/{k}" for k in ("mean", "max", "min")),
    "critic/returns/mean",
    "critic/rewards/mean",
    *(f"response_length/{k}" for k in ("mean", "max", "min", "clip_ratio")),
    "prompt_length/mean",
    *(f"timing_s/{k}" for k in ("gen", "old_log_prob", "ref", "values", "update_actor", "step")),
    "perf/throughput",
    "perf/tokens_seen",
    "val/score/mean",
    "val/score/mean@4",
    "val/score/best@4",
    "val/response_length/mean",
]


def rows(n: int) -> list[dict]:
    rng = random.Random(0)
    return [{"step": s, "timestamp": 1.7e9 + s, **{k: rng.random() for k in KEYS}} for s in range(1, n + 1)]


def time_jsonl(data: list[dict], root: Path) -> tuple[float, float]:
    log = JsonlLog(Storage(str(root)), "metrics.jsonl")
    return _time(data, log.write, log.close)


def time_tracker(name: str, data: list[dict], root: Path) -> tuple[float, float]:
    trackers = Trackers([name], str(root), run_name="bench", config={"trainer": {"loggers": [name]}}, history=list)
    return _time(data, trackers.log_row, trackers.close)


def _time(data, write, close) -> tuple[float, float]:
    """(seconds of the first row, mean seconds of each later row, the close included)."""
    t0 = time.perf_counter()
    write(data[0])
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    for row in data[1:]:
        write(row)
    close()
    return first, (time.perf_counter() - t1) / (len(data) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    data = rows(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            os.environ.setdefault(var, os.path.join(tmp, var.lower()))
        base_first, base = time_jsonl(data, Path(tmp) / "jsonl")
        print(f"{args.rows} rows of {len(KEYS)} metrics")
        print(f"{'log':<12} {'first row':>10} {'per row':>10} {'x jsonl':>8}")
        print(f"{'jsonl':<12} {base_first * 1e3:>8.1f}ms {base * 1e3:>8.3f}ms {1.0:>8.1f}")
        for name in ("tensorboard", "wandb", "mlflow"):
            first, per = time_tracker(name, data, Path(tmp) / name)
            print(f"{name:<12} {first * 1e3:>8.1f}ms {per * 1e3:>8.3f}ms {per / base:>8.1f}")


if __name__ == "__main__":
    main()
