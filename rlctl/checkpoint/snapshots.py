"""Snapshots: scheduled, staged while training waits, uploaded and committed in the background.

Layout under the checkpoint directory (RUN_DIR/checkpoints unless ``checkpoint.dir`` says otherwise)::

    step-000500/
      <name>/...          each directory-Stateful in its own format (the engines: weights, optimizer ...)
      state.pt            every other Stateful's state_dict (trainer, data cursor, RNG, KL controller ...)
      <extra files>       the resolved config, the model's HF config and tokenizer
      manifest.json       written last, created exclusively: the only proof the snapshot exists
    abandoned/<time>/step-000700/   snapshots of a branch a resume turned away from (never deleted)

The manifest lists every file with its size and sha256, the rlctl version, the world size and the
run's other topology facts (each a ``Topology`` its caller names, such as the engine's partitioning).
A directory without a manifest is not a snapshot: discovery ignores it and start-up removes it.
"latest" is found by listing, never from a pointer file.

With several ranks every rank writes its own files into the same step directory (its engine shards
and ``state.rank-N.pt``, its own RNG and counters), then ``ranks/rank-N.json`` listing them with size
and sha256. Rank 0 commits: it waits for every rank's list, checks each listed file is on storage with
the listed size, and only then creates the manifest covering all of them.
"""

from __future__ import annotations

import hashlib
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
from rlctl.checkpoint.writer import DurableFile
from rlctl.errors import SnapshotError
from rlctl.stateful import Stateful
from rlctl.storage import Storage, with_retries

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
RANKS_DIR = "ranks"


def state_file(rank: int) -> str:
    return STATE_FILE if rank == 0 else f"state.rank-{rank}.pt"


def rank_list(rank: int) -> str:
    return f"{RANKS_DIR}/rank-{rank}.json"


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


FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")

EventFn = Callable[[dict[str, Any]], None]


Defer = Callable[[str, Callable[[Any], None]], None]


class DirStateful(Protocol):
    """State too big or too structured for a state_dict: saved into, and loaded from, a directory.

    ``save_to_dir`` may write files at once, or hand a file to ``defer(path, write)``: the manager then
    calls ``write(fileobj)`` on its background thread. Whoever defers promises that what ``write`` reads
    does not change until ``SnapshotManager.wait_staged()`` returns (the actor waits there before its
    next optimizer step)."""

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
    """'latest' | 'last-good' | 'step-500' | '500' -> 'latest' | 'last-good' | 500."""
    if spec in ("latest", "last-good"):
        return spec
    m = re.fullmatch(r"(?:step-)?0*(\d+)", spec)
    if not m:
        raise SnapshotError(f"--from expects latest, last-good, step-N or N; got {spec!r}")
    return int(m.group(1))


@dataclass
class SnapshotInfo:
    step: int
    name: str
    manifest: dict[str, Any] | None = None
    problem: str | None = None  # why the snapshot is not usable

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def usable(self) -> bool:
        return self.committed and self.problem is None

    @property
    def good(self) -> bool:
        return bool(self.manifest and self.manifest.get("good"))

    def as_row(self) -> dict[str, Any]:
        m = self.manifest or {}
        return {
            "step": self.step,
            "name": self.name,
            "time": m.get("created"),
            "bytes": m.get("total_bytes"),
            "committed": self.committed,
            "good": self.good,
            "usable": self.usable,
            "problem": self.problem,
        }


