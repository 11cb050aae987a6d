"""One outage deadline for every writer of a process (rlctl/storage/outages.py, rlctl/storage/failures.py): an outage of a store
begins with the first attempt that fails (never before the store last answered) and ends with its next
answer; every retry loop gives up once its budget has passed since the outage began, so writers that
meet it one after another never add up their budgets; the run's fence (the lease's check) ends the run
with exit 12 once any store has been out for the budget, and a lease whose renewals the storage failed
is an outage (12), not a takeover (10).

The failures are real: an S3 endpoint on a closed loopback port refuses every connection."""

import gc
import pickle
import re
import sys
import time

import pytest
from conftest import refused_port

from rlctl.errors import ExitCode, StorageError
from rlctl.metrics import JsonlLog
from rlctl.rundir.lease import Lease, owner_fence
from rlctl.storage import Storage
from rlctl.storage.failures import guarded, note_outage
from rlctl.storage.outages import OUTAGES, Outage, Outages, store_of


@pytest.fixture(autouse=True)
def no_outage_left():
    """The process's outage clocks are global: no test sees another's."""
    OUTAGES.clear()
    yield
    OUTAGES.clear()


def _refused(bucket: str, retry_timeout: float) -> Storage:
    """An S3 storage in ``bucket`` whose endpoint is a refused port on loopback (every request is refused)."""
    port = refused_port()
    opts = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}, "key": "k", "secret": "s"}
    return Storage(f"s3://{bucket}/run", {**opts, "skip_instance_cache": True}, retry_timeout=retry_timeout)


def _timed(fn) -> tuple[float, BaseException]:
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        fn()
    return time.monotonic() - t0, info.value


# -- the clock ---------------------------------------------------------------------------------------


def test_an_outage_is_one_per_store_begins_with_its_first_failure_and_ends_with_an_answer():
    clock, url, t = Outages(), "s3://bucket-a/run/metrics.jsonl", time.monotonic()
    first = clock.failed(url, "append to", "it failed", tried=t)
    later = clock.failed("s3://bucket-a/run/.lease/beat-x", "write", "reset", tried=t + 3)
    assert first.since == later.since == t and later.failure == "cannot write s3://bucket-a/run/.lease/beat-x: reset"
    other = clock.failed("s3://bucket-b/snaps/step-000002/state.pt", "upload", "reset", tried=t + 2)
    assert other.store == "s3://bucket-b" and other.since == t + 2
    clock.answered("s3://bucket-a/run/config.yaml")
    assert clock.failed(url, "append to", "again", tried=t + 500).since == t + 500, "an answer ended the first"
    assert clock.failed("/local/run/metrics.jsonl", "append to", "EINTR", tried=1.0) is None
    assert [store_of(u) for u in ("s3://b/k", "gs://b", "/tmp/x", "file:///tmp/x", "memory://x/y")] == [
        "s3://b",
        "gs://b",
        None,
        None,
        None,
    ]


def test_an_outage_never_begins_before_the_store_last_answered():
    """A long attempt (a big upload) that fails did not meet an outage as long as itself."""
    clock, url = Outages(), "s3://bucket-a/snaps/step-000010/actor/model.pt"
    before = time.monotonic()
    clock.answered("s3://bucket-a/run/.lease/beat-x")
    outage = clock.failed(url, "upload", "connection reset", tried=before - 600)
    assert before <= outage.since <= time.monotonic()


def test_a_store_met_again_after_a_long_silence_begins_a_new_outage():
    clock, url, t = Outages(), "s3://bucket-a/run/metrics.jsonl", time.monotonic()
    clock.failed(url, "append to", "reset", tried=t)
    assert clock.failed(url, "append to", "reset", tried=t + 500).since == t
    assert clock.failed(url, "append to", "reset", tried=t + 1200).since == t + 1200


def test_overdue_once_the_budget_has_passed_since_the_outage_began():
    clock, url = Outages(), "s3://bucket-a/run/events.jsonl"
    assert clock.overdue(5.0) is None
    clock.failed(url, "append to", "reset", tried=time.monotonic() - 6.0)
    assert clock.overdue(10.0) is None
    late = clock.overdue(5.0)
    assert late is not None and late.store == "s3://bucket-a"
    error = late.error(5.0, "the retry budget (checkpoint.retry_timeout)")
    assert error.exit_code == ExitCode.STORAGE and "\n" not in error.message
    assert error.message.startswith("storage outage: s3://bucket-a has failed for 6 s since ")
    assert (
        "longer than the retry budget (checkpoint.retry_timeout) (5 s); its last failure: cannot append to s3://bucket-a/run/events.jsonl: reset"
        in (error.message)
    )
    clock.answered(url)
    assert clock.overdue(5.0) is None


def test_an_outage_another_process_saw_counts_from_its_start():
    clock, now = Outages(), time.monotonic()
    clock.failed("s3://bucket-a/run/metrics.jsonl", "append to", "reset", tried=now - 1.0)
    clock.note(Outage("s3://bucket-a", now - 9.0, now - 0.5, "cannot upload to s3://bucket-a/snaps"))
    assert clock.overdue(8.0).since == now - 9.0
    assert clock.overdue(8.0).failure == "cannot append to s3://bucket-a/run/metrics.jsonl: reset", (
        "the latest failure is named"
    )


# -- every writer of the process on one deadline ------------------------------------------------------


