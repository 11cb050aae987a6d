"""Snapshots: scheduled, staged while training waits, written, uploaded and committed in the background.

Training waits only while the Statefuls' state dicts are taken and handed to the writer: the snapshot
writer process (``rlctl.checkpoint.writer``; in a thread with ``writer="thread"``) serializes, hashes,
writes and uploads the files, and a thread of the manager writes the manifest once they are all on
storage, right after the lease's check.

Layout under the checkpoint directory (RUN_DIR/checkpoints unless ``checkpoint.dir`` says otherwise)::

    step-000500/
      <name>/...          each directory-Stateful in its own format (the engines: weights, optimizer ...)
      state.pt            every other Stateful's state_dict (trainer, data cursor, RNG, KL controller ...)
      <extra files>       the resolved config, the model's HF config and tokenizer
      manifest.json       written last, created exclusively: the only proof the snapshot exists
    abandoned/<time>/step-000700/   snapshots of a branch a resume turned away from (never deleted)
    quarantine/step-000600.<time>/  a snapshot whose manifest could not be read (never deleted)

The manifest lists every file with its size and sha256, the rlctl version, the world size and the
run's other topology facts (each a ``Topology`` its caller names, such as the engine's partitioning).
It also records the run's last validation when there was one (``val``: the step validated and its
metrics): "best" (``candidates``, ``best``) and retention's ``keep_best`` rank snapshots by it.
A directory without a manifest file is not a snapshot but this protocol's own unfinished temporary:
discovery ignores it and start-up removes it. A directory whose manifest exists but cannot be read
(garbage, truncated, fields of the wrong shape) is not chosen either, and the run's writer moves it to
``quarantine/`` and says so: rlctl deletes only what it can prove is its own. "latest" is found by
listing, never from a pointer file.

With several ranks every rank writes its own files into the same step directory (its engine shards
and ``state.rank-N.pt``, its own RNG and counters), then ``ranks/rank-N.json`` listing them with size
and sha256. Rank 0 commits: it waits for every rank's list, checks each listed file is on storage with
the listed size, and only then creates the manifest covering all of them.

A commit either happens or the run hears about it: every failed snapshot is a ``snapshot_failed``
event (``rlctl.checkpoint.failure_count``), ``max_failures`` in a row end the run with a StorageError, and
``wait()`` says whether the last snapshot was committed. Whatever the background commit raises, and
what the ``fence`` raises right before a manifest would be written (a lost lease), reaches the training
thread at its next ``save()`` or ``wait()``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from rlctl import __version__, faults
from rlctl.checkpoint.collectives import Collectives, Local
from rlctl.checkpoint.durable import no_space
from rlctl.checkpoint.failure_count import FailureCount, describe
from rlctl.checkpoint.job import WriteJob, Written, finish, rank_list
from rlctl.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    UnreadableManifest,
    checksum_problem,
    parse_manifest,
    stored_checksum_problem,
    val_problem,
)
from rlctl.checkpoint.writer import NoSharedMemory, pickle_job, writer
from rlctl.errors import SnapshotError
from rlctl.stateful import Stateful
from rlctl.storage import Storage

QUARANTINE = "quarantine"
STATE_FILE = "state.pt"


def state_file(rank: int) -> str:
    return STATE_FILE if rank == 0 else f"state.rank-{rank}.pt"


_OWN_RANK_FILE = re.compile(r"^(?:state\.rank-(\d+)\.pt|ranks/rank-(\d+)\.json)$")  # the manager's own

FileRank = Callable[[str], "int | None"]


def files_of_rank(files, rank: int, file_rank: FileRank | None = None) -> list[str]:
    """The files of a snapshot that rank ``rank`` reads to restore: everything except the other ranks'
    own files. The manager's own per-rank files (``state.pt`` is rank 0's) it tells apart itself; any
    other file is owned by the rank ``file_rank(path)`` names, or shared when it names none. In a world
    of one, every file."""
    out = []
    for rel in files:
        if rel == STATE_FILE:
            owner = 0
        elif m := _OWN_RANK_FILE.match(rel):
            owner = int(next(g for g in m.groups() if g is not None))
        else:
            owner = file_rank(rel) if file_rank is not None else None
        if owner is None or owner == rank:
            out.append(rel)
    return out


_STEP_DIR = re.compile(r"^step-(\d+)$")

EventFn = Callable[[dict[str, Any]], None]


Defer = Callable[[str, Any], None]


class DirStateful(Protocol):
    """State too big or too structured for a state_dict: saved into, and loaded from, a directory.

    ``save_to_dir`` may write files at once, or hand an object to ``defer(path, obj)``: the snapshot
    writer then serializes it into ``path`` with ``torch.save`` (in its own process, or in the manager's
    background thread). Whoever defers promises that the tensors ``obj`` holds do not change until
    ``SnapshotManager.wait_staged()`` returns (the actor waits there before its next optimizer step)."""

    def save_to_dir(self, path: str, defer: Defer | None = None) -> None: ...

    def load_from_dir(self, path: str) -> None: ...

    # Optional: the rank that alone reads a file of the directory (path relative to it), None when
    # every rank reads it. Without it, every rank fetches and checks every file of the directory.
    # def file_rank(self, rel: str) -> int | None: ...


@dataclass(frozen=True)
class Topology:
    """One fact besides the world size that a snapshot's files are laid out for (a directory-Stateful's
    topology, e.g. how an engine partitions its state): recorded in the manifest under ``key``; a
    snapshot that recorded another value is not usable, and ``mismatch`` (formatted with ``recorded``
    and ``value``) says why."""

    key: str
    value: Any
    mismatch: str

    def problem(self, manifest: dict[str, Any]) -> str | None:
        recorded = manifest.get(self.key)
        return None if recorded == self.value else self.mismatch.format(recorded=recorded, value=self.value)


def dir_file_rank(dirs: dict[str, DirStateful]) -> FileRank:
    """``file_rank`` over a snapshot's paths, asking the directory-Stateful each path lies under."""

    def file_rank(rel: str) -> int | None:
        key, _, inner = rel.partition("/")
        ask = getattr(dirs.get(key), "file_rank", None)
        return ask(inner) if ask is not None and inner else None

    return file_rank


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def parse_step_spec(spec: str) -> int | str:
    """'latest' | 'last-good' | 'best' | 'step-500' | '500' -> 'latest' | 'last-good' | 'best' | 500."""
    if spec in ("latest", "last-good", "best"):
        return spec
    m = re.fullmatch(r"(?:step-)?0*(\d+)", spec)
    if not m:
        raise SnapshotError(f"--from expects latest, last-good, best, step-N or N; got {spec!r}")
    return int(m.group(1))


