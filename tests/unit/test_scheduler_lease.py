"""The scheduler's job as an owner of a run's lease (rlctl/rundir/lease.py): a lease taken by an earlier run
of the same Slurm job is taken over whatever its host, without --force; another job's, the same run's
(another task of the allocation) and no job's are judged as before; --wait-for-lease waits for a live
lease from another host to go stale, at most trainer.lease_timeout, then takes it over or exits 10."""

import re
import threading
import time

import orjson
import pytest

from rlctl.errors import ExitCode, LeaseError
from rlctl.rundir.layout import LEASE_FILE, beat_file
from rlctl.rundir.lease import Lease, read_lease, scheduler_job
from rlctl.storage import Storage

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT", "SLURM_CLUSTER_NAME")


@pytest.fixture
def in_job(monkeypatch):
    """This process as Slurm's job ``job`` (restart ``restart``, cluster ``c1``)."""
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)

    def enter(job: str = "1234", restart: int | None = 1) -> None:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_CLUSTER_NAME", "c1")
        if restart is not None:
            monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))

    return enter


def job(id_: str = "1234", restart: int = 0, cluster: str = "c1") -> dict:
    return {"scheduler": "slurm", "cluster": cluster, "id": id_, "restart": restart}


def held_by(run: Storage, *, job_field=..., age: float = 1.0, host: str = "dead-node") -> None:
    """lease.json as another host's writer left it, its heartbeat ``age`` seconds old; without ``job_field``
    the file has no "job" key at all (as every lease before the field)."""
    record = {"owner": "ab12", "host": host, "pid": 4242, "heartbeat": time.time() - age}
    if job_field is not ...:
        record["job"] = job_field
    run.write_bytes(LEASE_FILE, orjson.dumps(record))


