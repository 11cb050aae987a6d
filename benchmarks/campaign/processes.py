"""The stores a campaign's runs write to (a local folder, moto's S3 on loopback) and one rlctl process
under watch (its output read as it goes, signalled at a moment), with the constants of the campaign."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

REPO = Path(__file__).resolve().parents[2]
RLCTL = str(Path(sys.executable).parent / "rlctl")
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
SIGNAL_EXIT = {"SIGKILL": 137, "SIGTERM": 75}
MOMENTS = ("start-up", "mid-step", "mid-commit", "mid-resume", "mid-rollback")
VOLATILE = ("timing_s/", "perf/throughput", "timestamp")
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STEP_LINE = re.compile(r"^step (\d+)/\d+\s")
CORRUPT_SIGNS = ("warning: skipping snapshot", "trying an older snapshot", "quarantin")  # on stderr
CORRUPT_EVENTS = ("snapshot_quarantined", "snapshot_unusable")
SPIKE_STEP = 5
EVERY = 2
COMMIT_DELAY = 0.4
FAULTS = f"metric@{SPIKE_STEP}=actor/ppo_kl:5.0,commit_delay={COMMIT_DELAY}"
BUCKET = "rlctl-campaign"
POLL_S = 0.02


# -- storage -------------------------------------------------------------------------------------------
@dataclass
class Store:
    """Where the runs of one storage kind live, seen through fsspec (listings never cached)."""

    name: str
    base: str
    env: dict[str, str]
    fs: Any

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def cat(self, url: str) -> bytes | None:
        try:
            return self.fs.cat_file(url)
        except FileNotFoundError:
            return None

    def exists(self, url: str) -> bool:
        return self.fs.exists(url)

    def uncommitted(self, run_url: str, step: int) -> bool:
        """The snapshot of ``step`` has files and no manifest yet: its commit is under way."""
        try:
            names = [str(p).rsplit("/", 1)[-1] for p in self.fs.ls(f"{run_url}/checkpoints/step-{step:06d}")]
        except FileNotFoundError:
            return False
        return bool(names) and "manifest.json" not in names

    def remove(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(url, recursive=True)


def local_store(root: Path) -> Store:
    root.mkdir(parents=True, exist_ok=True)
    return Store("local", str(root), {}, fsspec.filesystem("file"))


@contextlib.contextmanager
def s3_store(prefix: str) -> Iterator[Store]:
    """A moto S3 server on loopback in its own process (as tests/conftest.py ``s3_env``), a bucket on
    it, and the environment that points rlctl's s3fs at it."""
    server = Path(sys.executable).parent / "moto_server"
    if not server.exists():
        raise SystemExit("moto_server is not installed in this environment: pip install 'moto[server]'")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=quiet, stderr=quiet)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(endpoint, proc)
        opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "test", "secret": "test"}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **opts)
        fs.mkdir(BUCKET)
        env = {"FSSPEC_S3": json.dumps(opts), "AWS_DEFAULT_REGION": "us-east-1"}
        yield Store("s3", f"s3://{BUCKET}/{prefix}", env, fs)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_for_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit(f"moto_server did not answer at {url}") from None
            time.sleep(0.1)


# -- one rlctl process ---------------------------------------------------------------------------------
class Child:
    """One rlctl process; its stderr is read as it comes, each line with its time since launch."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.args = args
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [RLCTL, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self.signal_at: float | None = None
        self.row_at_signal: int | None = None
        self.wall_s = 0.0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((self.elapsed(), line.rstrip("\n")))

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def step_times(self, step: int) -> list[float]:
        """When the row of ``step`` was printed (twice for a step replayed after a rollback)."""
        return [t for t, line in list(self.lines) if (m := STEP_LINE.match(line)) and int(m[1]) == step]

    def last_step(self) -> int | None:
        steps = [int(m[1]) for _, line in list(self.lines) if (m := STEP_LINE.match(line))]
        return steps[-1] if steps else None

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Poll ``predicate`` while the process lives; whether it came true."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if not self.alive():
                return predicate()
            time.sleep(POLL_S)
        return False

    def pause(self, seconds: float) -> None:
        """Wait ``seconds``, cut short if the process ends."""
        self.wait_until(lambda: False, seconds)

    def send(self, kind: str) -> None:
        if self.alive():
            self.signal_at, self.row_at_signal = self.elapsed(), self.last_step()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, SIGNALS[kind])

    def finish(self, timeout: float) -> int | None:
        """The exit code in shell terms (128 + N for signal N); None when it hung and was killed."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = None
        self._reader.join(timeout=10)
        self.wall_s = self.elapsed()
        return None if rc is None else (128 - rc if rc < 0 else rc)

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in list(self.lines))


def child_env(store: Store) -> dict[str, str]:
    """One thread per process, the CPU accelerator, the campaign's drills and the storage's settings."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env.update(threads, DS_ACCELERATOR="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0", TOKENIZERS_PARALLELISM="false")
    env.update(RLCTL_FAULTS=FAULTS, **store.env)
    return env
