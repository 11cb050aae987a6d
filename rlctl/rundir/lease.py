"""One writer per run: a lease file in the run directory.

``lease.json`` is created exclusively and holds the owner's host, pid and the time it was taken; it
is never rewritten while held. A background thread renews the heartbeat in a file of the owner's own,
``.lease/beat-OWNER``, so a renewal can never write over the lease of a writer that took the run over
between the renewal's read and its write (a read-then-write of lease.json could). A second writer is refused while the lease is live. A lease is stale when
its heartbeat is older than the timeout, or when its owner ran on this host and that process is gone
(then it is taken over at once: a crash cannot have left a live writer). A stale lease from another
host, or a lease.json that is not a lease record, is taken over only with ``--force``.

The scheduler's job is an owner too: the lease records the Slurm job it runs under (cluster, job id or
array job and task, and the job's restart count, ``scheduler_job``). A lease taken by an earlier run of
the same job (a lower restart count: Slurm requeued the job, and runs one instance of it at a time) is
taken over at once whatever its host and heartbeat; a lease of another job, of the same run of this job
(another task of the allocation), or of no job is judged as above. With ``wait`` (``--wait-for-lease``) a
live lease from another host is watched until it goes stale, for at most the lease timeout, and then
taken over as ``--force`` would (a lease.json that is not a lease record still needs ``--force``).

Fencing: the heartbeat thread survives any error and keeps trying each beat. The lease is lost when
lease.json names another owner, or when no renewal succeeded for longer than the timeout (another host
may then take the run over); ``Lease.check()`` raises from then on, so the writer stops before its next
write: LeaseError (exit 10) when lease.json was read and names another writer, or was removed, or no
renewal was even tried; StorageError (exit 12) when the renewals failed because the storage did (an
outage, not a takeover). ``check()`` also raises StorageError once any store this process writes to has
been failing for longer than the run's retry budget (``rlctl.storage.outages.OUTAGES``: one deadline
for the heartbeat, the metrics and events, and the snapshot commits alike).
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from rlctl.errors import LeaseError, StorageError
from rlctl.numbers import is_number
from rlctl.rundir.layout import LEASE_FILE, beat_file, takeover_file
from rlctl.storage import Storage, describe
from rlctl.storage.outages import OUTAGES

FIELDS = {"owner": str, "host": str, "pid": int, "heartbeat": float}
JOB_FIELDS = {"scheduler": str, "cluster": str, "id": str, "restart": int}  # lease.json's optional "job"


def scheduler_job(env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The scheduler job this process runs under, or None outside one: Slurm's cluster name, job id (an
    array task's ``ARRAYJOB_TASK``: its own SLURM_JOB_ID may differ from its first run's) and restart
    count (SLURM_RESTART_COUNT, 0 before the first requeue)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "").strip()
    if not job:
        return None
    array, task = env.get("SLURM_ARRAY_JOB_ID", "").strip(), env.get("SLURM_ARRAY_TASK_ID", "").strip()
    restart = env.get("SLURM_RESTART_COUNT", "").strip()
    return {
        "scheduler": "slurm",
        "cluster": env.get("SLURM_CLUSTER_NAME", "").strip(),
        "id": f"{array}_{task}" if array and task else job,
        "restart": int(restart) if restart.isdecimal() else 0,
    }


def describe_job(job: dict[str, Any]) -> str:
    """A job in words: "Slurm job 1234 (run 2)"."""
    return f"Slurm job {job['id']} (run {job['restart'] + 1})"


def earlier_run_of(held: dict[str, Any], job: dict[str, Any] | None) -> bool:
    """Whether ``held`` was taken by an earlier run of ``job`` (same scheduler, cluster and job, a lower
    restart count): that run is over, since the scheduler runs one instance of a job at a time."""
    theirs = held.get("job")
    if job is None or not isinstance(theirs, dict) or held.get("_malformed"):
        return False
    same = all(theirs.get(k) == job[k] for k in ("scheduler", "cluster", "id"))
    return same and theirs["restart"] < job["restart"]


def _pid_alive(pid: int) -> bool:
    """Whether a process of this host may still run. A pid <= 0 names no single process (os.kill(-1, 0)
    would signal every process we may signal): never provably gone."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _malformed(data: Any) -> str | None:
    """Why a parsed lease.json is not a lease record, or None."""
    if not isinstance(data, dict):
        return f"it holds {type(data).__name__} {orjson.dumps(data).decode()[:40]}, not an object"
    for key, kind in FIELDS.items():
        value = data.get(key)
        ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
        if key not in data or not ok:
            got = "nothing" if key not in data else repr(value)[:40]
            return f"its {key!r} is {got}, not {'a number' if kind is not str else 'a string'}"
    if data["pid"] <= 0 or not math.isfinite(data["heartbeat"]):
        return f"its pid {data['pid']} or heartbeat {data['heartbeat']} is out of range"
    job = data.get("job")  # absent or null in a lease of no job (and in every lease older than the field)
    if job is not None and not _is_job(job):
        return f"its 'job' is {orjson.dumps(job).decode()[:60]}, not a scheduler job {sorted(JOB_FIELDS)}"
    return None