def test_the_job_is_read_from_slurms_environment():
    assert scheduler_job({}) is None and scheduler_job({"SLURM_JOB_ID": " "}) is None
    assert scheduler_job({"SLURM_JOB_ID": "77"}) == job("77", 0, "")
    env = {"SLURM_JOB_ID": "78", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "2"}
    assert scheduler_job(env) == job("70_3", 2, "")  # an array task by its array job and index
    assert scheduler_job({"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "x", "SLURM_CLUSTER_NAME": "c1"}) == job("9")


def test_the_lease_records_the_job_and_no_job_outside_one(tmp_path, in_job):
    run = Storage(str(tmp_path))
    with Lease(run, heartbeat=60).acquire():
        assert orjson.loads(run.read_bytes(LEASE_FILE))["job"] is None
    in_job("55", restart=3)
    with Lease(run, heartbeat=60).acquire():
        assert orjson.loads(run.read_bytes(LEASE_FILE))["job"] == job("55", 3)


def test_an_earlier_run_of_the_same_job_on_another_host_is_taken_over_without_force(tmp_path, in_job):
    run = Storage(str(tmp_path))
    held_by(run, job_field=job("1234", 0), age=1.0)  # a live heartbeat: the node died a second ago
    in_job("1234", restart=1)
    with Lease(run, timeout=120, heartbeat=60).acquire() as lease:
        assert lease.taken_over["host"] == "dead-node" and lease.taken_over["job"] == job("1234", 0)
        assert lease.takeover_reason == "it was taken by an earlier run of Slurm job 1234 (run 1), which Slurm requeued"
        assert read_lease(run)["owner"] == lease.owner


@pytest.mark.parametrize(
    "theirs",
    [
        job("999", 0),  # another job
        job("1234", 1),  # this very run of the job: another task of the allocation
        job("1234", 0, cluster="c2"),  # the same number on another cluster
        None,  # a lease of no job
        ...,  # a lease file from before the field
    ],
    ids=["other-job", "same-run", "other-cluster", "no-job", "older-file"],
)
def test_a_lease_of_another_job_or_of_no_job_is_judged_as_before(tmp_path, in_job, theirs):
    run = Storage(str(tmp_path))
    in_job("1234", restart=1)
    held_by(run, job_field=theirs, age=1.0)
    with pytest.raises(LeaseError, match="is being written by dead-node pid 4242") as live:
        Lease(run, timeout=120).acquire(force=True)  # --force never takes a live lease
    assert live.value.exit_code == ExitCode.LEASE_HELD and "\n" not in live.value.message
    held_by(run, job_field=theirs, age=600.0)
    with pytest.raises(LeaseError, match="has a stale lease .* take it over with --force"):
        Lease(run, timeout=120).acquire()
    with Lease(run, timeout=120, heartbeat=60).acquire(force=True) as lease:
        assert lease.taken_over["host"] == "dead-node"
        assert lease.takeover_reason == "its heartbeat is older than trainer.lease_timeout"


@pytest.mark.parametrize(
    "bad",
    [{"id": "1"}, "1234", job("", 0), {**job(), "restart": -1}, {**job(), "restart": True}, {**job(), "x": 1}],
)
def test_a_malformed_job_makes_a_malformed_lease_named_in_one_sentence(tmp_path, in_job, bad):
    run = Storage(str(tmp_path))
    in_job("1234", restart=5)
    held_by(run, job_field=bad, age=1.0)
    assert read_lease(run)["_malformed"].startswith("its 'job' is ")
    with pytest.raises(LeaseError) as refused:
        Lease(run).acquire(wait=True)  # never taken over as an earlier run's, nor by waiting
    message = refused.value.message
    assert f"{run.url_of(LEASE_FILE)} is not a lease record: its 'job' is" in message and "--force" in message
    assert "\n" not in message


@pytest.mark.slow
def test_wait_for_lease_waits_for_a_live_lease_to_go_stale_then_takes_it_over(tmp_path, in_job):
    run = Storage(str(tmp_path))
    in_job("1234", restart=1)
    held_by(run, job_field=job("999", 0), age=0.0)  # another job's writer, its last beat just now
    said = []
    began = time.monotonic()
    with Lease(run, timeout=1.5, heartbeat=0.2).acquire(wait=True, say=said.append) as lease:
        waited = time.monotonic() - began
        assert lease.taken_over["job"] == job("999", 0)
    assert 1.4 <= waited < 10, waited  # until its heartbeat was older than the timeout, not at once
    assert len(said) == 1 and said[0].startswith(
        f"run {run.url} is being written by dead-node pid 4242 of Slurm job 999"
    )
    assert said[0].endswith("waiting up to 1.5 s (trainer.lease_timeout) for its lease to go stale (--wait-for-lease)")


def test_wait_for_lease_takes_a_lease_released_while_it_waits(tmp_path, in_job):
    run = Storage(str(tmp_path))
    held_by(run, job_field=None, age=0.0)
    threading.Timer(0.5, run.rm, args=(LEASE_FILE,)).start()
    with Lease(run, timeout=30, heartbeat=0.2).acquire(wait=True) as lease:
        assert lease.taken_over is None and read_lease(run)["owner"] == lease.owner


@pytest.mark.slow
def test_wait_for_lease_gives_up_after_the_lease_timeout_with_exit_10(tmp_path, in_job):
    run = Storage(str(tmp_path))
    held_by(run, job_field=None, age=0.0)
    stop = threading.Event()

    def beat():  # the other host's writer is alive: its heartbeat file keeps moving
        while not stop.wait(0.1):
            run.write_bytes(beat_file("ab12"), orjson.dumps({"heartbeat": time.time()}))

    beating = threading.Thread(target=beat)
    beating.start()
    said = []
    began = time.monotonic()
    try:
        with pytest.raises(LeaseError) as refused:
            Lease(run, timeout=1.0, heartbeat=0.2).acquire(wait=True, say=said.append)
    finally:
        stop.set()
        beating.join()
    waited = time.monotonic() - began
    assert 1.0 <= waited < 10, waited
    assert refused.value.exit_code == ExitCode.LEASE_HELD and len(said) == 1
    message = refused.value.message
    assert message.startswith(f"run {run.url} is still being written after waiting 1 s (--wait-for-lease), by ")
    assert re.search(r"by dead-node pid 4242, heartbeat \d+s ago; one writer per run$", message), message
    assert read_lease(run)["owner"] == "ab12"  # left as it was


def test_wait_for_lease_takes_an_already_stale_lease_without_waiting(tmp_path, in_job):
    run = Storage(str(tmp_path))
    held_by(run, job_field=None, age=600.0)
    said = []
    with Lease(run, timeout=120, heartbeat=60).acquire(wait=True, say=said.append) as lease:
        assert lease.taken_over["host"] == "dead-node"
    assert said == []


@pytest.mark.slow
def test_resume_wait_for_lease_says_it_waits_once_and_exits_10_while_the_writer_lives(tmp_path):
    """`rlctl resume --wait-for-lease` end to end on a complete run held by another host's live writer:
    one line says it waits, and after trainer.lease_timeout (set to 1 s) it exits 10 with one sentence."""
    from rlctl.config import RunConfig

    from helpers import invoke

    run = Storage(str(tmp_path / "run"))
    run.write_bytes("config.yaml", RunConfig.model_validate({"trainer": {"total_steps": 1}}).to_yaml().encode())
    run.write_bytes("events.jsonl", orjson.dumps({"event": "completed", "step": 1}) + b"\n")
    held_by(run, job_field=None, age=0.0)
    stop = threading.Event()
    beating = threading.Thread(target=_beat_until, args=(run, stop))
    beating.start()
    try:
        done = invoke("resume", run.url, "--wait-for-lease", "--set", "trainer.lease_timeout=1")
    finally:
        stop.set()
        beating.join()
    assert done.returncode == ExitCode.LEASE_HELD, done.stderr
    assert done.stderr.count("waiting up to 1 s (trainer.lease_timeout) for its lease to go stale") == 1
    assert "is still being written after waiting 1 s (--wait-for-lease), by dead-node pid 4242" in done.stderr


def _beat_until(run: Storage, stop: threading.Event) -> None:
    """The other host's writer is alive: its heartbeat file keeps moving until ``stop``."""
    while not stop.wait(0.1):
        run.write_bytes(beat_file("ab12"), orjson.dumps({"heartbeat": time.time()}))
