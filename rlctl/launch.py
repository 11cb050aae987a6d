"""The ranks of a multi-rank run: local processes, or Ray actors, and the driver that follows them.

``rlctl start --nproc N`` (``trainer.nproc``) runs N local processes; ``cluster.backend: ray`` runs the
ranks as Ray actors placed by a placement group (``trainer.nnodes`` bundles of
``trainer.n_devices_per_node`` ranks). Each rank runs the same loop (``rlctl.run.train_rank``) on its
share of every step's prompts, the ranks forming one torch.distributed group for DeepSpeed (gloo on
CPU, NCCL on CUDA, HCCL on NPU). Rank 0 writes the run's metrics and events and commits snapshots once
every rank's files are in. The driver (the ``rlctl`` process) keeps the run's lease, shows progress
from rank 0's metrics, forwards SIGTERM/SIGUSR1 to every rank, stops the others when one fails, and
exits with rank 0's outcome (or the first failing rank's).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import orjson

from rlctl.storage import Storage
from rlctl.config import RunConfig
from rlctl.errors import ExitCode, RankFailed, RlctlError
from rlctl.rundir.layout import METRICS
from rlctl.metrics import parse_rows

GRACE_S = 10.0  # how long the other ranks get to notice a failed rank before they are stopped
# exits every rank takes together after the same step (rank 0 may still be committing a snapshot):
# they never start the grace clock
COORDINATED = {ExitCode.OK, ExitCode.HALTED, ExitCode.PREEMPTED}
# what a rank's process must not inherit from a launcher around the driver
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# -- one rank ---------------------------------------------------------------------------------------
def rank_main(spec: dict[str, Any], rank: int, local_rank: int, local_world: int, addr: str, port: int) -> dict:
    """Run rank ``rank`` to its end in this process; returns {"code", "message", "summary"}. A domain
    error is a result (with its exit code); a bug propagates."""
    import warnings

    import yaml

    from rlctl.config import validate_config
    from rlctl.metrics import EventLog
    from rlctl.run import _Silent, snapshot_manager, train_rank

    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(spec["world"]),
        "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
    })  # fmt: skip
    # DeepSpeed's ZeRO all-gathers call a torch API that warns once per process and rank
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    cfg: RunConfig = validate_config(yaml.safe_load(spec["config"]), {})
    run = Storage(spec["run_url"])
    events = EventLog(run) if rank == 0 else None
    try:
        snapshots = snapshot_manager(run, cfg, events, rank=rank)
        restore = None
        if spec["restore"] is not None:
            r = spec["restore"]
            infos = {i.name: i for i in snapshots.scan()}
            restore = ([infos[n] for n in r["names"] if n in infos], r["wanted"], r["changes"])
        summary = train_rank(run, cfg, events, snapshots, _Silent(), restore, rank=rank)
        return {"code": 0, "message": None, "summary": summary}
    except RlctlError as exc:
        return {"code": int(exc.exit_code), "message": exc.message, "summary": None}
    finally:
        if events is not None:
            events.close()


def _die_with_parent() -> None:
    """In a rank's process before exec: SIGKILL it when the driver dies (no orphans training on)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _rank_process() -> None:
    """``python -m rlctl.launch SPEC RANK``: a local rank; writes its result next to the spec."""
    from rlctl.run import request_stop

    spec_path, rank = sys.argv[1], int(sys.argv[2])
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # a stop while the rank still loads is kept for later
        signal.signal(sig, lambda signum, _frame: request_stop(signal.Signals(signum).name))
    with open(spec_path, "rb") as fh:
        spec = orjson.loads(fh.read())
    try:
        result = rank_main(spec, rank, rank, spec["world"], "127.0.0.1", spec["port"])
    except BaseException as exc:  # a bug: say so, and skip a teardown that may hang on live threads
        import traceback

        traceback.print_exc()
        result = {"code": int(ExitCode.INTERNAL), "message": f"rank {rank} crashed: {type(exc).__name__}: {exc}",
                  "summary": None}  # fmt: skip
    with open(os.path.join(os.path.dirname(spec_path), f"result-{rank}.json"), "wb") as fh:
        fh.write(orjson.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(result["code"])  # skip interpreter teardown (gloo threads, DeepSpeed atexit hooks)


# -- the driver --------------------------------------------------------------------------------------
class _Follower:
    """Shows rank 0's metric rows as they land (the driver's progress bar)."""

    def __init__(self, run: Storage, reporter):
        self.run, self.reporter, self.offset = run, reporter, None
        self._last = 0.0

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.5:
            return
        self._last = now
        try:
            size, tail = self._read_from(self.offset or 0)
        except FileNotFoundError:
            size, tail = 0, b""
        except Exception:  # a flaky read of remote storage: progress waits for the next poll
            return
        if self.offset is None or size < self.offset:  # rows from before this launch are history;
            self.offset = size  # a rollback moved rows away
            return
        end = tail.rfind(b"\n") + 1  # whole lines only
        if end:
            self.offset += end
            for row in parse_rows(tail[:end]):
                self.reporter.step(row)

    def _read_from(self, offset: int) -> tuple[int, bytes]:
        """The metrics file's size and its bytes from ``offset``: a local file is read from there only,
        an object (no ranged append semantics to rely on) whole."""
        if self.run.is_local:
            with open(self.run.path(METRICS), "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(min(offset, size))
                return size, fh.read()
        data = self.run.read_bytes(METRICS)
        return len(data), data[offset:]


def _spec(run: Storage, cfg: RunConfig, restore: dict | None) -> dict[str, Any]:
    url = run.url if "://" in run.url else os.path.abspath(run.url)  # ranks may not share our cwd
    return {"run_url": url, "config": cfg.to_yaml(), "restore": restore, "world": cfg.world_size}


def _start_step(restore: dict | None) -> int:
    if not restore or not restore["names"]:
        return 0
    return int(restore["names"][0].rsplit("-", 1)[-1])


def launch_ranks(run: Storage, cfg: RunConfig, restore: dict | None, reporter) -> dict[str, Any]:
    if cfg.cluster.backend == "ray":
        from rlctl.ray_ranks import launch_ray

        return launch_ray(run, cfg, restore, reporter)
    return _launch_local(run, cfg, restore, reporter)


def starts_grace(code: int | None) -> bool:
    """Whether a rank ending with ``code`` has left the others stuck (a crash, or an error on that rank
    alone), rather than taking a coordinated exit every rank takes after the same step."""
    return code is not None and code not in COORDINATED


def outcome(results: list[dict | None], failed_first: int | None) -> dict[str, Any]:
    """The run's result from the ranks' results: rank 0's, unless another rank failed first."""
    first = results[0]
    # a rank that ended with its own error (not a crash) says why the others went down
    own = [r for r, res in enumerate(results) if res and starts_grace(res["code"]) and res["code"] != 1]
    if own and (first is None or first["code"] in (0, 1)):
        failed_first = own[0]
    if failed_first is not None and failed_first != 0:
        r = results[failed_first] or {"code": 1, "message": None}
        if first is None or first["code"] in (0, 1):
            raise RankFailed(r["message"] or f"rank {failed_first} failed (exit code {r['code']}); its "
                             "error is above. The other ranks were stopped", r["code"] or 1)  # fmt: skip
    if first is None:
        raise RankFailed("rank 0 died without a result; see its error above", 1)
    if first["code"]:
        raise RankFailed(first["message"] or f"rank 0 failed (exit code {first['code']})", first["code"])
    return first["summary"]


def _launch_local(run: Storage, cfg: RunConfig, restore: dict | None, reporter) -> dict[str, Any]:
    from rlctl.engine.runtime import check_local_ranks

    world = cfg.world_size
    check_local_ranks(cfg.device, world)
    tmp = tempfile.mkdtemp(prefix="rlctl-ranks-")
    spec = {**_spec(run, cfg, restore), "port": free_port()}
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "wb") as fh:
        fh.write(orjson.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    procs = [
        subprocess.Popen([sys.executable, "-m", "rlctl.launch", spec_path, str(rank)], env=env,
                         preexec_fn=_die_with_parent)  # fmt: skip
        for rank in range(world)
    ]

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1)}
    follower = _Follower(run, reporter)
    follower.poll(force=True)
    reporter.ready(_start_step(restore), cfg.trainer.total_steps)
    failed_first, failed_at = None, None
    try:
        while True:
            codes = [p.poll() for p in procs]  # every rank, every time
            if all(c is not None for c in codes):
                break
            follower.poll()
            for rank, code in enumerate(codes):
                if failed_first is None and starts_grace(code):
                    failed_first, failed_at = rank, time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for p in procs:  # a rank left the group: the others would wait in a collective forever
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
        follower.poll(force=True)
        results = []
        for rank in range(world):
            try:
                with open(os.path.join(tmp, f"result-{rank}.json"), "rb") as fh:
                    results.append(orjson.loads(fh.read()))
            except FileNotFoundError:
                results.append(None)
        return outcome(results, failed_first)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    _rank_process()
