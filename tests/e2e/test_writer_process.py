"""The snapshot writer process (rlctl.checkpoint.writer) killed in the middle of a snapshot, and the
training process killed while its writer works: never a committed partial snapshot, never a lost run."""

import json
import os
import signal
import time

from helpers import SMALL, alive, events_of, invoke, run_cli, spawn_start, wait_for, writer_pids

RUN = [*SMALL, "--set", "trainer.total_steps=9", "--set", "checkpoint.every=3"]


def _held_writer(run, proc):
    """Wait until the step-6 snapshot is staged and its writer is held by the drill; the writer's pid."""
    wait_for(lambda: (run / "checkpoints" / "step-000006").exists(), proc)
    wait_for(lambda: writer_pids(proc.pid), proc)
    (pid,) = writer_pids(proc.pid)
    return pid


def test_a_writer_killed_mid_snapshot_fails_that_snapshot_and_the_run_goes_on(tmp_path):
    run = tmp_path / "run"
    proc = spawn_start(run, *RUN, faults="write_delay@6=60")
    writer = _held_writer(run, proc)
    time.sleep(0.5)  # (inside the 60 s hold)
    os.kill(writer, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err

    failed = [e for e in events_of(run) if e["event"] == "snapshot_failed"]
    assert [e["step"] for e in failed] == [6]
    assert f"the snapshot writer process (pid {writer}) was killed by signal 9" in failed[0]["error"]
    committed = [e["step"] for e in events_of(run) if e["event"] == "snapshot_committed"]
    assert committed == [3, 9]  # a new writer wrote step 9
    listed = json.loads(invoke("checkpoints", str(run), "--format", "json").stdout)
    assert [(c["step"], c["committed"], c["usable"]) for c in listed] == [(3, True, True), (9, True, True)]
    r = invoke("inspect", str(run), "--check")
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr  # a later commit made good


def test_a_killed_trainer_takes_its_writer_along_and_resume_starts_from_the_last_commit(tmp_path):
    run = tmp_path / "run"
    proc = spawn_start(run, *RUN, faults="write_delay@6=60")
    writer = _held_writer(run, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while alive(writer) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(writer)  # it died with its parent: nothing will write into the run any more
    assert not (run / "checkpoints" / "step-000006" / "manifest.json").exists()

    r = run_cli("resume", str(run))
    assert r.returncode == 0, r.stderr
    assert "continuing from step 3" in r.stderr
    committed = [e["step"] for e in events_of(run) if e["event"] == "snapshot_committed"]
    assert committed == [3, 6, 9]
