"""The snapshot commit protocol, discovery, verification, retention and the lease, on real storage
(local disk and fsspec's memory filesystem), with small Stateful objects."""

import errno
import os
import subprocess
import sys
import threading
import time
import uuid

import orjson
import pytest

from rlctl.checkpoint.catalog import Catalog, parse_step_spec
from rlctl.checkpoint.collectives import Local
from rlctl.checkpoint.layout import MANIFEST, step_name
from rlctl.checkpoint.retention import Retention
from rlctl.checkpoint.snapshots import SnapshotManager
from rlctl.errors import LeaseError, SnapshotError, StorageError
from rlctl.rundir.layout import LEASE_FILE
from rlctl.rundir.lease import Lease, read_lease
from rlctl.rundir.snapshots import zero_topology
from rlctl.storage import Storage

from helpers import Number, small_tmpfs


class Blob:
    """A directory-Stateful: its state is a file of bytes."""

    def __init__(self, data=b""):
        self.data = data

    def save_to_dir(self, path, defer=None):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "blob.bin"), "wb") as fh:
            fh.write(self.data)

    def load_from_dir(self, path):
        with open(os.path.join(path, "blob.bin"), "rb") as fh:
            self.data = fh.read()


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path):
    if request.param == "local":
        return Storage(str(tmp_path / "ckpt"))
    return Storage(f"memory://test-{uuid.uuid4().hex}/ckpt")


def save(manager, step, value, good=True):
    manager.save(step, {"counter": Number(value)}, {"blob": Blob(bytes([value]) * 1000)}, good=good)
    manager.wait()


def test_commit_then_restore(storage):
    events = []
    m = SnapshotManager(storage, on_event=events.append)
    save(m, 5, 7)
    (info,) = m.catalog.scan()
    assert info.committed and info.usable and info.step == 5 and info.name == "step-000005"
    manifest = info.manifest
    assert set(manifest["files"]) == {"blob/blob.bin", "state.pt"}
    assert manifest["world_size"] == 1 and manifest["rlctl_version"] and manifest["total_bytes"] > 1000
    counter, blob = Number(), Blob()
    m.restore(info, {"counter": counter}, {"blob": blob})
    assert counter.value == 7 and blob.data == bytes([7]) * 1000
    assert [e["event"] for e in events] == ["snapshot_committed"]


def test_uncommitted_directory_is_invisible_and_removed(storage):
    m = SnapshotManager(storage)
    save(m, 1, 1)
    storage.write_bytes("step-000002/state.pt", b"half written")
    infos = m.catalog.scan()
    assert [(i.step, i.committed) for i in infos] == [(1, True), (2, False)]
    assert [i.step for i in m.catalog.candidates("latest")] == [1]
    assert m.catalog.remove_uncommitted() == [2]
    assert not storage.exists("step-000002")


def test_corrupt_file_is_caught_by_checksum_and_latest_falls_back(storage):
    m = SnapshotManager(storage)
    save(m, 1, 1)
    save(m, 2, 2)
    path = "step-000002/blob/blob.bin"
    storage.write_bytes(path, b"X" * 1000)  # same size, other bytes
    newest = m.catalog.candidates("latest")[0]
    with pytest.raises(SnapshotError, match="blob/blob.bin does not match its sha256"):
        m.restore(newest, {"counter": Number()}, {"blob": Blob()})
    older = m.catalog.candidates("latest")[1]
    counter = Number()
    m.restore(older, {"counter": counter}, {"blob": Blob()})
    assert counter.value == 1


def test_missing_file_wrong_size_and_wrong_topology(storage):
    m = SnapshotManager(storage)
    save(m, 1, 1)
    save(m, 2, 2)
    save(m, 3, 3)
    storage.rm("step-000001/state.pt")
    storage.write_bytes("step-000002/blob/blob.bin", b"short")
    problems = {i.step: i.problem for i in m.catalog.scan()}
    assert problems[1] == "file state.pt is missing"
    assert problems[2] == "file blob/blob.bin has 5 bytes; the manifest says 1000"
    assert problems[3] is None
    # a rollback picks its target by the manifests alone: the restore verifies every file it reads
    picked = m.catalog.scan(files=False)
    assert [i.problem for i in picked] == [None, None, None]
    with pytest.raises(SnapshotError, match="file state.pt is missing"):
        m.restore(picked[0], {"counter": Number()}, {"blob": Blob()})
    with pytest.raises(SnapshotError, match="blob/blob.bin does not match its sha256"):
        m.restore(picked[1], {"counter": Number()}, {"blob": Blob()})
    two_ranks = Catalog(storage, world_size=2)  # (the read side alone)
    assert two_ranks.scan()[2].problem == "written by 1 rank(s); this run has 2"
    stage3 = Catalog(storage, topology=[zero_topology(3)])
    assert "ZeRO stage None; this run uses stage 3" in stage3.scan()[2].problem


