"""Runs that share a machine and start at the same moment: every one must complete.

    .venv/bin/python benchmarks/concurrent_runs.py [--single 8] [--double 2] [--steps 2] [--taken-port]

Starts ``--single`` runs of one rank and ``--double`` runs of two local ranks (``--nproc 2``) of
rlctl's default config (the built-in tiny model, 4 prompts x 4 samples x 6 new tokens a step,
``--steps`` steps, a snapshot every step) as separate ``rlctl start`` processes, all released at once,
in fresh run directories under one temporary folder; then waits for every one and prints its exit code,
wall time and the last line of its stderr. With ``--taken-port``, every run is started with MASTER_PORT
set to a port this script holds bound and listening the whole time: the one-rank runs must still complete
(a world of one binds no port) and the two-rank runs must end in exit 3 with the one sentence naming it.

It exits 1 when any run ends otherwise, 0 when all did as expected. Before rlctl's rendezvous bound its
ports once (issue 41), every run probed a free port and bound it later, and runs started together could
take each other's (``DistNetworkError ... EADDRINUSE``, exit 1). On the project's 2-core machine the
defaults take several minutes: twelve interpreters import torch at once. The load average is printed
before and after: the machine may be shared. A lighter version runs in the suite
(tests/e2e/test_runs_sharing_a_machine.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RLCTL = str(Path(sys.executable).parent / "rlctl")
SMALL = ["--set", "trainer.prompts_per_step=4", "--set", "algorithm.group_size=4", "--set", "rollout.max_new_tokens=6"]
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", type=int, default=8, help="runs of one rank")
    parser.add_argument("--double", type=int, default=2, help="runs of two local ranks")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--taken-port", action="store_true", help="every run gets MASTER_PORT of a held port")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rlctl-concurrent-"))
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    held = None
    if args.taken_port:
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        env["MASTER_PORT"] = str(held.getsockname()[1])
    steps = ["--set", f"trainer.total_steps={args.steps}", "--set", "checkpoint.every=1"]
    plans = [(f"single-{i}", 1) for i in range(args.single)] + [(f"double-{i}", 2) for i in range(args.double)]
    print(f"load average before: {os.getloadavg()}; {len(plans)} runs under {work}", flush=True)
    procs = []
    began = time.time()
    for name, nproc in plans:
        argv = [RLCTL, "start", "--run-dir", str(work / name), *SMALL, *steps, *(["--nproc", "2"] if nproc > 1 else [])]
        log = open(work / f"{name}.stderr", "wb")  # noqa: SIM115 (closed below)
        procs.append((name, nproc, subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log), log))
    failed = 0
    for name, nproc, proc, log in procs:
        code = proc.wait()
        log.close()
        took = time.time() - began
        last = (work / f"{name}.stderr").read_text().strip().splitlines()[-1:] or [""]
        expected = 3 if (held is not None and nproc > 1) else 0
        ok = code == expected and (expected == 0 or "MASTER_PORT" in last[0])
        failed += not ok
        print(
            f"{name:9} ranks={nproc} exit={code} ({'as expected' if ok else 'UNEXPECTED'}) {took:6.1f} s  {last[0][:160]}"
        )
    print(f"load average after: {os.getloadavg()}; {len(plans) - failed} of {len(plans)} as expected")
    if failed == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept for reading: {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
