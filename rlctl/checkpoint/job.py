"""One rank's share of a snapshot, written: the work the snapshot writer does, in its own process or
(``checkpoint.writer: thread``, or storage no other process can see) in a thread of the training process.

A ``WriteJob`` is everything that work needs and nothing of the manager: the staged directory, the
deferred objects (state dicts whose tensors are the live state, written with ``torch.save``), the files
the rank already wrote there, and the storage. ``finish`` writes the deferred files (each hashed and
fsynced as it goes, by a ``DurableFile``), says so through ``staged`` (from then on nothing reads the
live state), and then:

- rank 0: waits for every other rank's list of files and checks each listed file is on storage with the
  listed size, hashes its own files that no DurableFile wrote, uploads the staged directory (object
  storage), and returns the files the manifest will list. Writing the manifest (the commit) is the
  caller's: it checks the run's lease right before;
- every other rank: uploads its files, then lists them with size and sha256 (``layout.rank_list``).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from rlctl.checkpoint.durable import DurableFile, save_object
from rlctl.checkpoint.layout import MANIFEST, rank_list
from rlctl.checkpoint.manifest import parse_rank_list, sha256_file
from rlctl.storage import Storage, fsync_path

Files = dict[str, dict[str, Any]]


@dataclass
class WriteJob:
    """What a rank writes for the snapshot ``name``: ``deferred`` (path, object) pairs serialized into
    ``stage``, and ``blobs``, small files serialized already (the rank's state file, rank 0's extra
    files) by path relative to ``stage``. ``hold`` is the write_delay fault drill."""

    name: str
    stage: str
    storage: Storage
    rank: int = 0
    world_size: int = 1
    rank_timeout: float = 1800.0
    deferred: list[tuple[str, Any]] = field(default_factory=list)
    blobs: dict[str, bytes] = field(default_factory=dict)
    hold: float = 0.0


@dataclass
class Written:
    """What rank 0's writer brought to storage: the files for the manifest (every rank's), and how long
    uploading its own staged files took (object storage; 0 on a local disk, where they are staged in place)."""

    files: Files
    upload_s: float = 0.0
    upload_bytes: int = 0


def finish(job: WriteJob, staged: Callable[[], None]) -> Written | None:
    """Write the job's files and bring them to storage (see the module's docstring). ``staged`` is
    called once the live state is no longer read, also when writing fails. Rank 0: what the manifest
    lists; other ranks: None, once their list is written."""
    known = write_deferred(job, staged)
    known.update(write_blobs(job))
    if job.rank != 0:
        upload(job)
        data = orjson.dumps({"rank": job.rank, "files": known})
        job.storage.write_bytes(f"{job.name}/{rank_list(job.rank)}", data)
        return None
    others = other_ranks_files(job) if job.world_size > 1 else {}
    files = {**local_files(job.stage, known, skip=set(others)), **others}
    t0 = time.perf_counter()
    uploaded = upload(job)
    return Written(dict(sorted(files.items())), round(time.perf_counter() - t0, 4), uploaded)


def upload(job: WriteJob) -> int:
    """Upload the staged files, several at a time (none on a local disk: staged in place). Bytes sent."""
    return 0 if job.storage.is_local else job.storage.put_dir(job.stage, job.name)


def write_deferred(job: WriteJob, staged: Callable[[], None]) -> Files:
    """Serialize the deferred objects (each file hashed and synced as it goes), then call ``staged``,
    even on failure. Their sizes and sha256 by path relative to the stage."""
    known = {}
    try:
        if job.deferred and job.hold:
            time.sleep(job.hold)
        for path, obj in job.deferred:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with DurableFile(path) as fh:
                save_object(obj, fh)
            size, digest = fh.close()
            known[os.path.relpath(path, job.stage).replace(os.sep, "/")] = {"size": size, "sha256": digest}
    finally:
        staged()
    return known


def write_blobs(job: WriteJob) -> Files:
    """Write the job's blobs into its stage, each hashed and synced. Their sizes and sha256."""
    known = {}
    for rel, data in job.blobs.items():
        path = os.path.join(job.stage, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        known[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return known


def local_files(root: str, known: Files, skip: set[str] = frozenset()) -> Files:
    """Size and sha256 of every file under ``root``, each fsynced; ``known`` ones (written by a
    DurableFile, already hashed and synced) are taken as they are; ``skip`` ones (other ranks') left out."""
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel == MANIFEST or rel in skip:
                continue
            files[rel] = known[rel] if rel in known else durable_meta(full)
    return dict(sorted(files.items()))


def durable_meta(path: str) -> dict[str, Any]:
    """Size and sha256 of a file written without a DurableFile, fsynced: durable before a manifest
    (or a rank's list) can claim it."""
    meta = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
    fsync_path(path)
    return meta


def other_ranks_files(job: WriteJob) -> Files:
    """Wait for every other rank's file list, then check each listed file is on storage with its
    listed size. Raises when a rank's list does not come within ``rank_timeout`` or a file is off."""
    storage, name = job.storage, job.name
    files: Files = {}
    deadline = time.monotonic() + job.rank_timeout
    for rank in range(1, job.world_size):
        while not storage.exists(name, rank_list(rank)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} did not list its snapshot files within {job.rank_timeout:.0f} s")
            time.sleep(0.05)
        raw = storage.read_bytes(name, rank_list(rank))
        files[rank_list(rank)] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        listed = parse_rank_list(raw, rank)
        if "error" in listed:
            raise RuntimeError(f"rank {rank} could not write its files: {listed['error']}")
        for rel, meta in listed["files"].items():
            size = storage.size(name, rel) if storage.exists(name, rel) else None
            if size != meta["size"]:
                raise RuntimeError(
                    f"rank {rank}'s file {rel} is {'missing' if size is None else f'{size} bytes'}; "
                    f"its list says {meta['size']} bytes"
                )
            files[rel] = meta
    return files