def test_the_catalog_reads_snapshots_without_the_writing_machinery(tmp_path):
    """Listing and choosing snapshots (a fresh process) loads no manager, writer, collectives nor torch."""
    m = SnapshotManager(Storage(str(tmp_path / "ckpt")))
    save(m, 1, 1)
    code = (
        "import sys\n"
        "from rlctl.checkpoint.catalog import Catalog\n"
        "from rlctl.storage import Storage\n"
        f"assert [i.step for i in Catalog(Storage({str(tmp_path / 'ckpt')!r})).candidates('latest')] == [1]\n"
        "writing = ('torch', 'rlctl.checkpoint.snapshots', 'rlctl.checkpoint.writer', 'rlctl.checkpoint.handover', 'rlctl.checkpoint.collectives')\n"
        "loaded = [name for name in writing if name in sys.modules]\n"
        "assert loaded == [], loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_manifest_is_created_exclusively(storage):
    m = SnapshotManager(storage)
    save(m, 4, 4)
    with pytest.raises(SnapshotError, match="committed snapshot of step 4 already exists"):
        m.save(4, {"counter": Number(9)}, {}, good=True)
    with pytest.raises(FileExistsError):
        storage.write_bytes(f"{step_name(4)}/{MANIFEST}", b"{}", exclusive=True)


@pytest.mark.slow
def test_async_save_returns_before_commit_and_never_overlaps(storage, monkeypatch):
    monkeypatch.setenv("RLCTL_FAULTS", "commit_delay=3")  # every manifest waits 3 s (room for a loaded machine)
    events = []
    m = SnapshotManager(storage, on_event=events.append)
    t0 = time.perf_counter()
    m.save(1, {"counter": Number(1)}, {}, good=True)
    assert time.perf_counter() - t0 < 2.5  # training went on while the commit waited
    assert not storage.exists("step-000001", MANIFEST)
    m.save(2, {"counter": Number(2)}, {}, good=True)  # waits for step 1 first
    assert storage.exists("step-000001", MANIFEST)
    m.close()
    assert [e["step"] for e in events if e["event"] == "snapshot_committed"] == [1, 2]


def test_retention_keeps_last_every_and_newest_good(storage):
    m = SnapshotManager(storage, retention=Retention(keep_last=2, keep_every=10))
    save(m, 10, 1, good=True)
    save(m, 15, 1, good=True)
    save(m, 20, 1, good=True)
    save(m, 25, 1, good=True)
    save(m, 30, 1, good=False)
    save(m, 35, 1, good=False)
    save(m, 36, 1, good=False)
    # keep_last: 35, 36; keep_every 10: 10, 20, 30; newest good: 25; 15 goes
    assert [i.step for i in m.catalog.scan()] == [10, 20, 25, 30, 35, 36]
    m.retention.protected.add(10)
    m.retention.keep_every = 0
    save(m, 37, 1, good=False)
    assert [i.step for i in m.catalog.scan()] == [10, 25, 36, 37]


def test_failed_upload_is_reported_and_never_half_visible(tmp_path):
    class Unwritable(Storage):
        def put_dir(self, local_dir, *parts):
            self.fs.pipe_file(self.path(*parts, "partial"), b"x")
            raise OSError(errno.EIO, "Input/output error", "partial")

    storage = Unwritable(f"memory://fail-{uuid.uuid4().hex}/ckpt")
    events = []
    m = SnapshotManager(storage, on_event=events.append)
    m.save(3, {"counter": Number(3)}, {}, good=True)
    assert m.wait() is False
    (failed,) = events
    assert failed["event"] == "snapshot_failed" and failed["step"] == 3
    assert (failed["consecutive"], failed["max_failures"]) == (1, 3)
    assert failed["error"] == f"the snapshot of step 3 was not committed to {storage.url}: input/output error (partial)"
    assert m.catalog.scan() == [] and not storage.exists("step-000003")


def test_parse_step_spec():
    assert parse_step_spec("latest") == "latest" and parse_step_spec("last-good") == "last-good"
    assert parse_step_spec("step-500") == parse_step_spec("500") == parse_step_spec("step-000500") == 500
    with pytest.raises(SnapshotError, match="--from expects"):
        parse_step_spec("yesterday")


def test_explicit_step_that_does_not_exist(storage):
    m = SnapshotManager(storage)
    save(m, 2, 2)
    with pytest.raises(SnapshotError, match=r"no snapshot of step 3 .*usable steps: 2"):
        m.catalog.candidates(3)


# -- failed snapshots: reported, counted, and the end of the run at max_failures -------------------
class DeferredBlob(Blob):
    """A directory-Stateful that defers its file to the snapshot writer, as the engines do: a tensor
    of its bytes, written with torch.save."""

    def save_to_dir(self, path, defer=None):
        import torch

        os.makedirs(path, exist_ok=True)
        defer(os.path.join(path, "blob.bin"), {"data": torch.frombuffer(bytearray(self.data), dtype=torch.uint8)})

    def load_from_dir(self, path):
        import torch

        self.data = torch.load(os.path.join(path, "blob.bin"))["data"].numpy().tobytes()


class QuotaExceeded:
    """Crosses to the writer process (pickle protocol 5), then fails as an over-quota disk would when
    torch.save (protocol 2) writes it."""

    def __init__(self, path):
        self.path = path

    def __reduce_ex__(self, protocol):
        if protocol < 5:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), self.path)
        return QuotaExceeded, (self.path,)


