"""The start of a run of several local ranks: ranks forked by the run's starter (rlctl.ranks.starter)
against ranks exec'd as new interpreters, measured side by side in one run.

    .venv/bin/python benchmarks/rank_start.py [--nproc 2,3] [--steps 2] [--rounds 3]

This is a benchmark, not a test: it prints numbers and asserts nothing about them (about 2 minutes with
the defaults on the project's 2-core machine).

What it measures. `rlctl start --nproc N` of rlctl's default config (the built-in tiny model), 12 prompts a step, for
`--steps` steps, whole (from the command to its exit: imports, preflight, the ranks' start, training,
the final snapshot), in a fresh interpreter each: the wall time and the CPU time of the command and
every process below it (the ranks and their starter are reaped, so their time is counted). "forked" is
rlctl as it is; "exec'd" is the same command with the starter turned off (this script patches
``rlctl.ranks.starter.can_fork`` to say no before it runs the CLI, so every rank is
``python -m rlctl.ranks.local``, as when a fork is not safe). The modes alternate within each round;
the medians and their ratios are printed. Every process runs with OMP_NUM_THREADS=1 and
DS_ACCELERATOR=cpu. The load average is printed before and after: the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

RUN = """
import sys
import rlctl.ranks.starter as starter
if sys.argv.pop(1) == "exec'd":
    starter.can_fork = lambda: False
from rlctl.cli import main
sys.argv[0] = "rlctl"
main()
"""
MODES = ("forked", "exec'd")


def one(mode: str, nproc: int, steps: int, work: str) -> tuple[float, float]:
    """(wall s, CPU s) of one start in ``mode``."""
    run = os.path.join(work, f"run-{nproc}-{mode[0]}")
    shutil.rmtree(run, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    argv = [sys.executable, "-c", RUN, mode, "start", "--run-dir", run, "--nproc", str(nproc)]
    argv += ["--set", f"trainer.total_steps={steps}", "--set", "trainer.prompts_per_step=12"]  # (a share for 2 or 3)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{mode} run failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,3")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    work = tempfile.mkdtemp(prefix="rlctl-rank-start-")
    try:
        for nproc in (int(n) for n in args.nproc.split(",")):
            seen: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
            for r in range(args.rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    seen[mode].append(one(mode, nproc, args.steps, work))
            wall = {m: statistics.median(w for w, _ in seen[m]) for m in MODES}
            cpu = {m: statistics.median(c for _, c in seen[m]) for m in MODES}
            print(
                f"{nproc} ranks, {args.steps} steps: forked {wall['forked']:.2f} s wall, {cpu['forked']:.2f} s CPU; "
                f"exec'd {wall[MODES[1]]:.2f} s wall, {cpu[MODES[1]]:.2f} s CPU; "
                f"exec'd/forked: wall {wall[MODES[1]] / wall['forked']:.2f}x, CPU {cpu[MODES[1]] / cpu['forked']:.2f}x"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