@dataclass
class SnapshotInfo:
    step: int
    name: str
    manifest: dict[str, Any] | None = None
    problem: str | None = None  # why the snapshot is not usable
    unreadable: bool = False  # its manifest exists but cannot be read: quarantined, never deleted

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def usable(self) -> bool:
        return self.committed and self.problem is None

    @property
    def good(self) -> bool:
        return bool(self.manifest) and self.manifest.get("good") is True

    @property
    def _val(self) -> dict[str, Any]:
        """The manifest's last validation (checked in a manifest of this format; ignored in another)."""
        m = self.manifest or {}
        return (m.get("val") or {}) if m.get("format") == FORMAT else {}

    @property
    def val_step(self) -> int | None:
        """The step of the run's last validation when the snapshot was taken (None: none yet)."""
        return self._val.get("step")

    def val_metric(self, name: str) -> float | None:
        """The value of validation metric ``name`` the manifest records (None when it records none)."""
        value = self._val.get("metrics", {}).get(name)
        return None if value is None else float(value)

    def as_row(self, metric: str | None = None) -> dict[str, Any]:
        """The snapshot as a row of ``rlctl checkpoints``; with ``metric``, also its recorded value of
        that validation metric (a key of its name) and ``val_step``."""
        m = self.manifest or {}
        created, size = m.get("created"), m.get("total_bytes")  # (a manifest of another format: any shape)
        return {
            "step": self.step,
            "name": self.name,
            "time": created if isinstance(created, str) else None,
            "bytes": size if isinstance(size, int) and not isinstance(size, bool) else None,
            "committed": self.committed,
            "good": self.good,
            "usable": self.usable,
            "problem": self.problem,
            **({metric: self.val_metric(metric), "val_step": self.val_step} if metric is not None else {}),
        }


VAL_METRIC = "val/score/mean"  # what "best" ranks by unless checkpoint.keep_best names another (its default)