def test_enospc_drill_fails_every_snapshot_from_its_step_and_max_failures_ends_the_run(storage, monkeypatch):
    monkeypatch.setenv("RLCTL_FAULTS", "enospc@2")
    events = []
    m = SnapshotManager(storage, on_event=events.append, max_failures=3)
    save(m, 1, 1)
    for step in (2, 3):
        m.save(step, {"counter": Number(step)}, {"blob": Blob(b"x" * 10)}, good=True)
        assert m.wait() is False
    failed = [e for e in events if e["event"] == "snapshot_failed"]
    assert [(e["step"], e["consecutive"], e["max_failures"]) for e in failed] == [(2, 1, 3), (3, 2, 3)]
    assert all("no space left on device" in e["error"] for e in failed)
    assert [i.step for i in m.catalog.scan()] == [1]  # nothing half-visible, no litter
    with pytest.raises(StorageError) as caught:
        m.save(4, {"counter": Number(4)}, {}, good=True)
    message = caught.value.message
    assert "3 snapshots in a row failed" in message and "of step 4" in message and storage.url in message
    assert "no space left on device" in message and "the last committed snapshot is step 1" in message
    with pytest.raises(StorageError):  # and at every later wait: the run must stop
        m.wait()


def test_snapshots_refused_by_the_store_end_the_run_13_not_12(tmp_path):
    """A disk gone read-only (a real tmpfs remounted ro: EROFS) refuses every snapshot: no requeue mends
    that, so max_failures in a row end the run with StorageRefused (exit 13), where a full disk or an
    outage ends it 12 (the test above)."""
    from rlctl.errors import ExitCode, StorageRefused

    with small_tmpfs(tmp_path / "ro", size="4m") as disk:
        m = SnapshotManager(Storage(str(disk / "ckpt")), max_failures=2)
        save(m, 1, 1)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        m.save(2, {"counter": Number(2)}, {"blob": Blob(b"x" * 10)}, good=True)
        assert m.wait() is False
        with pytest.raises(StorageRefused) as caught:
            m.save(3, {"counter": Number(3)}, {}, good=True)
    assert caught.value.exit_code == ExitCode.STORAGE_REFUSED == 13
    assert "2 snapshots in a row failed" in caught.value.message and "read-only file system" in caught.value.message


