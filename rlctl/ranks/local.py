"""Ranks as local processes (``rlctl start --nproc N``, ``cluster.backend: local``).

The driver writes the ranks' spec to a temporary directory and starts ``python -m rlctl.ranks.local
SPEC RANK`` once per rank; each runs the rank's session and writes its result next to the spec. A rank
process dies with the driver (no orphans training on), holds a stop signal sent while it starts until
it can take it, and leaves Ctrl-C to the driver.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import orjson

from rlctl.config import RunConfig
from rlctl.errors import ExitCode
from rlctl.ranks.report import Reporter
from rlctl.ranks.starter import ForkedRank
from rlctl.ranks.starter import current as current_starter
from rlctl.ranks.stops import STOPS, block_stop_signals, on_stop_signals, unblock_stop_signals
from rlctl.ranks.supervise import StopForwarder, supervise
from rlctl.ranks.worker import rank_main, rank_spec
from rlctl.rundir.selection import ResumePlan
from rlctl.storage import Storage

# what a rank's process must not inherit from a launcher around the driver
_DIST_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RLCTL_RENDEZVOUS",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


class LocalRank:
    """A rank's process, as a supervisor's RankHandle."""

    def __init__(self, proc: subprocess.Popen | ForkedRank, result_path: str):
        self.proc, self.result_path = proc, result_path

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, signal_name: str) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.Signals[signal_name])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def result(self) -> dict[str, Any] | None:
        try:
            with open(self.result_path, "rb") as fh:
                return orjson.loads(fh.read())
        except FileNotFoundError:
            return None


def launch_local(
    run: Storage,
    cfg: RunConfig,
    plan: ResumePlan | None,
    reporter: Reporter,
    *,
    fence: Callable[[], None] | None = None,
    lease_owner: str | None = None,
) -> dict[str, Any]:
    """Run the ranks of ``cfg`` as processes on this machine and follow them to the run's outcome
    (``fence`` and ``lease_owner``: the driver's lease, see ``supervise`` and ``rank_spec``). The ranks
    meet at a store server this process binds once, on MASTER_PORT where the user set it, else on a port
    the system chooses, and serves until they end."""
    from rlctl.engine.rendezvous import bind_rendezvous, user_master_port
    from rlctl.engine.runtime import check_local_ranks

    check_local_ranks(cfg.device, cfg.world_size)
    rendezvous = bind_rendezvous(cfg.world_size, user_master_port())
    tmp = tempfile.mkdtemp(prefix="rlctl-ranks-")
    ranks: list[LocalRank] = []
    try:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "wb") as fh:
            fh.write(orjson.dumps({**rank_spec(run, cfg, plan, lease_owner), "port": rendezvous.port}))
        env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
        with StopForwarder().installed() as stops:
            for rank in range(cfg.world_size):
                ranks.append(LocalRank(_start_rank(spec_path, rank, env), _result_path(spec_path, rank)))
                stops.add(ranks[-1])
            return supervise(ranks, run, plan, cfg.trainer.total_steps, reporter, fence)
    finally:
        for r in ranks:
            r.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _start_rank(spec_path: str, rank: int, env: dict[str, str]) -> subprocess.Popen | ForkedRank:
    """Rank ``rank``'s process: forked by the run's starter where it can (``rlctl.ranks.starter``), else
    ``python -m rlctl.ranks.local SPEC RANK``."""
    starter = current_starter()
    forked = starter.spawn(spec_path, rank, env, frozenset(_DIST_VARS)) if starter is not None else None
    if forked is not None:
        return forked
    argv = [sys.executable, "-m", "rlctl.ranks.local", spec_path, str(rank)]
    return subprocess.Popen(argv, env=env, preexec_fn=_prepare_rank)


def _result_path(spec_path: str, rank: int) -> str:
    return os.path.join(os.path.dirname(spec_path), f"result-{rank}.json")


def _prepare_rank() -> None:
    """In a rank's process before exec: SIGKILL it when the driver dies (no orphans training on), and
    hold the stop signals until it can take them."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    block_stop_signals()


def main() -> None:
    """``python -m rlctl.ranks.local SPEC RANK``: a local rank; writes its result next to the spec."""
    spec_path, rank = sys.argv[1], int(sys.argv[2])
    with on_stop_signals(STOPS.request):  # a stop while the rank still loads is kept for later
        unblock_stop_signals()  # (one sent since the process started arrives now)
        with open(spec_path, "rb") as fh:
            spec = orjson.loads(fh.read())
        try:
            result = rank_main(spec, rank, rank, spec["world"], "127.0.0.1", spec["port"])
        except BaseException as exc:  # a bug: say so, and skip a teardown that may hang on live threads
            import traceback

            traceback.print_exc()
            result = {
                "code": int(ExitCode.INTERNAL),
                "message": f"rank {rank} crashed: {type(exc).__name__}: {exc}",
                "summary": None,
            }
        with open(_result_path(spec_path, rank), "wb") as fh:
            fh.write(orjson.dumps(result))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(result["code"])  # skip interpreter teardown (gloo threads, DeepSpeed atexit hooks)


if __name__ == "__main__":
    main()