@dataclass(frozen=True)
class KeepBest:
    """Which snapshots are the best: by the validation ``metric`` their manifest records, higher
    (``mode`` "max") or lower ("min") first; retention keeps the ``k`` best."""

    metric: str = VAL_METRIC
    mode: str = "max"
    k: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min") or self.k < 1:
            raise ValueError(f"KeepBest needs mode max or min and k >= 1; got mode {self.mode!r}, k {self.k}")

    def rank(self, infos: Sequence[SnapshotInfo]) -> list[SnapshotInfo]:
        """Those of ``infos`` taken at a validated step that record the metric, best first (of equal
        values, the earlier step). A snapshot taken between validations carries the last one's value,
        which its own weights never scored: it never ranks."""
        sign = -1.0 if self.mode == "max" else 1.0
        scored = [
            (value, i) for i in infos if i.step == i.val_step and (value := i.val_metric(self.metric)) is not None
        ]
        scored.sort(key=lambda vi: (sign * vi[0], vi[1].step))
        return [i for _, i in scored]


@dataclass
class Retention:
    keep_last: int | None = None  # None: keep every snapshot
    keep_every: int = 0  # also keep steps that are multiples of this (0: none)
    protected: set[int] = field(default_factory=set)  # steps a pending rollback needs
    best: KeepBest | None = None  # also keep the k best good snapshots by a validation metric
    rollback_best: tuple[KeepBest, ...] = ()  # and the best by each metric a policy may roll back to

    @property
    def best_rules(self) -> list[KeepBest]:
        """Every rule of "best" whose snapshots retention keeps."""
        return [*([self.best] if self.best is not None else []), *self.rollback_best]


@dataclass
class _Job:
    """A snapshot staged by ``save`` for the commit thread to have written and to commit: ``work`` is
    written by the writer process (``payload``, the work pickled for it) or, without one, in the thread."""

    step: int
    manifest: dict[str, Any]
    stall: float
    work: WriteJob
    staged: threading.Event
    payload: bytes | None = None

    @property
    def stage(self) -> str:
        return self.work.stage