def _is_job(job: Any) -> bool:
    if not isinstance(job, dict) or set(job) != set(JOB_FIELDS):
        return False
    typed = all(isinstance(job[k], kind) and not isinstance(job[k], bool) for k, kind in JOB_FIELDS.items())
    return typed and bool(job["id"]) and job["restart"] >= 0


def _last_beat(storage: Storage, owner: str) -> float | None:
    """The owner's latest heartbeat, or None when it has none (yet) or it cannot be read as one."""
    try:
        value = orjson.loads(storage.read_bytes(beat_file(owner))).get("heartbeat")
    except (FileNotFoundError, orjson.JSONDecodeError, AttributeError):
        return None
    return float(value) if is_number(value, finite=True) else None


def read_lease(storage: Storage) -> dict[str, Any] | None:
    """The lease record, with ``_digest`` (a hash of lease.json's bytes) and ``heartbeat`` the later of
    the time it was taken and its owner's last beat. A lease.json that is not a lease record reads as
    long stale, with ``_malformed`` saying why."""
    try:
        raw = storage.read_bytes(LEASE_FILE)
    except FileNotFoundError:
        return None
    digest = hashlib.sha256(raw).hexdigest()[:16]
    try:
        data = orjson.loads(raw)
        problem = _malformed(data)
    except orjson.JSONDecodeError:
        problem = "it is not JSON"
    if problem is None:
        beat = _last_beat(storage, data["owner"]) if "/" not in data["owner"] else None
        return {**data, "heartbeat": max(data["heartbeat"], beat or 0.0), "_digest": digest}
    return {"owner": "?", "host": "?", "pid": 0, "heartbeat": 0.0, "_digest": digest, "_malformed": problem}


def lease_state(lease: dict[str, Any] | None, timeout: float, now: float | None = None) -> str:
    """'free', 'live', 'dead' (owner on this host is gone) or 'stale' (heartbeat older than timeout, or
    not a lease record)."""
    if lease is None:
        return "free"
    if lease.get("_malformed"):
        return "stale"
    now = time.time() if now is None else now
    if lease.get("host") == socket.gethostname() and not _pid_alive(int(lease["pid"])):
        return "dead"
    if now - float(lease["heartbeat"]) > timeout:
        return "stale"
    return "live"


def describe_lease(lease: dict[str, Any], storage: Storage) -> str:
    """Who holds a lease, in words: "HOST pid PID[ of Slurm job J (run N)], heartbeat N s ago", or what is
    wrong with lease.json."""
    if lease.get("_malformed"):
        return f"{storage.url_of(LEASE_FILE)} is not a lease record: {lease['_malformed']}"
    job = f" of {describe_job(lease['job'])}" if lease.get("job") else ""
    return f"{lease['host']} pid {lease['pid']}{job}, heartbeat {time.time() - float(lease['heartbeat']):.0f}s ago"