def test_background_write_failure_is_counted_and_a_commit_resets_the_count(tmp_path, monkeypatch):
    class OverQuota(DeferredBlob):
        def save_to_dir(self, path, defer=None):
            os.makedirs(path, exist_ok=True)
            target = os.path.join(path, "blob.bin")
            defer(target, {"half": b"half", "rest": QuotaExceeded(target)})

    storage = Storage(str(tmp_path / "ckpt"))
    events = []
    m = SnapshotManager(storage, on_event=events.append, max_failures=2)
    monkeypatch.setenv("RLCTL_FAULTS", "enospc@1")
    m.save(1, {"counter": Number(1)}, {}, good=True)  # fails while staging, on this thread
    assert m.wait() is False
    monkeypatch.setenv("RLCTL_FAULTS", "")
    m.save(2, {"counter": Number(2)}, {"blob": DeferredBlob(b"y" * 100)}, good=True)
    assert m.wait() is True and m.failures.consecutive == 0
    m.save(3, {"counter": Number(3)}, {"blob": OverQuota()}, good=True)  # fails in the background
    m.wait_staged()  # training is released even so
    assert m.wait() is False
    failed = [e for e in events if e["event"] == "snapshot_failed"]
    assert [(e["step"], e["consecutive"]) for e in failed] == [(1, 1), (3, 1)]  # 2 committed: the count restarted
    assert "no space left on device" in failed[0]["error"]
    assert failed[1]["error"].endswith(f"disk quota exceeded ({storage.path('step-000003', 'blob', 'blob.bin')})")
    assert m.outcome(3).startswith("the snapshot of step 3 was not committed (disk quota exceeded")
    assert m.outcome(3).endswith("the last committed snapshot is step 2")
    assert [i.step for i in m.catalog.scan()] == [2]


def test_a_durable_write_to_a_full_disk_fails_with_enospc_and_stops_its_hasher(tmp_path):
    """On a real full filesystem (a 1 MiB tmpfs; needs root) the write fails where the disk says so,
    in ``os.write``, and the file's hashing thread ends with it."""
    from rlctl.checkpoint.durable import DurableFile

    with small_tmpfs(tmp_path / "small", size="1m") as disk:
        with DurableFile(str(disk / "f")) as fh, pytest.raises(OSError) as caught:
            fh.write(b"x" * (2 << 20))  # (a chunk big enough to be hashed on the other thread)
        assert caught.value.errno == errno.ENOSPC
        assert not fh._hasher.is_alive()


def test_torch_write_failure_on_a_full_disk_is_named_for_what_it_is(tmp_path):
    """On a real full filesystem (a 1 MiB tmpfs; needs root) torch.save fails with its bare
    "unexpected pos"; the cause is said as "no space left on device"."""
    import torch

    from rlctl.checkpoint.failure_count import describe

    with small_tmpfs(tmp_path / "small", size="1m") as disk:
        with pytest.raises(RuntimeError) as caught:
            torch.save({"x": torch.zeros(1 << 20)}, str(disk / "state.pt"))
        error = caught.value.with_traceback(None)
        assert "unexpected pos" in str(error)
        assert describe(error, str(disk)).startswith(f"no space left on device ({disk} is full; torch said:")
        assert describe(error, str(tmp_path)).startswith("RuntimeError: [enforce fail")  # not full: as it is


def test_fence_failure_commits_nothing_and_reaches_the_training_thread(tmp_path):
    storage = Storage(str(tmp_path / "ckpt"))
    lost = []

    def fence():
        if lost:
            raise LeaseError("the lease of the run was taken over by another writer")

    events = []
    m = SnapshotManager(storage, on_event=events.append, fence=fence)
    save(m, 1, 1)
    lost.append(True)
    m.save(2, {"counter": Number(2)}, {"blob": Blob(b"x")}, good=True)  # the fence is only asked at commit
    with pytest.raises(LeaseError, match="taken over"):
        m.wait()
    assert not storage.exists("step-000002", MANIFEST)
    assert storage.exists("step-000002", "state.pt")  # left for the new owner to tidy: we may not write
    with pytest.raises(LeaseError):
        m.save(3, {"counter": Number(3)}, {}, good=True)
    assert [e["event"] for e in events] == ["snapshot_committed"]


