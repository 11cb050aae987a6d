"""The storage error taxonomy, its retry budget, the fence around the global random stream, the
streaming sha256, and the lease: malformed lease.json, a heartbeat that survives errors, fencing."""

import errno
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import orjson
import pytest
from conftest import refused_port

from rlctl.errors import ConfigError, ExitCode, LeaseError, StorageError
from rlctl.rundir import lease as lease_mod
from rlctl.rundir.layout import BEAT_DIR, LEASE_FILE, beat_file
from rlctl.rundir.lease import Lease, lease_state, read_lease
from rlctl.storage import Storage, describe, guarded, is_transient

from helpers import invoke, small_tmpfs


def _dead_s3(retry_timeout: float, **config) -> Storage:
    """An S3 storage whose endpoint is a closed port on loopback (every request is refused)."""
    endpoint = f"http://127.0.0.1:{refused_port()}"
    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "k", "secret": "s", "skip_instance_cache": True}
    if config:
        opts["config_kwargs"] = config
    return Storage("s3://rlctl-dead/run", opts, retry_timeout=retry_timeout)


def _one_sentence(err: StorageError, url: str, code: ExitCode = ExitCode.STORAGE) -> str:
    text = err.message
    assert "\n" not in text and url in text and text.startswith("cannot "), text
    assert err.exit_code == code
    return text


# -- the taxonomy on a real local disk ---------------------------------------------------------------


