"""An object store that stalls or goes away, for real: moto's S3 server on loopback, paused with SIGSTOP
(requests hang) or killed (connections refused). Storage calls retry within their budget and then end
in one sentence; a short stall is survived (by the calls and by the lease); the run's global random
stream is never touched; the CLI exits 12 with one line and no traceback."""

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from rlctl.errors import LeaseError, StorageError
from rlctl.rundir.lease import LEASE_FILE, Lease, read_lease
from rlctl.storage import Storage

from helpers import run_cli

BUCKET = "rlctl-outage"


class MotoServer:
    """moto_server in its own process, so that it can be paused, resumed and killed."""

    def __init__(self):
        server_bin = Path(sys.executable).parent / "moto_server"
        if not server_bin.exists():
            pytest.skip("moto[server] is not installed")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(server_bin), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=1).close()
                return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)

    def options(self, timeout: float = 1.0) -> dict:
        """s3fs options; short botocore timeouts so that a paused server costs a second per attempt."""
        return {
            "client_kwargs": {"endpoint_url": self.url},
            "key": "test",
            "secret": "test",
            "config_kwargs": {"connect_timeout": timeout, "read_timeout": timeout},
        }

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def resume_after(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.resume)
        timer.start()
        return timer

    def stop(self):
        self.resume()
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def moto():
    server = MotoServer()
    Storage(f"s3://{BUCKET}", server.options(), retry_timeout=10).makedirs()
    yield server
    server.stop()


def test_a_stall_shorter_than_the_budget_is_survived_and_a_longer_one_is_one_sentence(moto):
    st = Storage(f"s3://{BUCKET}/run", moto.options(), retry_timeout=8)
    data = os.urandom(5 << 20)
    st.write_bytes("step_00000002/model.bin", data)
    assert st.sha256("step_00000002", "model.bin") == hashlib.sha256(data).hexdigest()

    random.seed(7)
    before = random.getstate()
    moto.pause()
    timer = moto.resume_after(2.0)
    t0 = time.monotonic()
    assert st.read_bytes("step_00000002/model.bin") == data  # retried through the stall
    assert 1.5 < time.monotonic() - t0 < 8
    timer.join()
    st.append_bytes("metrics.jsonl", b'{"step": 1}\n')
    assert random.getstate() == before, "a storage retry drew from the global random stream"

    short = Storage(f"s3://{BUCKET}/run", moto.options(), retry_timeout=2)
    moto.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(StorageError) as info:
            short.write_bytes("metrics.jsonl", b'{"step": 2}\n')
        took = time.monotonic() - t0
    finally:
        moto.resume()
    assert 2 <= took < 2 + 1 + 3, took  # the budget, one more attempt (read timeout), some slack
    text = info.value.message
    assert text.startswith(f"cannot write s3://{BUCKET}/run/metrics.jsonl: endpoint {moto.url} timed out (")
    assert "gave up after" in text and "\n" not in text
    assert st.read_bytes("metrics.jsonl") == b'{"step": 1}\n'


def test_the_lease_survives_a_short_stall_and_is_lost_after_a_long_one(moto):
    st = Storage(f"s3://{BUCKET}/leased", moto.options(timeout=0.5), retry_timeout=5)
    lease = Lease(st, timeout=4.0, heartbeat=0.2).acquire()
    try:
        first = read_lease(st)["heartbeat"]
        moto.pause()
        time.sleep(1.5)
        moto.resume()
        deadline = time.monotonic() + 5
        while read_lease(st)["heartbeat"] <= first + 1.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_lease(st)["heartbeat"] > first + 1.5, "renewed after the stall"
        assert lease.held and lease._thread.is_alive()
        lease.check()

        moto.pause()
        time.sleep(5.0)
        with pytest.raises(LeaseError, match=r"lost the lease of .*: no heartbeat succeeded for \d+ s"):
            lease.check()
        moto.resume()
        time.sleep(0.5)
        assert not lease.held
    finally:
        moto.resume()
        lease.release()
    assert st.exists(LEASE_FILE), "a lost lease is never removed by its old holder"


def test_cli_on_a_dead_endpoint_exits_12_with_one_line(moto):
    run = Storage(f"s3://{BUCKET}/gone", moto.options(), retry_timeout=5)
    run.write_bytes("config.yaml", b"trainer:\n  total_steps: 2\n")
    moto.stop()  # the endpoint now refuses every connection
    env = {
        "FSSPEC_S3": json.dumps({"client_kwargs": {"endpoint_url": moto.url}, "key": "test", "secret": "test"}),
        "AWS_DEFAULT_REGION": "us-east-1",
        "RLCTL_RETRY_TIMEOUT": "2",
    }
    with_cli = {}
    threads = [
        threading.Thread(target=lambda a=args: with_cli.__setitem__(a[0], run_cli(*a, env=env, timeout=120)))
        for args in (("inspect", f"s3://{BUCKET}/gone"), ("checkpoints", f"s3://{BUCKET}/gone"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for verb, done in with_cli.items():
        assert done.returncode == 12, (verb, done.returncode, done.stderr[-2000:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, (verb, done.stderr[-2000:])
        assert lines[0].startswith(f"Error: cannot read s3://{BUCKET}/gone/")
        assert f"endpoint {moto.url} unreachable (EndpointConnectionError); gave up after" in lines[0]


def test_a_run_whose_object_store_goes_away_ends_12_and_resumes_with_nothing_lost(moto, tmp_path):
    """Snapshots on S3; the server is paused after the first commit and stays paused: the later
    snapshots fail within their budget, the run ends with exit 12 and one sentence (not `completed`);
    once the store is back, `resume` continues from the committed snapshot to the end."""
    from helpers import SMALL, events_of, metrics_of, spawn_start, wait_for

    run, url = tmp_path / "run", f"s3://{BUCKET}/snaps"
    cfg = tmp_path / "cfg.yaml"
    opts = moto.options()
    cfg.write_text(json.dumps({"checkpoint": {"dir": url, "storage_options": opts, "every": 1, "retry_timeout": 2}}))
    total = ["--set", "trainer.total_steps=3"]
    proc = spawn_start(run, *SMALL, *total, config=cfg, faults="sleep@1=4")

    def committed(step):
        return lambda: any(e.get("event") == "snapshot_committed" and e.get("step") == step for e in events_of(run))

    wait_for(committed(1), proc)
    moto.pause()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 12, err[-3000:]
    assert "Traceback" not in err and f"s3://{BUCKET}/snaps" in err, err[-3000:]
    assert "the last committed snapshot is step 1" in err, err[-3000:]
    assert not [e for e in events_of(run) if e["event"] == "completed"]
    assert {e["step"] for e in events_of(run) if e["event"] == "snapshot_failed"} >= {3}

    moto.resume()
    r = run_cli("resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3]
    assert [e for e in events_of(run) if e["event"] == "completed"][-1]["step"] == 3