class Lease:
    def __init__(self, storage: Storage, timeout: float = 120.0, heartbeat: float = 15.0):
        self.storage = storage
        self.timeout = timeout
        self.interval = heartbeat
        self.owner = uuid.uuid4().hex
        self.job = scheduler_job()  # the scheduler job this process runs under, recorded in lease.json
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._renewed: float | None = None  # monotonic start of the last renewal that succeeded
        self.taken_over: dict[str, Any] | None = None  # the stale lease this one replaced
        self.takeover_reason: str | None = None  # why it could be taken over, in words
        self.lost_reason: str | None = None
        self.lost_to_storage = False  # lost because renewals failed with the storage, not to another writer
        self.last_error: str | None = None  # of the last beat that failed, until one succeeds
        self._storage_failing = False  # the last beat failed with a storage error

    def _record(self) -> bytes:
        host, pid = socket.gethostname(), os.getpid()
        return orjson.dumps({"owner": self.owner, "host": host, "pid": pid, "heartbeat": time.time(), "job": self.job})

    def acquire(self, force: bool = False, wait: bool = False, say: Callable[[str], None] | None = None) -> Lease:
        """Take the lease: a free one, a dead one, an earlier run's of this scheduler job, or (``force``) a
        stale one; with ``wait``, a live one from another host once it has gone stale (``say`` tells
        once that it waits). LeaseError (exit 10) otherwise."""
        for _ in range(3):
            started = time.monotonic()
            try:
                self.storage.write_bytes(LEASE_FILE, self._record(), exclusive=True)
                break
            except FileExistsError:
                held = read_lease(self.storage)
                if held is not None and held.get("owner") == self.owner:
                    break  # our create landed, but its answer was lost and the retry found it
                if held is not None and wait:
                    held = self._until_not_live(held, say or (lambda _text: None))
                if lease_state(held, self.timeout) == "free":
                    continue  # released between our create and our read: try the create again
                self._take_over(held, force, wait)
        else:
            raise LeaseError(f"another process took the lease of {self.storage.url} at the same moment")
        self._renewed = started
        OUTAGES.clear()  # the run's outages count from here (none seen before the lease is the run's)
        self._thread = threading.Thread(target=self._beat, name="rlctl-lease", daemon=True)
        self._thread.start()
        return self

    def _until_not_live(self, held: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any] | None:
        """The lease once it is no longer live, read again every few seconds for at most the lease timeout
        (a live lease's heartbeat is at most that old); LeaseError when it is still live then."""
        if earlier_run_of(held, self.job) or lease_state(held, self.timeout) != "live":
            return held
        poll = min(self.interval, self.timeout / 4, 5.0)
        say(
            f"run {self.storage.url} is being written by {describe_lease(held, self.storage)}; waiting up to "
            f"{self.timeout:g} s (trainer.lease_timeout) for its lease to go stale (--wait-for-lease)"
        )
        deadline = time.monotonic() + self.timeout + poll
        while held is not None and lease_state(held, self.timeout) == "live" and not earlier_run_of(held, self.job):
            left = deadline - time.monotonic()
            if left <= 0:
                raise LeaseError(
                    f"run {self.storage.url} is still being written after waiting {self.timeout:g} s "
                    f"(--wait-for-lease), by {describe_lease(held, self.storage)}; one writer per run"
                )
            time.sleep(min(poll, left))
            held = read_lease(self.storage)
        return held

    def _take_over(self, held: dict[str, Any], force: bool, wait: bool = False) -> None:
        """Remove a dead lease, an earlier run's of this scheduler job, or (with ``force`` or ``wait``) a
        stale one so the exclusive create can be raced again; refuse a live one."""
        state = lease_state(held, self.timeout)
        who = describe_lease(held, self.storage)
        earlier = earlier_run_of(held, self.job)
        if state == "live" and not earlier:
            raise LeaseError(f"run {self.storage.url} is being written by {who}; one writer per run")
        if state == "stale" and not earlier and not (force or (wait and not held.get("_malformed"))):
            gone = "no other process writes this run" if held.get("_malformed") else "that process is really gone"
            raise LeaseError(f"run {self.storage.url} has a stale lease ({who}); if {gone}, take it over with --force")
        # Takeover is itself exclusive: the first to create the marker named after this stale lease's
        # bytes replaces it; a second taker fails here instead of deleting the winner's fresh lease.
        # Markers are a few bytes each and are kept.
        try:
            self.storage.write_bytes(takeover_file(held["_digest"]), self._record(), exclusive=True)
        except FileExistsError:
            raise LeaseError(f"another process is taking over the stale lease of {self.storage.url}") from None
        self.taken_over = {k: v for k, v in held.items() if k != "_digest"}
        self.takeover_reason = self._reason(held, state, earlier)
        self.storage.rm(LEASE_FILE)
        self._forget_beat(held.get("owner", ""))

    def _reason(self, held: dict[str, Any], state: str, earlier: bool) -> str:
        if earlier:
            return f"it was taken by an earlier run of {describe_job(held['job'])}, which Slurm requeued"
        if state == "dead":
            return "its process on this host is gone"
        return "its heartbeat is older than trainer.lease_timeout" if not held.get("_malformed") else "it was malformed"

    def _forget_beat(self, owner: str) -> None:
        """Remove an owner's heartbeat file (it is no use once its lease is gone); never fails."""
        if owner and "/" not in owner:
            try:
                self.storage.rm(beat_file(owner))
            except (FileNotFoundError, StorageError):
                pass

    # -- fencing ----------------------------------------------------------------------------------
    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    @property
    def held(self) -> bool:
        self._expire()
        return self._thread is not None and not self._stop.is_set() and not self.lost

    def check(self) -> None:
        """Raise once this process may no longer write the run: call it right before a write that must be
        fenced. LeaseError when the lease is lost to another writer; StorageError when its renewals
        failed with the storage for the lease timeout, or a store of this process has been failing for
        the retry budget."""
        self._expire()
        if self.lost_reason is not None:
            raise self._lost_error()
        outage = OUTAGES.overdue(self.storage.retry_timeout)
        if outage is not None:
            raise outage.error(self.storage.retry_timeout, "the retry budget (checkpoint.retry_timeout)")

    def _lost_error(self) -> LeaseError | StorageError:
        if self.lost_to_storage:
            return StorageError(
                f"cannot renew the lease of {self.storage.url}: {self.lost_reason}; stopped before writing "
                "(the storage failed, no other writer was seen: resume the run once it is back)"
            )
        return LeaseError(
            f"lost the lease of {self.storage.url}: {self.lost_reason}; stopped before writing; "
            "another writer may own the run"
        )

    def _mark_lost(self, reason: str, to_storage: bool = False) -> None:
        with self._lock:
            if self.lost_reason is None:
                self.lost_reason, self.lost_to_storage = reason, to_storage

    def _expire(self) -> None:
        """Mark the lease lost when no renewal succeeded within the timeout (measured from the start of
        the last good one, so never later than another host may judge it stale)."""
        if self._renewed is None or self.lost or self._stop.is_set():
            return
        age = time.monotonic() - self._renewed
        if age > self.timeout:
            error = f" (last error: {self.last_error})" if self.last_error else ""
            reason = f"no heartbeat succeeded for {age:.0f} s, more than the {self.timeout:g} s timeout{error}"
            self._mark_lost(reason, to_storage=self._storage_failing)

    def _beat(self) -> None:
        """Renew every interval until stopped or lost; survive every error and try again next beat."""
        storage = self.storage.with_retry_timeout(min(self.storage.retry_timeout, self.interval))
        while not self._stop.wait(self.interval) and not self.lost:
            try:
                self._renew(storage)
            except StorageError as exc:  # an outage (or a refusal): said as the storage's, never a takeover
                self.last_error, self._storage_failing = exc.message, True
            except Exception as exc:  # anything else: the thread must not die
                self.last_error, self._storage_failing = describe(exc), False
            self._expire()

    def _renew(self, storage: Storage) -> None:
        started = time.monotonic()
        held = read_lease(storage)
        if held is None:
            self._mark_lost(f"{storage.url_of(LEASE_FILE)} was removed")
        elif held.get("owner") != self.owner:
            self._mark_lost(f"{storage.url_of(LEASE_FILE)} now names another writer ({describe_lease(held, storage)})")
        if self.lost or self._stop.is_set() or time.monotonic() - (self._renewed or started) > self.timeout:
            return  # a beat after the timeout would revive a lease another host may judge stale
        storage.write_bytes(beat_file(self.owner), self._record())
        self._renewed = started
        self.last_error, self._storage_failing = None, False

    # -- release ----------------------------------------------------------------------------------
    def release(self) -> None:
        """Stop the heartbeat and remove lease.json if it is still ours (never when the lease was lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.interval))
        if self.lost:
            return
        held = read_lease(self.storage)
        if held is not None and held.get("owner") == self.owner:
            self.storage.rm(LEASE_FILE)
        self._forget_beat(self.owner)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            self.release()
        except StorageError:
            if exc_type is None:
                raise  # say it; but never hide the error that is already on its way out


def owner_fence(run: Storage, owner: str) -> Callable[[], None]:
    """A fence for a rank that does not hold the lease itself: it raises LeaseError once the run's lease
    is no longer ``owner``'s (taken over, or gone), and StorageError once a store of this process has
    been failing for the run's retry budget (counted from now: a rank's outages are its run's)."""
    OUTAGES.clear()

    def check() -> None:
        held = read_lease(run)
        if held is None or held.get("owner") != owner:
            now = "it is gone" if held is None else f"it is now held by {held.get('host')} pid {held.get('pid')}"
            raise LeaseError(f"the driver of run {run.url} lost its lease ({now}); stopping before the next write")
        outage = OUTAGES.overdue(run.retry_timeout)
        if outage is not None:
            raise outage.error(run.retry_timeout, "the retry budget (checkpoint.retry_timeout)")

    return check