def test_an_exception_of_the_commit_thread_reaches_the_training_thread(tmp_path):
    def on_event(event):
        if event["event"] == "snapshot_committed":
            raise RuntimeError("events.jsonl is gone")

    m = SnapshotManager(Storage(str(tmp_path / "ckpt")), on_event=on_event)
    m.save(1, {"counter": Number(1)}, {}, good=True)
    with pytest.raises(RuntimeError, match="events.jsonl is gone"):
        m.wait()
    m.save(2, {"counter": Number(2)}, {}, good=True)  # the thread lives on
    with pytest.raises(RuntimeError, match="events.jsonl is gone"):
        m.close()


# -- unreadable manifests: never deleted, never chosen, quarantined and said ----------------------------
GARBAGE = {
    b"\x00\xffnot json": "is not valid JSON",
    b'{"format": 1, "step": 2, "files": {"state.pt": {"si': "is not valid JSON",
    b"[1, 2]": "holds a JSON list, not an object",
    b'{"files": {}}': "has no format number",
    b'{"format": 1, "step": 2, "world_size": 1, "total_bytes": 3, "good": true, "files": []}': "'files' is not",
    b'{"format": 1, "step": 2, "world_size": 1, "total_bytes": 3, "good": true, '
    b'"files": {"state.pt": {"size": "3", "sha256": "00"}}}': "size of state.pt is '3'",
    b'{"format": 1, "step": "2", "world_size": 1, "total_bytes": 3, "good": true, "files": {}}': "'step' is '2'",
    b'{"format": 1, "step": 2, "world_size": 1, "total_bytes": 3, "good": "yes", "files": {}}': "'good' is 'yes'",
}


@pytest.mark.parametrize("raw", list(GARBAGE), ids=[f"garbage{i}" for i in range(len(GARBAGE))])
def test_unreadable_manifest_is_quarantined_never_deleted_nor_chosen(storage, raw):
    events = []
    m = SnapshotManager(storage, on_event=events.append)
    save(m, 1, 1)
    save(m, 2, 2)
    storage.write_bytes("step-000002/manifest.json", raw)
    storage.write_bytes("step-000003/state.pt", b"half written")  # the protocol's own temporary
    bad = m.catalog.scan()[1]
    assert (bad.step, bad.committed, bad.usable, bad.unreadable) == (2, False, False, True)
    assert GARBAGE[raw] in bad.problem and "manifest.json" in bad.problem
    assert [(i.step, i.usable) for i in m.catalog.candidates("latest")] == [(2, False), (1, True)]

    assert m.catalog.remove_uncommitted() == [3]
    assert not storage.exists("step-000003") and not storage.exists("step-000002")
    (moved,) = storage.listdir("quarantine")
    assert moved.startswith("step-000002.")
    assert storage.read_bytes("quarantine", moved, "manifest.json") == raw  # everything kept, as it was
    assert storage.exists("quarantine", moved, "blob", "blob.bin") and storage.exists("quarantine", moved, "state.pt")
    (event,) = [e for e in events if e["event"] == "snapshot_quarantined"]
    assert event["step"] == 2 and GARBAGE[raw] in event["reason"]
    assert event["location"] == storage.url_of("quarantine", moved)

    latest = m.catalog.candidates("latest")  # the reason can still be named when latest falls back
    assert [(i.step, i.usable) for i in latest] == [(2, False), (1, True)]
    assert latest[0].problem == f"{event['reason']}; moved to {event['location']}"
    assert m.catalog.candidates(2)[0].problem == latest[0].problem
    assert m.catalog.candidates("last-good") == [latest[1]]


def test_retention_never_deletes_an_unreadable_or_damaged_snapshot(storage):
    m = SnapshotManager(storage, retention=Retention(keep_last=1))
    save(m, 1, 1)
    storage.write_bytes("step-000001/manifest.json", b"{ truncated")
    save(m, 2, 2)
    storage.rm("step-000002/state.pt")  # damaged: a file is missing
    save(m, 3, 3)
    save(m, 4, 4)
    assert [(i.step, i.usable) for i in m.catalog.scan()] == [(1, False), (2, False), (4, True)]


