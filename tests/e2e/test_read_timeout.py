"""Read-only commands on an object store that refuses connections (a real refused connection: a loopback
port bound by a socket that never listens) give up within their own `--timeout` (10 s by default), exit
12 with one sentence, and never wait out training's long retry budget (checkpoint.retry_timeout)."""

import json
import socket
import subprocess
import threading
import time
import uuid

import fsspec
import pytest
from conftest import refused_port

from rlctl.config import RunConfig
from rlctl.errors import StorageError
from rlctl.storage import Storage

from helpers import RLCTL, child_env, invoke

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("refused",)


@pytest.fixture(scope="module")
def refused():
    """The URL of an S3 endpoint whose every connection is refused: a port bound, never listened on."""
    return f"http://127.0.0.1:{refused_port()}"


def timed(args: list[str], env: dict[str, str], out: dict, key) -> None:
    """Run the CLI in a subprocess; store (exit code, stderr, seconds) under ``key``."""
    began = time.monotonic()
    done = subprocess.run([*RLCTL, *args], capture_output=True, text=True, env=env, timeout=120)
    out[key] = (done.returncode, done.stderr, time.monotonic() - began)


def one_sentence(code: int, err: str, refused: str, what) -> None:
    assert code == 12, (what, code, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"endpoint {refused} unreachable" in lines[0], (what, err[-2000:])


def test_read_only_commands_give_up_on_a_refused_endpoint_within_their_timeout(refused, monkeypatch):
    """The default (10 s) in fresh processes, as an operator meets it; meanwhile `--timeout 2` in this
    process (each on a bucket of its own: the outage clock counts per store and process)."""
    opts = {"client_kwargs": {"endpoint_url": refused}, "key": "test", "secret": "test"}
    env = child_env(FSSPEC_S3=json.dumps(opts), AWS_DEFAULT_REGION="us-east-1")
    env.pop("RLCTL_RETRY_TIMEOUT", None)  # the default --timeout, whatever this shell says
    verbs = {
        "inspect": ["inspect", "s3://rlctl-refused-{}/run"],
        "inspect --check": ["inspect", "s3://rlctl-refused-{}/run", "--check"],
        "checkpoints": ["checkpoints", "s3://rlctl-refused-{}/run"],
        "runs": ["runs", "s3://rlctl-refused-{}/runs"],
    }
    defaults: dict = {}
    threads = [
        threading.Thread(target=timed, args=([a.format("default") for a in args], env, defaults, verb))
        for verb, args in verbs.items()
        if verb != "runs"
    ]
    for t in threads:
        t.start()
    monkeypatch.setitem(fsspec.config.conf, "s3", opts)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("RLCTL_RETRY_TIMEOUT", raising=False)
    with pytest.raises(StorageError):  # (botocore loads its data on a first request: not part of a budget)
        Storage.for_reading("s3://rlctl-refused-warm/run", 0).exists("config.yaml")
    short = {}
    for i, (verb, args) in enumerate(verbs.items()):
        began = time.monotonic()
        result = invoke(*[a.format(f"short{i}") for a in args], "--timeout", "2")
        short[verb] = time.monotonic() - began
        one_sentence(result.returncode, result.stderr, refused, (verb, "--timeout 2"))
        assert short[verb] < 6, (verb, short[verb])
    for t in threads:
        t.join()
    for verb, (code, err, seconds) in defaults.items():
        one_sentence(code, err, refused, (verb, "default"))
        assert 10 <= seconds < 40, (verb, seconds)  # (three interpreters' starts beside a loaded suite)
        assert short[verb] < seconds - 4, (verb, short[verb], seconds)


def test_a_local_run_whose_snapshot_store_refuses_keeps_the_readers_timeout(refused, tmp_path):
    """checkpoint.dir on another store: the catalog the reader lists is opened with the reader's bounds,
    not checkpoint.retry_timeout (120 s by default)."""
    snaps = f"s3://rlctl-refused-{uuid.uuid4().hex[:8]}/snaps"  # (its own store: this process's outage clock)
    options = {"client_kwargs": {"endpoint_url": refused}, "key": "test", "secret": "test"}
    cfg = RunConfig.model_validate(
        {"trainer": {"total_steps": 4}, "checkpoint": {"dir": snaps, "storage_options": options}}
    )
    Storage(str(tmp_path / "run")).write_bytes("config.yaml", cfg.to_yaml().encode())
    for args in (["checkpoints"], ["inspect"]):
        began = time.monotonic()
        result = invoke(*args, str(tmp_path / "run"), "--timeout", "2", env={"AWS_DEFAULT_REGION": "us-east-1"})
        seconds = time.monotonic() - began
        assert result.returncode == 12, (args, result.returncode, result.stderr[-2000:])
        assert result.stderr.startswith(f"Error: cannot list {snaps}: endpoint {refused} unreachable"), result.stderr
        assert seconds < 8, (args, seconds)


def test_a_store_that_accepts_and_never_answers_is_given_up_on_within_the_timeout(tmp_path, monkeypatch):
    """A server that takes connections and never answers: each request's read timeout (60 s for
    training) is bounded by --timeout as well, not only the retries."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # the kernel completes the handshakes; nothing ever reads or answers
        silent = f"http://127.0.0.1:{sock.getsockname()[1]}"
        monkeypatch.setitem(
            fsspec.config.conf, "s3", {"client_kwargs": {"endpoint_url": silent}, "key": "k", "secret": "s"}
        )
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        began = time.monotonic()
        result = invoke("inspect", f"s3://rlctl-silent-{uuid.uuid4().hex[:8]}/run", "--timeout", "2")
        seconds = time.monotonic() - began
    assert result.returncode == 12, (result.returncode, result.stderr[-2000:])
    assert f"endpoint {silent} timed out" in result.stderr, result.stderr
    assert seconds < 8, seconds
