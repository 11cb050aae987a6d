"""Runs that share a machine: started at the same moment, they all complete (their rendezvous binds no
port that another process could take first: rlctl.engine.runtime), a MASTER_PORT that the user set and
another process holds is one sentence (exit 3), and what a SIGKILLed run left in the temp directory is
gone after its resume (rlctl.ranks.tmpdir). benchmarks/concurrent_runs.py starts eight one-rank runs and
two two-rank runs at once; this is its lighter version."""

import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path

import pytest

from rlctl.errors import ExitCode
from rlctl.ranks.tmpdir import process_name, run_key

from helpers import SMALL, has_step, settled_before, spawn, start_args, wait_for

TINY = [*SMALL, "--set", "trainer.total_steps=2", "--set", "checkpoint.every=1"]


def test_runs_started_together_all_complete_and_a_taken_master_port_is_a_sentence(tmp_path):
    """Two one-rank runs and a two-rank run started at once complete; one of the one-rank runs has
    MASTER_PORT set to a port held (bound and listening) by this test: a world of one binds none. A
    two-rank run started beside them with that MASTER_PORT ends in exit 3 with one sentence naming it."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = str(held.getsockname()[1])
    try:
        runs = {
            "one": spawn("start", *start_args(tmp_path / "one"), *TINY),
            "one-port-taken": spawn(
                "start", *start_args(tmp_path / "one-port-taken"), *TINY, env={"MASTER_PORT": port}
            ),
            "two": spawn("start", *start_args(tmp_path / "two"), *TINY, "--nproc", "2"),
            "two-port-taken": spawn(
                "start", *start_args(tmp_path / "two-port-taken"), *TINY, "--nproc", "2", env={"MASTER_PORT": port}
            ),
        }
        ended = {name: (proc.wait(timeout=900), proc.stderr.read()) for name, proc in runs.items()}
    finally:
        held.close()
    for name in ("one", "one-port-taken", "two"):
        code, err = ended[name]
        assert code == 0, f"{name}: {err}"
        assert (tmp_path / name / "checkpoints" / "step-000002" / "manifest.json").exists(), name
    code, err = ended["two-port-taken"]
    assert code == ExitCode.CONFIG, err
    assert err.strip().splitlines()[-1] == (
        f"Error: MASTER_PORT is {port} (set in the environment), but another process on this machine already "
        "listens there, so rlctl cannot bind it for the ranks' rendezvous; unset MASTER_PORT (rlctl then lets "
        "the system choose a free port) or set one that is free"
    )
    assert "Traceback" not in err


def test_a_sigkilled_runs_temp_litter_is_gone_after_its_resume(tmp_path, short_tmp):
    """A run works in its own folder under TMPDIR (where multiprocessing puts its pymp-* folders); after a
    SIGKILL the folder stays, and the resume removes it. A live process's folder under the same run is
    kept, and nothing of the run's is left directly in TMPDIR or after the resume has ended."""
    tmp = short_tmp  # (multiprocessing's sockets live below it: a Unix socket's path has at most 107 bytes)
    run = tmp_path / "run"
    root = tmp / run_key(str(run))
    live = root / process_name(os.getpid())  # this test's own process: alive, so never removed
    live.mkdir(parents=True)
    args = [*SMALL, "--set", "trainer.total_steps=4", "--set", "checkpoint.every=2"]
    # new interpreters, not the tests' fork server: its tempfile module has read TMPDIR already
    env = {"TMPDIR": str(tmp)}
    proc = spawn("start", "--run-dir", str(run), *args, faults="sleep@3=120", env=env, fork=False)
    killed = root / process_name(proc.pid)
    wait_for(lambda: has_step(run, 3)() and settled_before(run, 3), proc)
    litter = sorted(p.name for p in killed.iterdir())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert killed.is_dir() and any(name.startswith("pymp-") for name in litter), litter
    assert not list(tmp.glob("pymp-*"))  # none in the machine's temp directory itself (caches such as torch's may be)

    resume = spawn("resume", str(run), "--from", "latest", env=env, fork=False)
    _, err = resume.communicate(timeout=600)
    assert resume.returncode == 0, err
    assert not killed.exists()
    assert sorted(p.name for p in root.iterdir()) == [live.name]  # the resume's own folder went as it exited


@pytest.fixture
def short_tmp():
    path = Path(tempfile.mkdtemp(prefix="rlctl-t-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