def test_absence_passes_through(tmp_path):
    st = Storage(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        st.read_bytes("missing")
    with pytest.raises(FileNotFoundError):
        st.size("missing")
    assert st.listdir("missing") == [] and not st.exists("missing")
    st.write_bytes("lock", b"1", exclusive=True)
    with pytest.raises(FileExistsError):
        st.write_bytes("lock", b"2", exclusive=True)
    assert st.read_bytes("lock") == b"1"


def test_a_file_where_a_directory_should_be_fails_at_once_with_a_sentence(tmp_path):
    (tmp_path / "run").write_bytes(b"not a directory")
    st = Storage(str(tmp_path / "run"), retry_timeout=30)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        st.write_bytes("metrics.jsonl", b"{}\n")
    assert time.monotonic() - t0 < 5, "a permanent failure must not be retried"
    text = _one_sentence(info.value, str(tmp_path / "run" / "metrics.jsonl"))
    assert text.startswith("cannot write ") and ("not a directory" in text or "file exists" in text), text
    with pytest.raises(StorageError, match="not a directory"):
        st.read_bytes("metrics.jsonl")
    with pytest.raises(StorageError, match="cannot append to"):
        st.append_bytes("events.jsonl", b"{}\n")


REFUSAL = "; a refusal, not an outage: no retry mends it; check the location, its permissions and the credentials"


def test_permission_denied_or_read_only(tmp_path):
    """EACCES where file modes bind (not root), else EROFS on a read-only tmpfs (root): a refusal (exit
    13), which no requeue mends."""
    if os.geteuid() != 0:
        (tmp_path / "ro").mkdir()
        os.chmod(tmp_path / "ro", 0o555)
        where, cause = tmp_path / "ro", "permission denied"
    else:
        with small_tmpfs(tmp_path / "ro") as mnt:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            where, cause = mnt, "read-only file system"
            with pytest.raises(StorageError) as info:
                Storage(str(where), retry_timeout=30).write_bytes("manifest.json", b"{}")
        text = _one_sentence(info.value, str(where / "manifest.json"), ExitCode.STORAGE_REFUSED)
        assert text == f"cannot write {where / 'manifest.json'}: {cause}{REFUSAL}"
        return
    with pytest.raises(StorageError) as info:
        Storage(str(where), retry_timeout=30).write_bytes("manifest.json", b"{}")
    assert info.value.message == f"cannot write {where / 'manifest.json'}: {cause}{REFUSAL}"
    assert info.value.exit_code == ExitCode.STORAGE_REFUSED


def test_no_space_left_is_named_and_leaves_nothing_half_written(tmp_path):
    with small_tmpfs(tmp_path / "small", size="64k") as mnt:
        st = Storage(str(mnt), retry_timeout=30)
        st.append_bytes("metrics.jsonl", b'{"step": 1}\n')
        t0 = time.monotonic()
        with pytest.raises(StorageError) as info:
            st.append_bytes("metrics.jsonl", b"x" * (256 << 10))
        assert time.monotonic() - t0 < 5
        assert info.value.message == f"cannot append to {mnt / 'metrics.jsonl'}: no space left on device"
        assert st.read_bytes("metrics.jsonl") == b'{"step": 1}\n', "a failed append is cut back"
        with pytest.raises(StorageError, match="no space left on device"):
            st.write_bytes("big.bin", b"y" * (256 << 10))
        assert sorted(os.listdir(mnt)) == ["metrics.jsonl"], "no temporary left behind"


# -- classification of real third-party exceptions ---------------------------------------------------


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": f"{code} says no"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


def test_transient_and_permanent_failures():
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError
    from s3fs.errors import translate_boto_error

    url = "http://127.0.0.1:5555/b/k"
    transient = [
        EndpointConnectionError(endpoint_url=url),
        ReadTimeoutError(endpoint_url=url),
        ConnectionClosedError(endpoint_url=url),
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        OSError(errno.ETIMEDOUT, "Connection timed out"),
        TimeoutError(),
        _client_error("SlowDown", 503),
        translate_boto_error(_client_error("SlowDown", 503)),  # as s3fs raises it: OSError(EBUSY) from it
        translate_boto_error(_client_error("InternalError", 500)),
    ]
    permanent = [
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(errno.EACCES, "Permission denied"),
        OSError(errno.EROFS, "Read-only file system"),
        translate_boto_error(_client_error("AccessDenied", 403)),
        _client_error("NoSuchBucket", 404),
        _client_error("InvalidArgument", 400),
    ]
    assert [is_transient(e) for e in transient] == [True] * len(transient)
    assert [is_transient(e) for e in permanent] == [False] * len(permanent)
    assert describe(transient[0]) == "endpoint http://127.0.0.1:5555 unreachable (EndpointConnectionError)"
    assert describe(transient[1]) == "endpoint http://127.0.0.1:5555 timed out (ReadTimeoutError)"
    assert describe(permanent[0]) == "no space left on device"
    assert describe(permanent[3]) == "AccessDenied says no (AccessDenied, HTTP 403)"


def test_a_response_body_cut_short_by_a_dying_server_is_transient_not_an_http_400():
    """A server killed while it sends a body: aiohttp's parser raises ContentLengthError (whose ``code``
    is 400) and sets it as the cause of the ClientPayloadError the client sees. It is the network's
    failure, retried as one, never the service's answer 400."""
    from aiohttp import ClientPayloadError, ClientResponseError
    from aiohttp.http_exceptions import ContentLengthError

    cut = ContentLengthError("Not enough data to satisfy content length header (received 0 of 319 bytes)")
    try:
        try:
            raise cut
        except ContentLengthError as underlying:
            raise ClientPayloadError(f"Response payload is not completed: {underlying!r}") from underlying
    except ClientPayloadError as seen:
        wrapped = seen
    assert is_transient(wrapped) and is_transient(cut)
    assert "HTTP 400" not in describe(wrapped) and "HTTP 400" not in describe(cut)
    answered = ClientResponseError(None, (), status=403, message="Forbidden")
    assert not is_transient(answered) and describe(answered) == "Forbidden (HTTP 403)"


def test_transient_failures_are_retried_then_succeed_and_permanent_ones_are_not():
    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return "ok"

    assert guarded("read", "s3://b/k", flaky, budget=10) == "ok" and len(calls) == 3
    assert calls[1] - calls[0] >= 0.1 and calls[2] - calls[1] >= 0.2  # backed off, longer each time
    calls.clear()

    def full():
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageError, match=r"^cannot write s3://b/k: no space left on device$"):
        guarded("write", "s3://b/k", full, budget=10)
    assert calls == [1]
    with pytest.raises(FileNotFoundError):
        guarded("read", "s3://b/k", lambda: (_ for _ in ()).throw(FileNotFoundError("k")), budget=10)


def test_a_bug_in_the_calling_code_is_not_called_a_storage_error():
    """A TypeError of rlctl's own making keeps its traceback (exit 1); an error raised inside a
    filesystem (fsspec's registry here) is the storage's."""
    with pytest.raises(TypeError):
        guarded("read", "s3://b/k", lambda: len(3), budget=10)
    import fsspec

    with pytest.raises(StorageError, match="^cannot open nosuch://x: "):
        guarded("open", "nosuch://x", lambda: fsspec.filesystem("nosuch"), budget=10)