def sha256_file(path: str, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _local_files(
    root: str, known: dict[str, dict[str, Any]], skip: set[str] = frozenset()
) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``root``, each fsynced; ``known`` ones (written by a
    DurableFile, already hashed and synced) are taken as they are; ``skip`` ones (other ranks') left out."""
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel == MANIFEST or rel in skip:
                continue
            files[rel] = known[rel] if rel in known else _durable_meta(full)
    return dict(sorted(files.items()))


def _durable_meta(path: str) -> dict[str, Any]:
    """Size and sha256 of a file written without a DurableFile, fsynced: durable before a manifest
    (or a rank's list) can claim it."""
    meta = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
    _fsync(path)
    return meta


def _write_deferred(stage: str, deferred, staged: threading.Event, hold: float = 0.0) -> dict[str, dict[str, Any]]:
    """Write the deferred files (each hashed and synced as it goes), then release training at
    ``staged``, even on failure. Returns their sizes and sha256 by path relative to ``stage``.
    ``hold`` is the write_delay fault drill."""
    known = {}
    try:
        if deferred and hold:
            time.sleep(hold)
        for path, write in deferred:
            with DurableFile(path) as fh:
                write(fh)
            size, digest = fh.close()
            known[os.path.relpath(path, stage).replace(os.sep, "/")] = {"size": size, "sha256": digest}
    finally:
        staged.set()  # the live state is no longer read: training may step again
    return known


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Retention:
    keep_last: int | None = None  # None: keep every snapshot
    keep_every: int = 0  # also keep steps that are multiples of this (0: none)
    protected: set[int] = field(default_factory=set)  # steps a pending rollback needs


class SnapshotManager:
    """One run's snapshots: when to take them (``should_save``), writing and committing them, which to
    keep (``Retention``, and ``protect``: never the one a rollback of ``max_steps_back`` steps needs),
    discovery and restore. ``collectives`` are the ranks' (``Local()`` for one process); ``topology`` the
    facts besides the world size a snapshot must have been written for to be usable here."""

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
        retry_delay: float = 0.5,
        rank_timeout: float = 1800.0,
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
        self.retry_delay = retry_delay
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlctl-snapshot")
        self._pending: Future | None = None
        self._staged = threading.Event()
        self._staged.set()
        self._lock = threading.Lock()
        self.last_committed: int | None = None
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
    def scan(self, deep: bool = False) -> list[SnapshotInfo]:
        """Every step directory, committed or not, oldest first. ``deep`` also checks every sha256."""
        infos = []
        for name in self.storage.listdir():
            m = _STEP_DIR.match(name)
            if not m:
                continue
            info = SnapshotInfo(int(m.group(1)), name)
            self._inspect(info, deep)
            infos.append(info)
        return sorted(infos, key=lambda i: i.step)

    def _inspect(self, info: SnapshotInfo, deep: bool) -> None:
        try:
            raw = self.storage.read_bytes(info.name, MANIFEST)
        except FileNotFoundError:
            info.problem = "no manifest: never committed (interrupted or in progress)"
            return
        try:
            info.manifest = orjson.loads(raw)
        except orjson.JSONDecodeError:
            info.problem = "manifest.json is not valid JSON"
            return
        info.problem = self._problem(info, deep)

    def _problem(self, info: SnapshotInfo, deep: bool) -> str | None:
        m = info.manifest or {}
        if m.get("format") != FORMAT:
            return f"manifest format {m.get('format')!r}; this rlctl reads format {FORMAT}"
        if m.get("world_size") != self.world_size:
            return f"written by {m.get('world_size')} rank(s); this run has {self.world_size}"
        for fact in self.topology:
            if (problem := fact.problem(m)) is not None:
                return problem
        existing = set(self.storage.walk_files(info.name))
        for rel, meta in m.get("files", {}).items():
            if rel not in existing:
                return f"file {rel} is missing"
            if self.storage.size(info.name, rel) != meta["size"]:
                return f"file {rel} has {self.storage.size(info.name, rel)} bytes; the manifest says {meta['size']}"
        if deep and self.storage.is_local:
            return checksum_problem(self.storage.path(info.name), m)
        return None

    def remove_uncommitted(self) -> list[int]:
        """Delete step directories without a manifest (left by a crash). Call only as the run's writer."""
        removed = []
        for info in self.scan():
            if not info.committed:
                self.storage.rm(info.name, recursive=True)
                removed.append(info.step)
        return removed

    def candidates(self, spec: int | str) -> list[SnapshotInfo]:
        """Snapshots to try for ``spec``, best first. An explicit step gives that one only."""
        infos = self.scan()
        if isinstance(spec, int):
            match = [i for i in infos if i.step == spec]
            if not match:
                steps = ", ".join(str(i.step) for i in infos if i.usable) or "none"
                raise SnapshotError(f"no snapshot of step {spec} in {self.storage.url} (usable steps: {steps})")
            return match
        committed = [i for i in reversed(infos) if i.committed]
        return [i for i in committed if i.good] if spec == "last-good" else committed

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
        seconds training stalled."""
        import torch

        t0 = time.perf_counter()
        self.protect(step)
        self.wait()
        name = step_name(step)
        if self.rank == 0 and not self.storage.exists(name, MANIFEST):
            self.storage.rm(name, recursive=True)  # an uncommitted leftover of the same step
        self.collectives.barrier()  # no rank writes before the leftover is gone
        if self.storage.exists(name, MANIFEST):  # (rank 0 left it alone: every rank sees it and stops)
            raise SnapshotError(f"a committed snapshot of step {step} already exists in {self.storage.url}")
        if self.storage.is_local:
            stage = self.storage.path(name)  # stage in place: the manifest still commits it
        else:
            stage = tempfile.mkdtemp(prefix=f"rlctl-{name}-", dir=self.staging_dir)
        os.makedirs(stage, exist_ok=True)
        deferred: list[tuple[str, Callable[[Any], None]]] = []
        for key, obj in dirs.items():
            obj.save_to_dir(os.path.join(stage, key), lambda path, write: deferred.append((path, write)))
        buf = io.BytesIO()
        torch.save({key: obj.state_dict() for key, obj in states.items()}, buf)
        own = [state_file(self.rank)]  # what this rank wrote besides the deferred files
        _write(os.path.join(stage, own[0]), buf.getvalue())
        for rel, data in (extra_files or {}).items() if self.rank == 0 else ():
            _write(os.path.join(stage, *rel.split("/")), data)
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
        stall = time.perf_counter() - t0
        staged = threading.Event()
        with self._lock:
            self._staged = staged
            self._pending = self._pool.submit(self._commit, step, stage, manifest, stall, deferred, staged, own)
        if not self.asynchronous:
            self.wait()
        return stall

    def _commit(self, step, stage, manifest, stall, deferred, staged, own) -> bool:
        if self.rank != 0:
            return self._write_rank_files(step, stage, deferred, staged, own)
        name = step_name(step)
        t0 = time.perf_counter()
        try:
            known = _write_deferred(stage, deferred, staged, hold=float(faults.value("write_delay", step) or 0))
            manifest["write_s"] = round(time.perf_counter() - t0, 4)
            others = self._other_ranks_files(name) if self.world_size > 1 else {}
            manifest["files"] = dict(sorted({**_local_files(stage, known, skip=set(others)), **others}.items()))
            manifest["total_bytes"] = sum(f["size"] for f in manifest["files"].values())
            if not self.storage.is_local:
                with_retries(
                    lambda: self.storage.put_dir(stage, name),
                    base_delay=self.retry_delay,
                    on_retry=lambda n, exc: self._retry_event(step, n, exc),
                )
            delay = self.commit_delay or float(faults.value("commit_delay", step) or 0)
            if delay:
                time.sleep(delay)
            data = orjson.dumps(manifest, option=orjson.OPT_INDENT_2)
            with_retries(
                lambda: self.storage.write_bytes(f"{name}/{MANIFEST}", data, exclusive=True),
                base_delay=self.retry_delay,
                on_retry=lambda n, exc: self._retry_event(step, n, exc),
            )
        except Exception as exc:
            self.on_event({"event": "snapshot_failed", "step": step, "error": f"{type(exc).__name__}: {exc}"})
            if not self.storage.exists(name, MANIFEST):
                self.storage.rm(name, recursive=True)  # never half-visible, and no litter
            return False
        finally:
            if not self.storage.is_local:
                shutil.rmtree(stage, ignore_errors=True)
        self.last_committed = step
        self.on_event(
            {
                "event": "snapshot_committed",
                "step": step,
                "good": manifest["good"],
                "bytes": manifest["total_bytes"],
                "stall_s": round(stall, 4),
                "commit_s": round(time.perf_counter() - t0, 4),
                "location": self.storage.url_of(name),
            }
        )
        self.purge()
        return True

    def _write_rank_files(self, step, stage, deferred, staged, own) -> bool:
        """A rank other than 0: write, hash and upload this rank's files, then list them in
        ranks/rank-N.json for rank 0 to verify and commit. Rank 0 reports the outcome."""
        name = step_name(step)
        try:
            known = _write_deferred(stage, deferred, staged)
            known.update({rel: _durable_meta(os.path.join(stage, rel)) for rel in own})
            if not self.storage.is_local:
                with_retries(lambda: self.storage.put_dir(stage, name), base_delay=self.retry_delay)
            data = orjson.dumps({"rank": self.rank, "files": known})
            with_retries(
                lambda: self.storage.write_bytes(f"{name}/{rank_list(self.rank)}", data), base_delay=self.retry_delay
            )
            return True
        except Exception as exc:  # rank 0 reads the error from the list and reports the snapshot failed
            error = orjson.dumps({"rank": self.rank, "error": f"{type(exc).__name__}: {exc}"})
            try:
                self.storage.write_bytes(f"{name}/{rank_list(self.rank)}", error)
            except Exception:
                pass  # then rank 0 times out waiting for the list
            return False
        finally:
            if not self.storage.is_local:
                shutil.rmtree(stage, ignore_errors=True)

    def _other_ranks_files(self, name: str) -> dict[str, dict[str, Any]]:
        """Wait for every other rank's file list, then check each listed file is on storage with its
        listed size. Raises when a rank's list does not come within ``rank_timeout`` or a file is off."""
        files: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + self.rank_timeout
        for rank in range(1, self.world_size):
            while not self.storage.exists(name, rank_list(rank)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} did not list its snapshot files within {self.rank_timeout:.0f} s")
                time.sleep(0.05)
            raw = self.storage.read_bytes(name, rank_list(rank))
            files[rank_list(rank)] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
            listed = orjson.loads(raw)
            if "error" in listed:
                raise RuntimeError(f"rank {rank} could not write its files: {listed['error']}")
            for rel, meta in listed["files"].items():
                size = self.storage.size(name, rel) if self.storage.exists(name, rel) else None
                if size != meta["size"]:
                    raise RuntimeError(
                        f"rank {rank}'s file {rel} is {'missing' if size is None else f'{size} bytes'}; "
                        f"its list says {meta['size']} bytes"
                    )
                files[rel] = meta
        return files

    def _retry_event(self, step: int, attempt: int, exc: Exception) -> None:
        self.on_event({"event": "snapshot_retry", "step": step, "attempt": attempt, "error": str(exc)})

    def wait_staged(self) -> None:
        """Block until the snapshot in flight no longer reads live state (its deferred files are
        written). Cheap when nothing is in flight."""
        self._staged.wait()

    def wait(self) -> bool | None:
        """Block until the snapshot in flight (if any) is committed or has failed; its outcome."""
        with self._lock:
            job, self._pending = self._pending, None
        return None if job is None else job.result()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)

    # -- retention ---------------------------------------------------------------------------------
    def purge(self) -> list[int]:
        """Apply keep_last / keep_every to committed snapshots. Never removes the newest snapshot, the
        newest good one, nor a protected step. Runs only after a commit."""
        r = self.retention
        committed = [i for i in self.scan() if i.committed]
        if r.keep_last is None or not committed:
            return []
        keep = {i.step for i in committed[-r.keep_last :]} | set(r.protected) | {committed[-1].step}
        good = [i for i in committed if i.good]
        if good:
            keep.add(good[-1].step)
        if r.keep_every:
            keep |= {i.step for i in committed if i.step % r.keep_every == 0}
        removed = []
        for info in committed:
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
        for info in self.scan():
            if info.step > step:
                self.storage.move_dir(info.name, f"abandoned/{tag}/{info.name}")
                moved.append(info.step)
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


def checksum_problem(local_dir: str, manifest: dict[str, Any], only: list[str] | None = None) -> str | None:
    """The first file (of ``only``, or of all) missing or unlike its sha256 in the manifest, said."""
    wanted = None if only is None else set(only)
    for rel, meta in manifest.get("files", {}).items():
        if wanted is not None and rel not in wanted:
            continue
        path = os.path.join(local_dir, *rel.split("/"))
        if not os.path.exists(path):
            return f"file {rel} is missing"
        if sha256_file(path) != meta["sha256"]:
            return f"file {rel} does not match its sha256 (corrupt)"
    return None


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)
