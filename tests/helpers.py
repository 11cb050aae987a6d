"""What the tests share: running the installed CLI in a subprocess, reading a run's rows and events,
waiting for a run to reach a step. (Fixtures live in conftest.py.)"""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RLCTL = [str(Path(sys.executable).parent / "rlctl")]  # the installed console script

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """This environment without the distributed variables an in-process test may have set (a child
    would inherit a MASTER_PORT this process already holds)."""
    return {**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, **extra}


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
    """The real entry point in a subprocess."""
    return subprocess.run(
        [*RLCTL, *args], capture_output=True, text=True, cwd=cwd or REPO, timeout=timeout, env=child_env(**(env or {}))
    )


def metrics_of(run_dir, rel: str = "metrics.jsonl") -> list[dict]:
    from rlctl.metrics import read_rows
    from rlctl.storage import Storage

    return read_rows(Storage(str(run_dir)), rel)


SMALL = ["--set", "trainer.prompts_per_step=4", "--set", "algorithm.group_size=4", "--set", "rollout.max_new_tokens=6"]
VOLATILE = ("timing_s/", "perf/throughput", "timestamp")


def stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k != "abandoned"} for r in rows]


def events_of(run_dir):
    return metrics_of(run_dir, "events.jsonl")


def completed_hash(run_dir):
    return [e for e in events_of(run_dir) if e["event"] == "completed"][-1]["weights_sha256"]


def spawn(*args, faults="", env=None):
    return subprocess.Popen(
        [*RLCTL, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(RLCTL_FAULTS=faults, **(env or {})),
    )


def wait_for(predicate, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("timed out waiting")


def has_step(run_dir, step):
    return lambda: (run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in metrics_of(run_dir))


@contextlib.contextmanager
def small_tmpfs(path, size="64k"):
    """A real small filesystem (tmpfs) mounted at ``path``, for a full disk; root only: the test is
    skipped where it cannot be mounted."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
