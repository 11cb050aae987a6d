"""Taking and restoring snapshots: scheduled, staged while training waits, written, uploaded and
committed in the background; retention after each commit; restore (``rlctl.checkpoint.restore``).

The manager has a ``Catalog`` (``rlctl.checkpoint.catalog``, the read side: scan, candidates, best,
quarantine) for everything it needs to find, and the names of a snapshot come from
``rlctl.checkpoint.layout``; which snapshots to keep are ``rlctl.checkpoint.retention``'s rules.

Training waits only while the Statefuls' state dicts are taken and handed to the writer: the snapshot
writer process (``rlctl.checkpoint.writer``; in a thread with ``writer="thread"``) serializes, hashes,
writes and uploads the files, and a thread of the manager writes the manifest once they are all on
storage, right after the lease's check. The manifest lists every file with its size and sha256, the
rlctl version, the world size and the run's other topology facts (each a ``Topology`` its caller
names, such as the engine's partitioning), and the run's last validation when there was one.

With several ranks every rank writes its own files into the same step directory (its engine shards
and its state file, its own RNG and counters), then its list of them with size and sha256. Rank 0
commits: it waits for every rank's list, checks each listed file is on storage with the listed size,
and only then creates the manifest covering all of them.

A commit either happens or the run hears about it: every failed snapshot is a ``snapshot_failed``
event (``rlctl.checkpoint.failure_count``), ``max_failures`` in a row end the run with a StorageError, and
``wait()`` says whether the last snapshot was committed. A snapshot that failed because its store has
been out for the retry budget (in the writer process, too) counts as the process's outage
(``rlctl.storage.outages.OUTAGES``): the run's fence ends the run at its next check. Whatever the
background commit raises, and what the ``fence`` raises right before a manifest would be written (a
lost lease), reaches the training thread at its next ``save()`` or ``wait()``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from rlctl import __version__, events, faults
from rlctl.checkpoint.catalog import Catalog, EventFn, SnapshotInfo, Topology
from rlctl.checkpoint.collectives import Collectives, Local
from rlctl.checkpoint.durable import no_space
from rlctl.checkpoint.failure_count import FailureCount, describe, refused
from rlctl.checkpoint.handover import LIVE_READS, NoSharedMemory, Payload, pickle_job
from rlctl.checkpoint.job import WriteJob, Written, finish
from rlctl.checkpoint.layout import (
    MANIFEST,
    abandoned_name,
    rank_list,
    stage_prefix,
    state_file,
    step_name,
)
from rlctl.checkpoint.manifest import FORMAT, val_problem
from rlctl.checkpoint.restore import restore_snapshot
from rlctl.checkpoint.retention import Retention, RollbackReach
from rlctl.checkpoint.staging import DirStateful, stage_files
from rlctl.checkpoint.writer import writer
from rlctl.errors import SnapshotError
from rlctl.stateful import Stateful
from rlctl.storage import Storage
from rlctl.storage.failures import note_outage


@dataclass
class _Job:
    """A snapshot staged by ``save`` for the commit thread to have written and to commit: ``work`` is
    written by the writer process (``payload``, the work pickled for it) or, without one, in the thread."""

    step: int
    manifest: dict[str, Any]
    stall: float
    work: WriteJob
    staged: threading.Event
    payload: Payload | None = None

    @property
    def stage(self) -> str:
        return self.work.stage


class SnapshotManager:
    """One run's snapshots as they are taken: when (``should_save``), writing and committing them, which to
    keep (``Retention``, and ``protect``: never the one a rollback of ``max_steps_back`` steps needs),
    turning away from later ones (``abandon_after``) and restore. Finding them is its ``catalog``'s,
    built from the same storage, world size, topology, retention's keep_best and ``on_event``.
    ``collectives`` are the ranks' (``Local()`` for one process); ``topology`` the facts besides the
    world size a snapshot must have been written for to be usable here.
    ``max_failures``: failed snapshots in a row that end the run (StorageError); ``fence``: called right
    before any manifest is written, it raises when this process may no longer write (a lost lease);
    ``writer``: "process" writes snapshot files in this process's writer process
    (``rlctl.checkpoint.writer``), "thread" in the commit thread."""

    def __init__(
        self,
        storage: Storage,
        *,
        world_size: int = 1,
        rank: int = 0,
        collectives: Collectives | None = None,
        topology: Sequence[Topology] = (),
        every: int = 0,
        max_steps_back: int = 0,
        retention: Retention | None = None,
        on_event: EventFn | None = None,
        staging_dir: str | None = None,
        asynchronous: bool = True,
        rank_timeout: float = 1800.0,
        max_failures: int = 3,
        fence: Callable[[], None] | None = None,
        writer: str = "process",
        elastic: bool = False,
        fixed_world: str = "",
    ):
        self.storage = storage
        self.world_size = world_size
        self.rank = rank
        self.collectives = collectives or Local()
        self.topology = tuple(topology)
        self.every = every  # a snapshot every `every` steps (0: none on a schedule)
        self.max_steps_back = max_steps_back  # the longest `steps_back` rollback a policy may ask for
        self.rank_timeout = rank_timeout  # how long rank 0 waits for the other ranks' files
        self.retention = retention or Retention()
        self.on_event = on_event or (lambda event: None)
        best = self.retention.best.rule if self.retention.best is not None else None
        self.catalog = Catalog(
            storage,
            world_size=world_size,
            topology=self.topology,
            keep_best=best,
            on_event=on_event,
            elastic=elastic,  # (restore: another world's snapshot, rlctl.checkpoint.elastic)
            fixed_world=fixed_world,
        )
        self.staging_dir = staging_dir
        self.asynchronous = asynchronous
        self.fence = fence
        if writer not in ("process", "thread"):
            raise ValueError(f"writer must be process or thread, not {writer!r}")
        # memory:// is seen by this process alone: its snapshots are written in the thread
        self.writer = "thread" if storage.in_process else writer
        self._fell_back = False  # a job was written in the thread for want of shared memory (said once)
        self.failures = FailureCount(max_failures, storage.url)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlctl-snapshot")
        self._pending: Future | None = None
        self._pending_step: int | None = None  # the step of the snapshot in flight
        self._staged = threading.Event()
        self._staged.set()
        self._lock = threading.Lock()
        self._outcome: bool | None = None  # of the last snapshot taken: committed or not
        self._fenced: BaseException | None = None  # what the fence raised: raised again at every wait
        self.last_committed: int | None = None  # the newest step committed or restored by this manager

    # -- cadence and protection ----------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``step`` is on the snapshot schedule (every ``every`` steps)."""
        return bool(self.every) and step % self.every == 0

    def protect(self, step: int) -> None:
        """Before saving ``step``: retention keeps the newest good snapshot a rollback of
        ``max_steps_back`` steps from here would need (nothing to do when no policy steps back)."""
        if self.max_steps_back:
            self.retention.protected = RollbackReach(step, self.max_steps_back).keep(self.catalog.scan())

    # -- saving ------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        states: dict[str, Stateful],
        dirs: dict[str, DirStateful],
        *,
        good: bool,
        extra_files: dict[str, bytes] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> float:
        """Stage the snapshot of ``step`` (training waits only for this), then upload and commit it in
        the background. A snapshot still in flight is awaited first, never overlapped. Returns the
        seconds training stalled. A snapshot that fails is reported and counted, not raised; raises
        (StorageError) once ``max_failures`` in a row have failed, or what the fence raised."""
        if meta and "val" in meta and (problem := val_problem(meta["val"])) is not None:
            raise ValueError(f"the snapshot of step {step} cannot record this validation: {problem}")
        t0 = time.perf_counter()
        self.wait()
        name, stage, full = step_name(step), None, faults.disk_full(step)
        try:
            stage = self._stage_dir(step, name)
            if full:  # (the enospc drill: a full disk fails the first files, which DeepSpeed writes here)
                raise no_space(os.path.join(stage, state_file(self.rank)))
            deferred, blobs = stage_files(stage, self.rank, states, dirs, extra_files)
            work = WriteJob(name, stage, self.storage, self.rank, self.world_size, self.rank_timeout, deferred, blobs)
            work.hold = float(faults.value("write_delay", step) or 0)
            payload = self._hand_over(work)
        except SnapshotError:
            raise
        except Exception as exc:
            self._failed(step, exc, stage)
            self._outcome = False
            self._raise_if_stopping()
            return time.perf_counter() - t0
        manifest = {
            "format": FORMAT,
            "step": step,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rlctl_version": __version__,
            "world_size": self.world_size,
            **{fact.key: fact.value for fact in self.topology},
            "good": good,
            **(meta or {}),
        }
        job = _Job(step, manifest, time.perf_counter() - t0, work, threading.Event(), payload)
        with self._lock:
            self._staged = job.staged
            self._pending = self._pool.submit(self._commit, job)
            self._pending_step = step
        if not self.asynchronous:
            self.wait()
        return job.stall

    def _stage_dir(self, step: int, name: str) -> str:
        """The directory this rank stages the snapshot in, after rank 0 chose what retention protects
        and removed an uncommitted leftover of the same step (every rank waits for that, even when it
        failed)."""
        failed = None
        if self.rank == 0:
            try:
                self.protect(step)
                if not self.storage.exists(name, MANIFEST):
                    self.storage.rm(name, recursive=True)  # an uncommitted leftover of the same step
            except Exception as exc:
                failed = exc
        self.collectives.barrier()  # no rank writes before the leftover is gone
        if failed is not None:
            raise failed
        if self.storage.exists(name, MANIFEST):  # (rank 0 left it alone: every rank sees it and stops)
            raise SnapshotError(f"a committed snapshot of step {step} already exists in {self.storage.url}")
        if self.storage.is_local:
            stage = self.storage.path(name)  # stage in place: the manifest still commits it
        else:
            stage = tempfile.mkdtemp(prefix=stage_prefix(name), dir=self.staging_dir)
        os.makedirs(stage, exist_ok=True)
        return stage

    def start_writer(self) -> None:
        """Start this process's snapshot writer now rather than at the first snapshot (call on a thread
        that lives as long as the run); nothing to do without one."""
        if self.writer == "process":
            with contextlib.suppress(OSError):  # (the first snapshot tries again, and says what fails)
                writer().start(preload=None)  # (one started for the run already is the run's)

    def _hand_over(self, work: WriteJob) -> Payload | None:
        """The job pickled for the writer process (started here, on the training thread, if it is not
        running), or None when the commit thread writes it: ``writer`` "thread", or too little shared
        memory for the state (said once, as ``snapshot_writer_fallback``)."""
        if self.writer != "process" or self._fell_back:  # (after a fallback, the thread for the run)
            return None
        try:
            payload = pickle_job(work)
        except NoSharedMemory as exc:
            if not self._fell_back:
                self._fell_back = True
                self.on_event({"event": events.SNAPSHOT_WRITER_FALLBACK, "reason": str(exc), "writer": "thread"})
            return None
        self.start_writer()
        return payload

    def _write_files(self, job: _Job) -> Written | None:
        """Have the job's files written (by the writer process, or here) and brought to storage."""
        if job.payload is None:  # (no storage moves into shared memory while this reads the live state)
            end = LIVE_READS.begin()

            def staged() -> None:
                end()
                job.staged.set()

            try:
                return finish(job.work, staged)
            finally:
                end()
        return writer().run(job.payload, stage_copy=self.asynchronous, staged=job.staged.set, hold=job.work.hold)

    def _commit(self, job: _Job) -> bool:
        """The background half of a snapshot: have its files written and brought to storage, then
        commit it (rank 0) or list this rank's files for rank 0 (the others, in the writer). Its outcome;
        a failure is reported and counted here."""
        name, t0 = step_name(job.step), time.perf_counter()
        try:
            written = self._write_files(job)
            if self.rank != 0:
                return True
            data = self._manifest(job, written, t0)
            if self.fence is not None:
                try:
                    self.fence()
                except BaseException as exc:  # nothing is committed, nothing cleaned: we may no longer write
                    self._fenced = exc
                    return False
            self.storage.write_bytes(f"{name}/{MANIFEST}", data, exclusive=True)
        except Exception as exc:
            note_outage(exc)  # the writer process's outage is this process's too: its budget is spent
            self._failed(job.step, exc, job.stage)
            return False
        finally:
            job.staged.set()
            if not self.storage.is_local:
                shutil.rmtree(job.stage, ignore_errors=True)
        self._committed(job, t0)
        return True

    def _manifest(self, job: _Job, written: Written, t0: float) -> bytes:
        """The manifest that commits what was written (every rank's files, sizes and sha256)."""
        manifest = job.manifest
        manifest["write_s"] = round(time.perf_counter() - t0, 4)
        if not self.storage.is_local:
            manifest["upload_s"], manifest["upload_bytes"] = written.upload_s, written.upload_bytes
        manifest["files"] = written.files
        manifest["total_bytes"] = sum(f["size"] for f in written.files.values())
        delay = float(faults.value("commit_delay", job.step) or 0)
        if delay:
            time.sleep(delay)
        return orjson.dumps(manifest, option=orjson.OPT_INDENT_2)

    def _committed(self, job: _Job, t0: float) -> None:
        name, m = step_name(job.step), job.manifest
        self.failures.committed()
        self.last_committed = job.step
        upload = {}
        if m.get("upload_s"):  # object storage: rank 0's upload, in MB/s
            upload = {"upload_mb_s": round(m["upload_bytes"] / 1e6 / m["upload_s"], 1)}
        self.on_event(
            {
                "event": events.SNAPSHOT_COMMITTED,
                "step": job.step,
                "good": m["good"],
                "bytes": m["total_bytes"],
                "stall_s": round(job.stall, 4),
                "commit_s": round(time.perf_counter() - t0, 4),
                "location": self.storage.url_of(name),
                **upload,
            }
        )
        try:
            self.purge()
        except Exception as exc:  # the snapshot stands; retention tries again after the next commit
            self.on_event({"event": events.SNAPSHOTS_PURGE_FAILED, "step": job.step, "error": describe(exc)})

    def _failed(self, step: int, exc: BaseException, stage: str | None) -> None:
        """A snapshot of ``step`` failed: rank 0 counts and reports it, and removes what it wrote (never
        half-visible, no litter); another rank tells rank 0 through its list."""
        cause = describe(exc, stage)
        name = step_name(step)
        if stage is not None and not self.storage.is_local:
            shutil.rmtree(stage, ignore_errors=True)
        if self.rank != 0:
            self._list_error(name, cause)
            return
        event = self.failures.failed(step, cause, refused(exc))
        try:
            if not self.storage.exists(name, MANIFEST):
                self.storage.rm(name, recursive=True)
        except Exception as cleanup:
            event["cleanup_error"] = describe(cleanup)
        self.on_event(event)

    def _list_error(self, name: str, cause: str) -> None:
        """Tell rank 0 this rank's share failed, unless its list is written already (the writer process
        listed the files, then died: rank 0 may have committed the snapshot with them)."""
        path = f"{name}/{rank_list(self.rank)}"
        try:
            if not self.storage.exists(path):
                self.storage.write_bytes(path, orjson.dumps({"rank": self.rank, "error": cause}), exclusive=True)
        except Exception:
            pass  # then rank 0 times out waiting for the list, and says so

    def settle(self, step: int) -> None:
        """Wait for a snapshot of a step before ``step`` that is still in flight (the sleep drill does,
        so that a kill in its window finds every earlier snapshot committed, however long the writer
        took to start; a snapshot of ``step`` itself may still be in flight, as a commit_delay drill
        wants)."""
        with self._lock:
            earlier = self._pending is not None and self._pending_step is not None and self._pending_step < step
        if earlier:
            self.wait()

    def wait_staged(self) -> None:
        """Block until the snapshot in flight no longer reads live state (its deferred files are
        written). Cheap when nothing is in flight."""
        self._staged.wait()

    def wait(self) -> bool | None:
        """Block until the snapshot in flight (if any) is committed or has failed. Returns whether the
        last snapshot this manager took was committed (None before its first). Raises what the
        background commit raised, what the fence raised, or a StorageError once ``max_failures``
        snapshots in a row have failed."""
        with self._lock:
            job, self._pending = self._pending, None
        if job is not None:
            self._outcome = job.result()
        self._raise_if_stopping()
        return self._outcome

    def failed(self, step: int) -> bool:
        """Whether the last snapshot taken was of ``step`` and failed (rank 0 knows)."""
        return self.failures.last is not None and self.failures.last.step == step

    def outcome(self, step: int) -> str:
        """What became of the snapshot of ``step``, in words, and which snapshot a resume starts from."""
        last = self.last_committed
        if last == step:
            return f"snapshot of step {step} committed"
        previous = (
            f"the last committed snapshot is step {last}"
            if last is not None
            else "no snapshot yet; resume will start over"
        )
        if self.failed(step):
            return f"the snapshot of step {step} was not committed ({self.failures.last.cause}); {previous}"
        return f"no snapshot of step {step} was taken; {previous}"

    def _raise_if_stopping(self) -> None:
        if self._fenced is not None:
            raise self._fenced
        if (error := self.failures.stop_error(self.last_committed)) is not None:
            raise error

    def close(self) -> None:
        """Finish the snapshot in flight (raising what its thread raised) and stop the thread."""
        try:
            with self._lock:
                job, self._pending = self._pending, None
            if job is not None:
                self._outcome = job.result()
        finally:
            self._pool.shutdown(wait=True)

    # -- retention ---------------------------------------------------------------------------------
    def purge(self) -> list[int]:
        """Remove the snapshots no rule of retention keeps (``Retention.purgeable``: never the newest, the
        newest good, the best, a protected one nor any that is not usable). Runs only after a commit."""
        removed = []
        for info in self.retention.purgeable(self.catalog.scan()):
            # un-commit first (the manifest goes), so a crash mid-delete leaves no broken snapshot
            self.storage.rm(info.name, MANIFEST)
            self.storage.rm(info.name, recursive=True)
            removed.append(info.step)
        if removed:
            self.on_event({"event": events.SNAPSHOTS_PURGED, "steps": removed})
        return removed

    def abandon_after(self, step: int, tag: str) -> list[int]:
        """Move committed snapshots later than ``step`` to abandoned/<tag>/ (a resume turned away from
        them; kept, not deleted), or <tag>-2/ (-3...) where an earlier turn of the same second holds it."""
        later = [(at, name) for at, name in self.catalog.step_dirs() if at > step]
        free, n = tag, 1
        while any(self.storage.exists(abandoned_name(free, name)) for _, name in later):
            n, free = n + 1, f"{tag}-{n + 1}"
        for _, name in later:
            self.storage.move_dir(name, abandoned_name(free, name))
        return [at for at, _ in later]

    # -- restoring ---------------------------------------------------------------------------------
    def restore(self, info: SnapshotInfo, states: dict[str, Stateful], dirs: dict[str, DirStateful]) -> None:
        """Load snapshot ``info`` into ``states`` and ``dirs`` (``rlctl.checkpoint.restore``), once a
        snapshot still in flight is finished: it is then the last committed one."""
        self.wait()
        restore_snapshot(self.storage, self.collectives, self.rank, self.world_size, info, states, dirs)
        self.last_committed = info.step