@pytest.mark.slow
def test_writers_that_meet_one_outage_in_turn_share_its_budget():
    """The old loop gave each call its own budget: a flush, then the flush on the way out, then the
    events' flush, one budget after the other (the run of issue 28 took 241 s to end)."""
    st = _refused("rlctl-one-clock", retry_timeout=1.5)
    first, err = _timed(lambda: st.append_bytes("metrics.jsonl", b'{"step": 1}\n'))
    assert 1.5 <= first < 5, first
    assert err.outage.store == "s3://rlctl-one-clock"
    second, err = _timed(lambda: st.write_bytes("events.jsonl", b"{}\n"))
    assert second < 1.0, f"a second writer retried {second:.1f} s more"
    assert "gave up after 1 attempt in 0 s, s3://rlctl-one-clock having failed since " in err.message
    other, _ = _timed(lambda: _refused("rlctl-other-store", retry_timeout=1.0).read_bytes("config.yaml"))
    assert other >= 1.0, "another store has a clock of its own"


@pytest.mark.slow
def test_a_store_that_answers_ends_the_outage_and_the_next_gets_a_whole_budget():
    st = _refused("rlctl-answered", retry_timeout=1.0)
    _timed(lambda: st.read_bytes("lease.json"))
    assert guarded("read", "s3://rlctl-answered/run/lease.json", lambda: b"{}", budget=1.0) == b"{}"  # it is back
    again, _ = _timed(lambda: st.read_bytes("lease.json"))
    assert again >= 1.0, again


def test_the_outage_a_writer_process_gave_up_on_comes_back_with_its_error():
    st = _refused("rlctl-writer", retry_timeout=0.5)
    _, err = _timed(lambda: st.write_bytes("snaps/state.pt", b"x"))
    OUTAGES.clear()  # (as in the training process, which never met it)
    note_outage(RuntimeError("the snapshot writer process was killed"))
    assert OUTAGES.overdue(0.0) is None, "an error that carries no outage notes none"
    note_outage(pickle.loads(pickle.dumps(err)))  # through the writer's pipe
    assert OUTAGES.overdue(0.5).store == "s3://rlctl-writer"


# -- the fence: exit 12 for an outage, 10 for another writer -----------------------------------------


@pytest.mark.slow
def test_the_fence_ends_the_run_once_any_store_is_out_for_the_budget(tmp_path):
    """The lease's check ends the run with exit 12 whichever writer met the outage (here the snapshots'
    store, not the run's), and lets it go on once the store answers."""
    with Lease(Storage(str(tmp_path), retry_timeout=1.0), timeout=30, heartbeat=0.1).acquire() as lease:
        snapshots = _refused("rlctl-snapshots", retry_timeout=1.0)
        _timed(lambda: snapshots.exists("step-000002", "manifest.json"))
        with pytest.raises(StorageError) as info:
            lease.check()
        assert info.value.exit_code == ExitCode.STORAGE
        # at least the budget (1 s); more when the machine is slow to retry
        assert re.match(r"storage outage: s3://rlctl-snapshots has failed for [1-9]\d* s since ", info.value.message)
        assert "its last failure: cannot check s3://rlctl-snapshots/run/step-000002/manifest.json: endpoint" in (
            info.value.message
        )
        OUTAGES.answered("s3://rlctl-snapshots/run/step-000002/manifest.json")
        lease.check()


def test_a_ranks_fence_ends_it_too(tmp_path):
    """Rank 0 of several writes the run under the driver's lease (``owner_fence``): an outage its own
    writers met ends it with exit 12 as well."""
    run = Storage(str(tmp_path), retry_timeout=0.5)
    with Lease(run, heartbeat=0.1).acquire() as lease:
        fence = owner_fence(run, lease.owner)
        fence()
        _timed(lambda: _refused("rlctl-rank", retry_timeout=0.5).read_bytes("events.jsonl"))
        with pytest.raises(StorageError, match="^storage outage: s3://rlctl-rank has failed for "):
            fence()


def test_an_outage_from_before_the_lease_is_not_the_runs(tmp_path):
    _timed(lambda: _refused("rlctl-before", retry_timeout=0.2).read_bytes("config.yaml"))
    assert OUTAGES.overdue(0.2) is not None
    with Lease(Storage(str(tmp_path), retry_timeout=0.2), heartbeat=0.1).acquire() as lease:
        lease.check()


def test_a_flush_goes_behind_the_fence_and_keeps_its_rows(tmp_path):
    """Rows buffered for an object store are never flushed once the run's outage is overdue (a flush on
    the way out does not wait a budget of its own), and stay buffered."""
    run = Storage(f"memory://rlctl-fenced-{time.monotonic_ns()}", retry_timeout=0.5)
    with Lease(Storage(str(tmp_path), retry_timeout=0.5), heartbeat=0.1).acquire() as lease:
        log = JsonlLog(run, "metrics.jsonl", flush_interval=3600, fence=lease.check)
        log.write({"step": 1})
        _timed(lambda: _refused("rlctl-flush", retry_timeout=0.5).read_bytes("metrics.jsonl"))
        with pytest.raises(StorageError, match="^storage outage: s3://rlctl-flush"):
            log.close()
        assert not run.exists("metrics.jsonl") and log.tell() == len(b'{"step":1}\n')
        OUTAGES.clear()
        log.close()
    assert run.read_bytes("metrics.jsonl") == b'{"step":1}\n'


# -- what a failed attempt leaves behind ---------------------------------------------------------------


def test_a_half_built_append_file_is_never_committed_later(monkeypatch):
    """s3fs's append file fails in its constructor when the store is out; fsspec's finalizer would commit
    it whenever it is collected (an empty object over the real file, or a traceback on stderr from the
    filesystem's event loop). The retry loop closes it first: collecting it does nothing."""
    st = _refused("rlctl-half-built", retry_timeout=0)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    gc.disable()
    try:
        _timed(lambda: guarded("append to", st.url, lambda: st.fs.open(st.path("metrics.jsonl"), "ab"), 0))
        gc.collect()
    finally:
        gc.enable()
    assert not unraisable, [str(u.exc_value) for u in unraisable]
