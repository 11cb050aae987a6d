"""How long `rlctl inspect` takes on a long run, in a fresh process each time (imports included).

    .venv/bin/python benchmarks/inspect_speed.py [--steps 10000]

Writes a run directory with STEPS metric rows as wide as a real run's (every key the trainer logs),
then times `rlctl inspect RUN`, `--check` and a CSV dump with hyperfine-style repeats.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlctl.config import RunConfig
from rlctl.metrics import dumps_row
from rlctl.storage import Storage

KEYS = [
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/nonfinite/log_prob",
    "actor/nonfinite/loss",
    "actor/grad_norm",
    "actor/nonfinite/old_log_prob",
    "actor/skipped_updates",
    "actor/lr",
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/advantages/min",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "actor/kl_coef",
    "actor/nonfinite/ref_log_prob",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
    "perf/tokens_seen",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlctl-inspect-"))
    try:
        run = Storage(str(root / "run"))
        run.write_bytes(
            "config.yaml", RunConfig.model_validate({"trainer": {"total_steps": args.steps}}).to_yaml().encode()
        )
        rng = random.Random(0)
        rows = (
            dumps_row({"step": i, "timestamp": 1.7e9 + i, **{k: rng.random() for k in KEYS}})
            for i in range(1, args.steps + 1)
        )
        run.write_bytes("metrics.jsonl", b"".join(rows))
        run.write_bytes("events.jsonl", b'{"event":"start"}\n{"event":"completed"}\n')
        size = run.size("metrics.jsonl") / 2**20
        rlctl = str(Path(sys.executable).parent / "rlctl")
        print(f"{args.steps} steps, metrics.jsonl {size:.1f} MiB; median of {args.repeats} fresh processes")
        for label, extra in [
            ("inspect (summary)", []),
            ("inspect --check", ["--check"]),
            ("inspect --metrics 'actor/*' --format csv", ["--metrics", "actor/*", "--format", "csv"]),
        ]:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                subprocess.run([rlctl, "inspect", run.path(), *extra], check=True, capture_output=True)
                times.append(time.perf_counter() - t0)
            print(f"  {label:<45} {statistics.median(times):.3f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