def test_world_size_and_topology_are_read_from_a_checked_manifest(storage):
    m = SnapshotManager(storage)
    save(m, 1, 1)
    manifest = orjson.loads(storage.read_bytes("step-000001/manifest.json"))
    storage.write_bytes("step-000001/manifest.json", orjson.dumps({**manifest, "step": 7}))
    (info,) = m.catalog.scan()
    assert info.problem == "its manifest is of step 7, not of step 1" and not info.unreadable
    storage.write_bytes("step-000001/manifest.json", orjson.dumps({**manifest, "format": 2}))
    (info,) = m.catalog.scan()
    assert info.problem == "manifest format 2; this rlctl reads format 1" and not info.unreadable
    assert m.catalog.remove_uncommitted() == [] and storage.exists(
        "step-000001", MANIFEST
    )  # a newer rlctl's: left alone


# -- verify: every sha256, on every storage --------------------------------------------------------------
@pytest.mark.slow
def test_verify_finds_a_flipped_byte_on_s3(s3_env):
    env, opts = s3_env
    storage = Storage(f"s3://rlctl-runs/verify-{uuid.uuid4().hex}/ckpt", opts)
    m = SnapshotManager(storage)
    save(m, 1, 1)
    save(m, 2, 2)
    path = storage.path("step-000002", "blob", "blob.bin")
    data = bytearray(storage.fs.cat_file(path))
    data[500] ^= 0x01
    storage.fs.pipe_file(path, bytes(data))  # same size, one bit off
    assert [i.problem for i in m.catalog.scan()] == [None, None]  # sizes agree: only the sha256 can tell
    assert [i.problem for i in m.catalog.scan(deep=True)] == [
        None,
        "file blob/blob.bin does not match its sha256 (corrupt)",
    ]


# -- lease ------------------------------------------------------------------------------------------
def test_second_writer_is_refused_while_the_lease_is_live(tmp_path):
    run = Storage(str(tmp_path))
    with Lease(run).acquire(), pytest.raises(LeaseError, match="is being written by .* pid"):
        Lease(run).acquire(force=True)  # --force never takes a live lease
    assert not run.exists(LEASE_FILE)  # released