# -- an unreachable object store: a sentence within the budget, and the run's RNG untouched ---------


@pytest.mark.slow
def test_dead_endpoint_ends_in_one_sentence_within_the_budget():
    st = _dead_s3(retry_timeout=1.5)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        st.exists("lease.json")
    took = time.monotonic() - t0
    assert 1.5 <= took < 8, took
    text = _one_sentence(info.value, "s3://rlctl-dead/run/lease.json")
    assert "unreachable (EndpointConnectionError); gave up after" in text, text
    with pytest.raises(StorageError, match=r"^cannot write s3://rlctl-dead/run/m\.jsonl: endpoint"):
        st.child().with_retry_timeout(0).write_bytes("m.jsonl", b"{}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["standard", "legacy"])
def test_storage_retries_never_draw_from_the_global_random_stream(mode):
    """botocore's retry jitter (``random.random`` in retryhandler and retries.standard) would advance
    Python's global generator during an outage, and with it the run's saved RNG state."""
    st = _dead_s3(retry_timeout=1.0, retries={"total_max_attempts": 3, "mode": mode}, connect_timeout=1)
    random.seed(1234)
    before = random.getstate()
    with pytest.raises(StorageError, match="unreachable"):
        st.read_bytes("rng.bin")
    assert random.getstate() == before


def test_the_client_is_made_to_fail_fast_unless_configured():
    st = _dead_s3(retry_timeout=0)
    assert st.fs.config_kwargs["connect_timeout"] == 5 and st.fs.config_kwargs["read_timeout"] == 60
    assert st.fs.config_kwargs["retries"]["total_max_attempts"] == 1 and st.fs.retries == 1
    mine = _dead_s3(retry_timeout=0, read_timeout=7)
    assert mine.fs.config_kwargs["read_timeout"] == 7 and mine.fs.config_kwargs["connect_timeout"] == 5


# -- sha256 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_sha256_streams_any_backend(tmp_path, scheme):
    url = str(tmp_path) if scheme == "local" else f"memory://rlctl-sha-{os.getpid()}"
    st = Storage(url)
    data = os.urandom((4 << 20) + 12345)  # more than one chunk
    st.write_bytes("w/model.bin", data)
    assert st.sha256("w", "model.bin") == hashlib.sha256(data).hexdigest()
    with pytest.raises(FileNotFoundError):
        st.sha256("w", "missing.bin")


# -- lease.json of the wrong shape -------------------------------------------------------------------

BAD_LEASES = [
    b"[1, 2]",
    b'"a string"',
    b"42",
    b"{}",
    b"not json {",
    b'{"owner": "x", "host": "HOST", "pid": 12}',
    b'{"owner": "x", "host": "HOST", "pid": "abc", "heartbeat": NOW}',
    b'{"owner": "x", "host": "HOST", "pid": -1, "heartbeat": NOW}',
    b'{"owner": "x", "host": "HOST", "pid": true, "heartbeat": NOW}',
    b'{"owner": "x", "host": "HOST", "pid": 12, "heartbeat": "yesterday"}',
]


@pytest.mark.parametrize("raw", BAD_LEASES, ids=range(len(BAD_LEASES)))
def test_a_malformed_lease_reads_as_stale_and_is_named(tmp_path, monkeypatch, raw):
    killed = []
    real_kill = os.kill
    monkeypatch.setattr(lease_mod.os, "kill", lambda pid, sig: killed.append(pid) or real_kill(pid, sig))
    raw = raw.replace(b"HOST", socket.gethostname().encode()).replace(b"NOW", str(time.time()).encode())
    st = Storage(str(tmp_path))
    st.write_bytes(LEASE_FILE, raw)
    held = read_lease(st)
    assert held["_malformed"] and lease_state(held, timeout=120) == "stale"
    with pytest.raises(LeaseError) as info:
        Lease(st).acquire()
    assert f"{st.url_of(LEASE_FILE)} is not a lease record" in info.value.message
    assert "--force" in info.value.message and "\n" not in info.value.message
    with Lease(st, heartbeat=60).acquire(force=True) as lease:
        assert lease.held and lease.taken_over["_malformed"] == held["_malformed"]
    assert all(pid > 0 for pid in killed), f"os.kill called with {killed}"


def test_pid_alive_never_signals_a_process_group():
    assert lease_mod._pid_alive(-1) and lease_mod._pid_alive(0)  # never "provably gone", never os.kill'd


# -- the heartbeat survives errors; fencing ----------------------------------------------------------


def _heartbeat_of(st: Storage) -> float:
    return read_lease(st)["heartbeat"]


def _is_beat(rel: str) -> bool:
    return rel.startswith(f"{BEAT_DIR}/beat-")


def _until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _failing_writes(st: Storage, monkeypatch, errors):
    """Make the lease's renewals fail (cycling through ``errors``) while the returned event is set."""
    failing = threading.Event()
    real = Storage.write_bytes
    n = iter(range(10**9))

    def write_bytes(self, rel, data, exclusive=False):
        if failing.is_set() and _is_beat(rel):
            raise errors[next(n) % len(errors)]
        return real(self, rel, data, exclusive)

    monkeypatch.setattr(Storage, "write_bytes", write_bytes)
    return failing


@pytest.mark.slow
def test_heartbeat_survives_a_short_outage_then_renews(tmp_path, monkeypatch):
    st = Storage(str(tmp_path))
    failing = _failing_writes(st, monkeypatch, [StorageError("cannot write x: endpoint unreachable"), KeyError("boom")])
    lease = Lease(st, timeout=4.0, heartbeat=0.05).acquire()  # (seconds of margin: fsyncs stall here)
    try:
        failing.set()
        assert _until(lambda: lease.last_error is not None)
        stalled = _heartbeat_of(st)
        time.sleep(1.0)  # well under the timeout: many beats fail, with both kinds of error
        assert lease._thread.is_alive() and lease.held and _heartbeat_of(st) == stalled
        lease.check()
        failing.clear()
        assert _until(lambda: _heartbeat_of(st) > stalled and lease.last_error is None)
        time.sleep(3.5)  # beyond the timeout since the outage began: the renewals count
        assert lease.held and lease._thread.is_alive()
        lease.check()
    finally:
        lease.release()
    assert not st.exists(LEASE_FILE)


def test_no_renewal_within_the_timeout_loses_the_lease(tmp_path, monkeypatch):
    st = Storage(str(tmp_path))
    failing = _failing_writes(st, monkeypatch, [StorageError("cannot write x: endpoint unreachable")])
    lease = Lease(st, timeout=0.5, heartbeat=0.05).acquire()
    failing.set()
    assert _until(lambda: not lease.held, timeout=5)
    with pytest.raises(StorageError) as info:  # renewals the storage failed: an outage, not a takeover
        lease.check()
    text = info.value.message
    assert info.value.exit_code == ExitCode.STORAGE
    assert text.startswith(f"cannot renew the lease of {st.url}: no heartbeat succeeded for ")
    assert "last error: cannot write x: endpoint unreachable" in text
    assert text.endswith(
        "; stopped before writing (the storage failed, no other writer was seen: resume the run once it is back)"
    )
    failing.clear()
    time.sleep(0.2)
    assert not lease.held, "a lost lease stays lost"
    lease.release()
    assert st.exists(LEASE_FILE), "a lost lease may be someone else's now: never removed"


@pytest.mark.slow
def test_check_fences_even_while_the_heartbeat_is_stuck(tmp_path, monkeypatch):
    st = Storage(str(tmp_path))
    stuck = threading.Event()
    real = Storage.write_bytes

    def write_bytes(self, rel, data, exclusive=False):
        if stuck.is_set() and _is_beat(rel):
            time.sleep(5.0)  # a call hanging on a dead endpoint
        return real(self, rel, data, exclusive)

    monkeypatch.setattr(Storage, "write_bytes", write_bytes)
    lease = Lease(st, timeout=0.4, heartbeat=0.05).acquire()
    stuck.set()
    time.sleep(1.5)  # (a beat begun just before the hang may still land: room for a loaded machine)
    with pytest.raises(LeaseError, match="no heartbeat succeeded"):
        lease.check()
    lease.release()


def test_another_owner_seen_loses_the_lease(tmp_path):
    st = Storage(str(tmp_path))
    lease = Lease(st, timeout=30, heartbeat=0.05).acquire()
    theirs = {"owner": "someone-else", "host": "elsewhere", "pid": 4242, "heartbeat": time.time()}
    st.write_bytes(LEASE_FILE, json.dumps(theirs).encode())
    assert _until(lambda: not lease.held)
    with pytest.raises(LeaseError, match=r"now names another writer \(elsewhere pid 4242"):
        lease.check()
    time.sleep(0.2)
    assert orjson.loads(st.read_bytes(LEASE_FILE))["owner"] == "someone-else", "never written over"
    lease.release()
    assert st.exists(LEASE_FILE)


def test_a_takeover_between_a_renewals_read_and_its_write_is_never_written_over(tmp_path, monkeypatch):
    """The race a read-then-write renewal of lease.json loses: the renewal reads its own lease, another
    writer takes the run over, and the renewal writes. Renewals write only the owner's beat file, so the
    new owner's lease.json stands and the next beat sees it."""
    st = Storage(str(tmp_path))
    theirs = {"owner": "thief", "host": "elsewhere", "pid": 4242, "heartbeat": time.time()}
    real_read = lease_mod.read_lease
    raced = threading.Event()

    def read_then_taken_over(storage):
        held = real_read(storage)
        if not raced.is_set() and held is not None and held.get("owner") == lease.owner:
            raced.set()
            st.write_bytes(LEASE_FILE, orjson.dumps(theirs))  # after our read, before our write
        return held

    lease = Lease(st, timeout=30, heartbeat=0.05)
    monkeypatch.setattr(lease_mod, "read_lease", read_then_taken_over)
    lease.acquire()
    assert _until(raced.is_set) and _until(lambda: not lease.held)
    assert orjson.loads(st.read_bytes(LEASE_FILE)) == theirs, "the renewal wrote over the new owner's lease"
    with pytest.raises(LeaseError, match="now names another writer"):
        lease.check()
    lease.release()
    assert orjson.loads(st.read_bytes(LEASE_FILE)) == theirs


def test_the_heartbeat_lives_beside_the_lease_and_both_go_on_release(tmp_path):
    st = Storage(str(tmp_path))
    lease = Lease(st, timeout=30, heartbeat=0.05).acquire()
    taken = orjson.loads(st.read_bytes(LEASE_FILE))
    assert _until(lambda: _heartbeat_of(st) > taken["heartbeat"])
    assert orjson.loads(st.read_bytes(LEASE_FILE)) == taken, "lease.json is never rewritten while held"
    st.write_bytes(beat_file(lease.owner), b"not json")  # a damaged beat file reads as no beat
    assert read_lease(st)["heartbeat"] >= taken["heartbeat"]
    lease.release()
    assert not st.exists(LEASE_FILE) and not st.exists(beat_file(lease.owner))


def test_heartbeat_survives_a_real_read_only_disk(tmp_path):
    """A real outage of a local disk: the filesystem turns read-only (EROFS) for less than the timeout."""
    with small_tmpfs(tmp_path / "run", size="1m") as mnt:
        st = Storage(str(mnt))
        lease = Lease(st, timeout=3.0, heartbeat=0.05).acquire()
        try:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            assert _until(lambda: lease.last_error is not None)
            assert "read-only file system" in lease.last_error and lease.held
            stalled = _heartbeat_of(st)
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
            assert _until(lambda: _heartbeat_of(st) > stalled and lease.last_error is None)
            lease.check()
        finally:
            lease.release()


@pytest.mark.parametrize(("url", "extra"), [("gs://bucket/run", "gcs"), ("az://container/run", "azure")])
def test_a_store_whose_filesystem_is_not_installed_names_the_extra(url, extra, monkeypatch):
    """A missing filesystem package is an installation to change (exit 3), not a store to wait for (12).
    The package is installed here (the tests use it): it is made unimportable, as where it is missing, and
    fsspec forgets any class of it already imported."""
    import importlib

    known = importlib.import_module("fsspec.registry")._registry  # (fsspec.registry: its read-only view)
    package, protocols = {"gcs": ("gcsfs", ("gs", "gcs")), "azure": ("adlfs", ("az", "abfs", "abfss"))}[extra]
    monkeypatch.setitem(sys.modules, package, None)  # `import gcsfs` raises ImportError
    for protocol in protocols:
        monkeypatch.delitem(known, protocol, raising=False)
    with pytest.raises(
        ConfigError, match=rf"{url}: \w+:// storage is not installed here: pip install 'rlctl\[{extra}\]'"
    ):
        Storage(url)
    r = invoke("inspect", url)
    assert r.returncode == ExitCode.CONFIG and f"pip install 'rlctl[{extra}]'" in r.stderr
