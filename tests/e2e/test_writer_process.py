"""The snapshot writer process (rlctl.checkpoint.writer) killed in the middle of a snapshot, and the
training process killed while its writer works: never a committed partial snapshot, never a lost run.
And the state moved into shared memory for it never under a snapshot written in a thread."""

import json
import os
import signal
import time

from helpers import REPO, SMALL, alive, events_of, invoke, run_cli, spawn, start_args, wait_for, writer_pids

RUN = [*SMALL, "--set", "trainer.total_steps=9", "--set", "checkpoint.every=3"]


def _held_writer(run, proc):
    """Wait until the step-6 snapshot is staged and its writer is held by the drill; the writer's pid."""
    wait_for(lambda: (run / "checkpoints" / "step-000006").exists(), proc)
    wait_for(lambda: writer_pids(proc.pid), proc)
    (pid,) = writer_pids(proc.pid)
    return pid


def test_a_writer_killed_mid_snapshot_fails_that_snapshot_and_the_run_goes_on(tmp_path):
    run = tmp_path / "run"
    proc = spawn("start", *start_args(run), *RUN, faults="write_delay@6=60")
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
    proc = spawn("start", *start_args(run), *RUN, faults="write_delay@6=60")
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


class _Tensors:
    """A directory-Stateful that defers its tensors to the snapshot writer, as the engines do."""

    def __init__(self, **tensors):
        self.tensors = tensors

    def save_to_dir(self, path, defer=None):
        os.makedirs(path, exist_ok=True)
        defer(os.path.join(path, "tensors.pt"), self.tensors)

    def load_from_dir(self, path):
        raise NotImplementedError


def test_no_storage_moves_into_shared_memory_under_a_snapshot_a_thread_writes(tmp_path, monkeypatch):
    """Two managers of one process snapshot the same live tensors: one writes them in a thread, the
    other hands them to the writer process, which moves their storages into shared memory and frees the
    memory they were in. torch.save hands the thread's file a view of that memory: the move waits until
    the thread has written it, and both files are the bytes of the state."""
    import hashlib
    import io
    import threading

    import torch

    from rlctl.checkpoint import handover
    from rlctl.checkpoint.durable import DurableFile, save_object
    from rlctl.checkpoint.snapshots import SnapshotManager
    from rlctl.storage import Storage

    tensors = _Tensors(w=torch.arange(1 << 14, dtype=torch.float32), b=torch.ones(1 << 12))
    expected = io.BytesIO()
    save_object(tensors.tensors, expected)
    storage = tensors.tensors["w"].untyped_storage()
    writing, arrived, seen, write = threading.Event(), threading.Event(), [], DurableFile.write
    while_none = handover.LIVE_READS.while_none

    def mover_arrives():
        arrived.set()
        return while_none()

    def held_write(fh, data):  # the thread is descheduled in the middle of a tensor's bytes
        if len(memoryview(data).cast("B")) == storage.nbytes() and not seen:
            before = storage.is_shared()
            writing.set()
            assert arrived.wait(timeout=60)
            seen.append((before, storage.is_shared()))
        return write(fh, data)

    monkeypatch.setattr(handover.LIVE_READS, "while_none", mover_arrives)
    monkeypatch.setattr(DurableFile, "write", held_write)
    managers = [SnapshotManager(Storage(str(tmp_path / w)), writer=w) for w in ("thread", "process")]
    managers[0].save(1, {}, {"t": tensors}, good=True)
    assert writing.wait(timeout=60)
    managers[1].save(1, {}, {"t": tensors}, good=True)
    arrived.set()  # (a move that never waited: the thread goes on, and sees it)
    for manager in managers:
        manager.close()
    assert seen == [(False, False)]  # nothing moved while the thread wrote
    assert storage.is_shared()  # (then the writer process's manager moved it)
    digests = [{i.step: i.manifest["files"]["t/tensors.pt"]["sha256"] for i in m.catalog.scan()} for m in managers]
    assert digests == [{1: hashlib.sha256(expected.getvalue()).hexdigest()}] * 2


def test_a_run_and_the_next_in_its_process_start_one_writer_between_them(tmp_path):
    """The writer a run starts before its imports is the one that writes its snapshots, although the run
    sets variables of its own since (its temp folder, its rank's process group, its threads) and its
    reward module adds to the import path; the process's next run keeps it (each job brings the import
    path). It used to be replaced twice in every run: three interpreters' imports for one run's writer."""
    from rlctl.checkpoint.writer import writer

    before = writer().started
    for name in ("first", "second"):
        r = invoke(
            "start",
            *start_args(tmp_path / name),
            *RUN,
            "--set",
            "trainer.total_steps=4",
            "--set",
            "checkpoint.every=2",
            cwd=REPO,
        )
        assert r.returncode == 0, r.stderr
        assert [e["step"] for e in events_of(tmp_path / name, "snapshot_committed")] == [2, 4]
    assert writer().started - before <= 1  # (none when this test's environment had one at rest already)
    assert writer().alive()