def test_dead_owner_on_this_host_is_taken_over(tmp_path):
    run = Storage(str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    run.write_bytes(
        LEASE_FILE,
        orjson.dumps({"owner": "x", "host": socket.gethostname(), "pid": int(gone.stdout), "heartbeat": time.time()}),
    )
    lease = Lease(run).acquire()
    assert lease.taken_over["owner"] == "x"
    lease.release()


def test_stale_lease_from_another_host_needs_force(tmp_path):
    run = Storage(str(tmp_path))
    run.write_bytes(
        LEASE_FILE, orjson.dumps({"owner": "y", "host": "elsewhere", "pid": 1, "heartbeat": time.time() - 600})
    )
    with pytest.raises(LeaseError, match="stale lease .* --force"):
        Lease(run, timeout=120).acquire()
    lease = Lease(run, timeout=120).acquire(force=True)
    assert lease.taken_over["host"] == "elsewhere"
    lease.release()


def test_heartbeat_renews_and_detects_loss(tmp_path):
    run = Storage(str(tmp_path))
    lease = Lease(run, heartbeat=0.05).acquire()
    first = read_lease(run)["heartbeat"]
    deadline = time.time() + 10  # (polled: a loaded machine may run the heartbeat thread late)
    while read_lease(run)["heartbeat"] <= first and time.time() < deadline:
        time.sleep(0.02)
    assert read_lease(run)["heartbeat"] > first
    run.write_bytes(LEASE_FILE, orjson.dumps({"owner": "thief", "host": "h", "pid": 1, "heartbeat": time.time()}))
    deadline = time.time() + 10
    while not lease.lost and time.time() < deadline:
        time.sleep(0.02)
    assert lease.lost
    lease.release()
    assert orjson.loads(run.read_bytes(LEASE_FILE))["owner"] == "thief"  # not ours to delete


def test_concurrent_takeover_has_one_winner(tmp_path):
    run = Storage(str(tmp_path))
    run.write_bytes(LEASE_FILE, orjson.dumps({"owner": "old", "host": "elsewhere", "pid": 1, "heartbeat": 0}))
    winners, errors = [], []

    def take():
        try:
            winners.append(Lease(run).acquire(force=True))  # (the old lease is stale under any timeout)
        except LeaseError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(errors) == 3
    winners[0].release()


def test_each_rank_fetches_and_checks_only_shared_files_and_its_own(tmp_path, monkeypatch):
    """Two ranks (threads) commit one snapshot to object-like storage. At restore each rank downloads
    and hashes only the shared files and its own; a corrupt file of rank 1 fails rank 1's check alone
    (in a real run the ranks then agree to skip the snapshot)."""
    from rlctl.engine.ds_module import files_of_rank

    storage = Storage(f"memory://test-{uuid.uuid4().hex}/ckpt")
    meet = threading.Barrier(2)
    managers = [SnapshotManager(storage, world_size=2, rank=r, collectives=Local(meet.wait)) for r in (0, 1)]

    def save_rank(r):
        managers[r].save(1, {"counter": Number(10 + r)}, {"blob": Blob(b"\x01" * 100)}, good=True)  # same bytes
        managers[r].wait()

    threads = [threading.Thread(target=save_rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = managers[0].catalog.scan()[0]
    files = sorted(info.manifest["files"])
    assert {"state.pt", "state.rank-1.pt", "ranks/rank-1.json"} <= set(files)
    assert files_of_rank(files, 0) == [f for f in files if f not in ("state.rank-1.pt", "ranks/rank-1.json")]
    assert "state.pt" not in files_of_rank(files, 1) and "state.rank-1.pt" in files_of_rank(files, 1)
    assert files_of_rank(
        ["a/zero_pp_rank_1_mp_rank_00_optim_states.pt", "a/zero_pp_rank_10_x.pt", "a/mp_rank_00_model_states.pt"], 1
    ) == ["a/zero_pp_rank_1_mp_rank_00_optim_states.pt", "a/mp_rank_00_model_states.pt"]

    fetched = []
    get_file = storage.fs.get_file  # (fsspec shares one memory filesystem: patched for this test only)
    monkeypatch.setattr(
        storage.fs,
        "get_file",
        lambda src, dst, **kw: (fetched.append(src.rsplit("step-000001/", 1)[-1]), get_file(src, dst, **kw)),
    )
    counters = [Number(), Number()]
    managers[0].restore(info, {"counter": counters[0]}, {"blob": Blob()})
    assert sorted(fetched) == files_of_rank(files, 0)
    managers[1].restore(managers[1].catalog.scan()[0], {"counter": counters[1]}, {"blob": Blob()})
    assert [c.value for c in counters] == [10, 11]

    storage.write_bytes("step-000001/state.rank-1.pt", b"X" * info.manifest["files"]["state.rank-1.pt"]["size"])
    managers[0].restore(managers[0].catalog.scan()[0], {"counter": Number()}, {"blob": Blob()})  # rank 0 never reads it
    with pytest.raises(SnapshotError, match="state.rank-1.pt does not match its sha256"):
        managers[1].restore(managers[1].catalog.scan()[0], {"counter": Number()}, {"blob": Blob()})


def test_device_tensors_go_to_the_writer_as_host_copies_that_keep_their_views():
    """What the writer is handed of a device tensor: a view of a shared-memory copy of its storage, one
    copy per storage (here on CPU, the code is the same for any device)."""
    import torch

    from rlctl.checkpoint.handover import HostBuffers, HostCopies

    flat = torch.arange(12, dtype=torch.float32)
    a, b = flat[2:6], flat.view(3, 4)[1:, ::2]
    copies = HostCopies(HostBuffers())
    ha, hb = copies.of(a), copies.of(b)
    assert torch.equal(ha, a) and torch.equal(hb, b) and hb.stride() == b.stride()
    assert ha.untyped_storage().data_ptr() == hb.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert ha.untyped_storage().is_shared() and len(copies._lent) == 1
    flat.zero_()  # a copy: the live tensor moves on
    assert ha[0].item() == 2.0
    # empty storages all sit at address 0 (ZeRO-3's partitioned parameters): never taken for one another
    e1, e2 = torch.empty(0, dtype=torch.float16), torch.empty(0, dtype=torch.int64)
    assert copies.of(e1).dtype == torch.float16 and copies.of(e2).dtype == torch.int64


def test_host_copies_reuse_their_buffers_from_one_snapshot_to_the_next_but_never_lend_one_twice():
    """Snapshot staging (issue 40, item 4): the buffers a job's device storages were copied into go back
    to the pool once the writer has staged them, and the next job of the same sizes gets the same pages,
    filled with the new values; a buffer still lent to a job in flight is never handed to another."""
    import torch

    from rlctl.checkpoint.handover import HostBuffers, HostCopies

    pool = HostBuffers()
    weights, moments = torch.arange(8, dtype=torch.float32), torch.ones(3, dtype=torch.float64)
    first = HostCopies(pool)
    w1, m1 = first.of(weights), first.of(moments)
    addresses = {w1.untyped_storage().data_ptr(), m1.untyped_storage().data_ptr()}
    other = HostCopies(pool)  # another manager's job while the first is in flight: its own buffers
    assert other.of(weights).untyped_storage().data_ptr() not in addresses
    first.release()
    assert pool.free_bytes() == weights.nbytes + moments.nbytes
    weights.mul_(2)
    second = HostCopies(pool)
    w2, m2 = second.of(weights), second.of(moments)
    assert {w2.untyped_storage().data_ptr(), m2.untyped_storage().data_ptr()} == addresses
    assert torch.equal(w2, weights) and torch.equal(m2, moments) and pool.free_bytes() == 0
    second.release()
    second.release()  # (given back once: the writer's staged and its end both give back)
    assert pool.free_bytes() == weights.nbytes + moments.nbytes


@pytest.mark.gpu
def test_cuda_storages_are_staged_in_pinned_shared_buffers_on_a_side_stream():
    """On CUDA the staging buffers are page-locked in shared memory and reused, and the side stream's
    copies see what the training stream computed just before the snapshot."""
    import torch

    from rlctl.checkpoint.handover import HostBuffers, HostCopies

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pool, live = HostBuffers(), torch.zeros(1 << 20, device="cuda")
    for value in (1.0, 2.0):
        live.add_(value)  # queued on the training stream: the copy must wait for it
        copies = HostCopies(pool)
        host = copies.of(live)
        copies.wait()
        assert host.is_pinned() and host.untyped_storage().is_shared()
        assert torch.equal(host, live.cpu())
        copies.release()
    assert pool.free_bytes() == live.nbytes


def ignored(pid, sig) -> bool:
    with open(f"/proc/{pid}/status") as fh:
        mask = next(int(line.split()[1], 16) for line in fh if line.startswith("SigIgn:"))
    return bool(mask & (1 << (sig - 1)))


def test_the_writer_process_leaves_stop_signals_to_the_trainer(tmp_path):
    """A stop signal sent to the whole process group (Slurm, Ctrl-C) reaches the writer too: it keeps
    running, so the trainer's last snapshot can still be written by it."""
    import signal

    from rlctl.checkpoint.writer import writer

    m = SnapshotManager(Storage(str(tmp_path / "ckpt")))
    m.start_writer()
    pid = writer().pid
    deadline = time.time() + 60  # until it has set its dispositions (/proc/PID/status SigIgn)
    while time.time() < deadline and not ignored(pid, signal.SIGUSR1):
        time.sleep(0.01)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        os.kill(pid, sig)
    time.sleep(0.5)
    assert writer().alive() and writer().pid == pid
    m.save(1, {"counter": Number(1)}, {"blob": DeferredBlob(b"x" * 100)}, good=True)
    assert m.wait() is True and writer().pid == pid


def test_state_that_does_not_fit_in_shared_memory_is_written_in_the_thread_and_said_once(tmp_path, monkeypatch):
    """Too small a /dev/shm (a real 64 KiB tmpfs stands for it) is found before any storage is moved
    there: the snapshot is written by the thread instead, commits, restores, and the run hears it once."""
    import rlctl.checkpoint.handover as process

    with small_tmpfs(tmp_path / "shm") as shm:
        monkeypatch.setattr(process, "SHM_DIR", str(shm))
        events = []
        m = SnapshotManager(Storage(str(tmp_path / "ckpt")), on_event=events.append)
        for step in (1, 2):
            blob = DeferredBlob(bytes([step]) * (256 << 10))
            m.save(step, {"counter": Number(step)}, {"blob": blob}, good=True)
            assert m.wait() is True
        fallbacks = [e for e in events if e["event"] == "snapshot_writer_fallback"]
        assert len(fallbacks) == 1 and f"{shm} has 0 MiB free" in fallbacks[0]["reason"]
        restored = DeferredBlob()
        m.restore(m.catalog.scan()[-1], {"counter": Number()}, {"blob": restored})
        assert restored.data == bytes([2]) * (256 << 10)
