"""The snapshot commit protocol, discovery, verification, retention and the lease, on real storage
(local disk and fsspec's memory filesystem), with small Stateful objects."""

import os
import subprocess
import sys
import threading
import time
import uuid

import orjson
import pytest

from rlctl.checkpoint.collectives import Local
from rlctl.checkpoint.snapshots import MANIFEST, Retention, SnapshotManager, parse_step_spec, step_name
from rlctl.errors import LeaseError, SnapshotError
from rlctl.rundir.directory import zero_topology
from rlctl.rundir.lease import LEASE_FILE, Lease
from rlctl.storage import Storage, with_retries


class Counter:
    VERSION = 1

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"version": self.VERSION, "value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


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
    manager.save(step, {"counter": Counter(value)}, {"blob": Blob(bytes([value]) * 1000)}, good=good)
    manager.wait()


def test_commit_then_restore(storage):
    events = []
    m = SnapshotManager(storage, on_event=events.append)
    save(m, 5, 7)
    (info,) = m.scan()
    assert info.committed and info.usable and info.step == 5 and info.name == "step-000005"
    manifest = info.manifest
    assert set(manifest["files"]) == {"blob/blob.bin", "state.pt"}
    assert manifest["world_size"] == 1 and manifest["rlctl_version"] and manifest["total_bytes"] > 1000
    counter, blob = Counter(), Blob()
    m.restore(info, {"counter": counter}, {"blob": blob})
    assert counter.value == 7 and blob.data == bytes([7]) * 1000
    assert [e["event"] for e in events] == ["snapshot_committed"]


def test_uncommitted_directory_is_invisible_and_removed(storage):
    m = SnapshotManager(storage)
    save(m, 1, 1)
    storage.write_bytes("step-000002/state.pt", b"half written")
    infos = m.scan()
    assert [(i.step, i.committed) for i in infos] == [(1, True), (2, False)]
    assert [i.step for i in m.candidates("latest")] == [1]
    assert m.remove_uncommitted() == [2]
    assert not storage.exists("step-000002")


def test_corrupt_file_is_caught_by_checksum_and_latest_falls_back(storage):
    m = SnapshotManager(storage)
    save(m, 1, 1)
    save(m, 2, 2)
    path = "step-000002/blob/blob.bin"
    storage.write_bytes(path, b"X" * 1000)  # same size, other bytes
    newest = m.candidates("latest")[0]
    with pytest.raises(SnapshotError, match="blob/blob.bin does not match its sha256"):
        m.restore(newest, {"counter": Counter()}, {"blob": Blob()})
    older = m.candidates("latest")[1]
    counter = Counter()
    m.restore(older, {"counter": counter}, {"blob": Blob()})
    assert counter.value == 1


def test_missing_file_wrong_size_and_wrong_topology(storage):
    m = SnapshotManager(storage)
    save(m, 1, 1)
    save(m, 2, 2)
    save(m, 3, 3)
    storage.rm("step-000001/state.pt")
    storage.write_bytes("step-000002/blob/blob.bin", b"short")
    problems = {i.step: i.problem for i in m.scan()}
    assert problems[1] == "file state.pt is missing"
    assert problems[2] == "file blob/blob.bin has 5 bytes; the manifest says 1000"
    assert problems[3] is None
    two_ranks = SnapshotManager(storage, world_size=2)
    assert two_ranks.scan()[2].problem == "written by 1 rank(s); this run has 2"
    stage3 = SnapshotManager(storage, topology=[zero_topology(3)])
    assert "ZeRO stage None; this run uses stage 3" in stage3.scan()[2].problem


def test_manifest_is_created_exclusively(storage):
    m = SnapshotManager(storage)
    save(m, 4, 4)
    with pytest.raises(SnapshotError, match="committed snapshot of step 4 already exists"):
        m.save(4, {"counter": Counter(9)}, {}, good=True)
    with pytest.raises(FileExistsError):
        storage.write_bytes(f"{step_name(4)}/{MANIFEST}", b"{}", exclusive=True)