class SnapshotManager:
    """One run's snapshots: when to take them (``should_save``), writing and committing them, which to
    keep (``Retention``, and ``protect``: never the one a rollback of ``max_steps_back`` steps needs),
    discovery and restore. ``collectives`` are the ranks' (``Local()`` for one process); ``topology`` the
    facts besides the world size a snapshot must have been written for to be usable here.
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
        self.quarantined: list[SnapshotInfo] = []  # moved aside by remove_uncommitted, with the reason
        self.commit_delay = 0.0  # fault drills: seconds to wait before committing

    # -- cadence and protection ----------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``step`` is on the snapshot schedule (every ``every`` steps)."""
        return bool(self.every) and step % self.every == 0

    def protect(self, step: int) -> None:
        """Before saving ``step``: retention keeps the newest good snapshot a rollback of
        ``max_steps_back`` steps from here would need (nothing to do when no policy steps back)."""
        if not self.max_steps_back:
            return
        horizon = step - self.max_steps_back
        needed = [i.step for i in self.scan() if i.good and i.step <= horizon]
        self.retention.protected = set(needed[-1:])

    # -- discovery ---------------------------------------------------------------------------------
    def scan(self, deep: bool = False, files: bool = True) -> list[SnapshotInfo]:
        """Every step directory, committed or not, oldest first. ``files``: also check that every file
        its manifest lists is there with its size (False: the manifest alone, for a caller that restores
        the snapshot it picks, which verifies every file it reads); ``deep`` also checks every sha256 (on
        any storage, streamed)."""
        infos = [SnapshotInfo(step, name) for step, name in self._step_dirs()]
        for info in infos:
            self._inspect(info, deep, files)
        return infos

    def _step_dirs(self) -> list[tuple[int, str]]:
        """(step, directory name) of every step directory, oldest first."""
        found = [(int(m.group(1)), name) for name in self.storage.listdir() if (m := _STEP_DIR.match(name))]
        return sorted(found)

    def _inspect(self, info: SnapshotInfo, deep: bool, files: bool = True) -> None:
        try:
            raw = self.storage.read_bytes(info.name, MANIFEST)
        except FileNotFoundError:
            info.problem = "no manifest: never committed (interrupted or in progress)"
            return
        try:
            info.manifest = parse_manifest(raw)
        except UnreadableManifest as exc:
            info.problem, info.unreadable = str(exc), True
            return
        info.problem = self._problem(info, deep, files)

    def _problem(self, info: SnapshotInfo, deep: bool, files: bool = True) -> str | None:
        m = info.manifest or {}
        if m["format"] != FORMAT:
            return f"manifest format {m['format']!r}; this rlctl reads format {FORMAT}"
        if m["step"] != info.step:
            return f"its manifest is of step {m['step']}, not of step {info.step}"
        if m["world_size"] != self.world_size:
            return f"written by {m['world_size']} rank(s); this run has {self.world_size}"
        for fact in self.topology:
            if (problem := fact.problem(m)) is not None:
                return problem
        if not (files or deep):
            return None
        sizes = self.storage.file_sizes(info.name)
        for rel, meta in m["files"].items():
            if rel not in sizes:
                return f"file {rel} is missing"
            if (size := sizes[rel]) != meta["size"]:
                return f"file {rel} has {size} bytes; the manifest says {meta['size']}"
        return stored_checksum_problem(self.storage, info.name, m) if deep else None

    def remove_uncommitted(self) -> list[int]:
        """Tidy up before choosing a snapshot (call only as the run's writer): delete the step
        directories without a manifest file, this protocol's own unfinished temporaries, and move those
        whose manifest cannot be read to quarantine/ (never deleted; each is reported and listed in
        ``quarantined``, with the reason and where it went in its ``problem``). Returns the steps
        deleted."""
        removed = []
        for info in self.scan():
            if info.unreadable:
                self._quarantine(info)
            elif not info.committed:
                self.storage.rm(info.name, recursive=True)
                removed.append(info.step)
        return removed

    def _quarantine(self, info: SnapshotInfo) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest, n = f"{QUARANTINE}/{info.name}.{stamp}", 1
        while self.storage.exists(dest):
            dest, n = f"{QUARANTINE}/{info.name}.{stamp}-{n}", n + 1
        self.storage.move_dir(info.name, dest)
        reason, location = info.problem, self.storage.url_of(dest)
        info.problem = f"{reason}; moved to {location}"
        self.quarantined.append(info)
        self.on_event({"event": "snapshot_quarantined", "step": info.step, "reason": reason, "location": location})

    @property
    def best_rule(self) -> KeepBest:
        """What "best" means for this run: retention's keep_best, else the highest val/score/mean."""
        return self.retention.best or KeepBest()

    def best(self, metric: str, mode: str, files: bool = True) -> list[SnapshotInfo]:
        """The usable good snapshots of validated steps that record validation ``metric``, best first
        (``mode`` "max": highest first; "min": lowest; of equal values the earlier step). ``files``: as
        for ``scan``."""
        return KeepBest(metric, mode).rank([i for i in self.scan(files=files) if i.usable and i.good])

    def candidates(self, spec: int | str) -> list[SnapshotInfo]:
        """Snapshots to try for ``spec``, best first. An explicit step gives that one only; "best" the
        good committed snapshots that record ``best_rule``'s metric, best value first (raises when none
        does). Those that cannot be read (in place, or quarantined by this manager) come with their
        ``problem`` and are never usable: the caller says why it skips them."""
        infos = self.scan()
        if spec == "best":
            return self._best_candidates(infos)
        if isinstance(spec, int):
            match = [i for i in infos if i.step == spec] or [i for i in self.quarantined if i.step == spec][-1:]
            if not match:
                steps = ", ".join(str(i.step) for i in infos if i.usable) or "none"
                raise SnapshotError(f"no snapshot of step {spec} in {self.storage.url} (usable steps: {steps})")
            return match
        found = [i for i in infos if i.committed or i.unreadable] + self.quarantined
        ordered = sorted(found, key=lambda i: i.step, reverse=True)
        return [i for i in ordered if i.good] if spec == "last-good" else ordered

    def _best_candidates(self, infos: list[SnapshotInfo]) -> list[SnapshotInfo]:
        rule = self.best_rule
        ranked = rule.rank([i for i in infos if i.committed and i.good])
        if not ranked:
            raise SnapshotError(
                f"no good snapshot in {self.storage.url} records the validation metric {rule.metric} (a "
                "snapshot records it once the run has validated: trainer.val_every)"
            )
        return ranked

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
            deferred, blobs = self._stage_files(stage, states, dirs, extra_files)
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
            stage = tempfile.mkdtemp(prefix=f"rlctl-{name}-", dir=self.staging_dir)
        os.makedirs(stage, exist_ok=True)
        return stage

    def _stage_files(self, stage, states, dirs, extra_files):
        """Every directory-Stateful saved (its files deferred), this rank's states serialized and (rank
        0) the extra files: the deferred (path, object) pairs and the blobs, for the writer to write."""
        import torch

        deferred: list[tuple[str, Any]] = []
        for key, obj in dirs.items():
            obj.save_to_dir(os.path.join(stage, key), lambda path, state: deferred.append((path, state)))
        buf = io.BytesIO()
        torch.save({key: obj.state_dict() for key, obj in states.items()}, buf)
        blobs = {state_file(self.rank): buf.getvalue()}
        if self.rank == 0:
            blobs.update(extra_files or {})
        return deferred, blobs

    def start_writer(self) -> None:
        """Start this process's snapshot writer now rather than at the first snapshot (call on a thread
        that lives as long as the run); nothing to do without one."""
        if self.writer == "process":
            with contextlib.suppress(OSError):  # (the first snapshot tries again, and says what fails)
                writer().start()

    def _hand_over(self, work: WriteJob) -> bytes | None:
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
                self.on_event({"event": "snapshot_writer_fallback", "reason": str(exc), "writer": "thread"})
            return None
        self.start_writer()
        return payload

    def _write_files(self, job: _Job) -> Written | None:
        """Have the job's files written (by the writer process, or here) and brought to storage."""
        if job.payload is None:
            return finish(job.work, job.staged.set)
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
        delay = self.commit_delay or float(faults.value("commit_delay", job.step) or 0)
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
                "event": "snapshot_committed",
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
            self.on_event({"event": "snapshots_purge_failed", "step": job.step, "error": describe(exc)})

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
        event = self.failures.failed(step, cause)
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
        """Apply keep_last / keep_every to the usable snapshots. Never removes the newest snapshot, the
        newest good one, the k best good ones by keep_best's metric (and the best by each metric a
        policy rolls back to), a protected step, nor any snapshot
        that is not usable (unreadable, damaged or of another format: what cannot be read is never
        deleted). Runs only after a commit."""
        r = self.retention
        usable = [i for i in self.scan() if i.usable]
        if r.keep_last is None or not usable:
            return []
        keep = {i.step for i in usable[-r.keep_last :]} | set(r.protected) | {usable[-1].step}
        good = [i for i in usable if i.good]
        if good:
            keep.add(good[-1].step)
        if r.keep_every:
            keep |= {i.step for i in usable if i.step % r.keep_every == 0}
        for rule in r.best_rules:
            keep |= {i.step for i in rule.rank(good)[: rule.k]}
        removed = []
        for info in usable:
            if info.step not in keep:
                # un-commit first (the manifest goes), so a crash mid-delete leaves no broken snapshot
                self.storage.rm(info.name, MANIFEST)
                self.storage.rm(info.name, recursive=True)
                removed.append(info.step)
        if removed:
            self.on_event({"event": "snapshots_purged", "steps": removed})
        return removed

    def abandon_after(self, step: int, tag: str) -> list[int]:
        """Move committed snapshots later than ``step`` to abandoned/<tag>/ (a resume turned away from
        them; they are kept, not deleted)."""
        moved = []
        for at, name in self._step_dirs():
            if at > step:
                self.storage.move_dir(name, f"abandoned/{tag}/{name}")
                moved.append(at)
        return moved

    # -- restoring ---------------------------------------------------------------------------------
    def restore(self, info: SnapshotInfo, states: dict[str, Stateful], dirs: dict[str, DirStateful]) -> None:
        """Verify the checksum of every file this rank reads, then load every Stateful. Raises
        SnapshotError when the snapshot is not usable; nothing is loaded then. With several ranks, each
        rank fetches (from object storage) and checks only the shared files and its own, so together
        they check every file once plus the shared ones N times, and they agree before any loads: a
        snapshot one rank finds broken is skipped by all of them."""
        import torch

        self.wait()  # a snapshot still in flight is finished first
        problem, local, cleanup = info.problem, None, (lambda: None)
        try:
            if problem is None:
                mine = files_of_rank((info.manifest or {}).get("files", {}), self.rank, dir_file_rank(dirs))
                local, cleanup = self.storage.local_copy(info.name, files=mine)
                problem = info.problem = checksum_problem(local, info.manifest or {}, only=mine)
            if not self.collectives.all(problem is None):
                raise SnapshotError(
                    f"snapshot {info.name} is not usable: {problem or 'another rank found it broken (see its error)'}"
                )
            saved = torch.load(os.path.join(local, state_file(self.rank)), weights_only=False, map_location="cpu")
            missing = sorted(set(states) - set(saved))
            if missing:
                raise SnapshotError(f"snapshot {info.name} holds no state for {', '.join(missing)}")
            for key, obj in dirs.items():
                obj.load_from_dir(os.path.join(local, key))
            for key, obj in states.items():
                obj.load_state_dict(saved[key])
        finally:
            cleanup()
        self.last_committed = info.step