def test_async_save_returns_before_commit_and_never_overlaps(storage):
    events = []
    m = SnapshotManager(storage, on_event=events.append)
    m.commit_delay = 0.5
    t0 = time.perf_counter()
    m.save(1, {"counter": Counter(1)}, {}, good=True)
    assert time.perf_counter() - t0 < 0.4  # training went on while the commit waited
    assert not storage.exists("step-000001", MANIFEST)
    m.save(2, {"counter": Counter(2)}, {}, good=True)  # waits for step 1 first
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
    assert [i.step for i in m.scan()] == [10, 20, 25, 30, 35, 36]
    m.retention.protected.add(10)
    m.retention.keep_every = 0
    save(m, 37, 1, good=False)
    assert [i.step for i in m.scan()] == [10, 25, 36, 37]


def test_failed_upload_is_reported_and_never_half_visible(tmp_path):
    class Unwritable(Storage):
        def put_dir(self, local_dir, *parts):
            self.fs.pipe_file(self.path(*parts, "partial"), b"x")
            raise OSError("disk on fire")

    storage = Unwritable(f"memory://fail-{uuid.uuid4().hex}/ckpt")
    events = []
    m = SnapshotManager(storage, on_event=events.append, retry_delay=0.01)
    m.save(3, {"counter": Counter(3)}, {}, good=True)
    assert m.wait() is False
    assert [e["event"] for e in events] == ["snapshot_retry"] * 3 + ["snapshot_failed"]
    assert "disk on fire" in events[-1]["error"]
    assert m.scan() == [] and not storage.exists("step-000003")


def test_with_retries_backs_off_then_succeeds():
    calls = []

    def flaky():
        calls.append(time.perf_counter())
        if len(calls) < 3:
            raise OSError("try again")
        return "ok"

    assert with_retries(flaky, base_delay=0.05) == "ok"
    assert calls[2] - calls[1] > calls[1] - calls[0] >= 0.05


def test_parse_step_spec():
    assert parse_step_spec("latest") == "latest" and parse_step_spec("last-good") == "last-good"
    assert parse_step_spec("step-500") == parse_step_spec("500") == parse_step_spec("step-000500") == 500
    with pytest.raises(SnapshotError, match="--from expects"):
        parse_step_spec("yesterday")


def test_explicit_step_that_does_not_exist(storage):
    m = SnapshotManager(storage)
    save(m, 2, 2)
    with pytest.raises(SnapshotError, match=r"no snapshot of step 3 .*usable steps: 2"):
        m.candidates(3)


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
    first = orjson.loads(run.read_bytes(LEASE_FILE))["heartbeat"]
    time.sleep(0.2)
    assert orjson.loads(run.read_bytes(LEASE_FILE))["heartbeat"] > first
    run.write_bytes(LEASE_FILE, orjson.dumps({"owner": "thief", "host": "h", "pid": 1, "heartbeat": time.time()}))
    deadline = time.time() + 2
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
            winners.append(Lease(run, timeout=1).acquire(force=True))
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
        managers[r].save(1, {"counter": Counter(10 + r)}, {"blob": Blob(b"\x01" * 100)}, good=True)  # same bytes
        managers[r].wait()

    threads = [threading.Thread(target=save_rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = managers[0].scan()[0]
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
    counters = [Counter(), Counter()]
    managers[0].restore(info, {"counter": counters[0]}, {"blob": Blob()})
    assert sorted(fetched) == files_of_rank(files, 0)
    managers[1].restore(managers[1].scan()[0], {"counter": counters[1]}, {"blob": Blob()})
    assert [c.value for c in counters] == [10, 11]

    storage.write_bytes("step-000001/state.rank-1.pt", b"X" * info.manifest["files"]["state.rank-1.pt"]["size"])
    managers[0].restore(managers[0].scan()[0], {"counter": Counter()}, {"blob": Blob()})  # rank 0 never reads it
    with pytest.raises(SnapshotError, match="state.rank-1.pt does not match its sha256"):
        managers[1].restore(managers[1].scan()[0], {"counter": Counter()}, {"blob": Blob()})
