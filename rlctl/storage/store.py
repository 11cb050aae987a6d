"""``Storage``: a directory on any fsspec filesystem: local paths, file://, s3://, gs://, memory://.

Options for the filesystem come from the caller (``checkpoint.storage_options``) merged over fsspec's
own configuration (``FSSPEC_S3='{"client_kwargs": {"endpoint_url": ...}}'`` or ~/.config/fsspec), so a
run directory on S3 can be read before its config is.

Every method raises ``StorageError`` (one sentence: the URL and the cause) for any failure of any backend
except absence: FileNotFoundError (on reads) and FileExistsError pass through. Transient failures
(connection refused or reset, timeouts, throttling, 5xx) are retried with capped exponential backoff for
up to ``retry_timeout`` seconds; permanent ones fail at once: a refusal (a bucket that does not exist,
access denied, bad credentials) as ``StorageRefused`` (exit 13), any other (no space) as ``StorageError``.
Object store clients are set to fail fast so that this budget, not their own retries, governs; their
retry jitter draws from a private
generator, never from the run's global ``random`` stream. A bucket is never created: a missing one is
a refusal (``check_reachable`` says so before any work).

A read-only command (``inspect``, ``checkpoints``, ``runs``) opens its storage ``Storage.for_reading(url,
seconds)``: its ``--timeout`` is then both the retry budget and the longest an object-store request may
wait to connect or for a read, so that an unreachable store answers in about that long; a location
opened ``beside`` it (the run's checkpoint storage) keeps those bounds. Training keeps its long budget
(``checkpoint.retry_timeout``), to ride out short outages.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import posixpath
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rlctl.errors import ConfigError
from rlctl.storage.appends import appender, write_whole
from rlctl.storage.clients import EXTRAS, S3, fence_third_party_random, open_fs, url_problem
from rlctl.storage.failures import (
    ABSENCE,
    guarded,
    not_found,
    refused,
)

__all__ = ["RETRY_TIMEOUT_ENV", "Storage", "default_retry_timeout", "fsync_path"]

T = TypeVar("T")

# -- the storage -------------------------------------------------------------------------------------


def _ensure_dir(makedirs: Callable[..., None], path: str) -> None:
    """A directory and its parents; a file in the way is "not a directory", never FileExistsError
    (which callers read as "the file I create exclusively exists")."""
    try:
        makedirs(path, exist_ok=True)
    except FileExistsError as exc:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from exc


def _reopen(url: str, options: dict[str, Any], retry_timeout: float, request_timeout: float | None = None) -> Storage:
    return Storage(url, options, retry_timeout=retry_timeout, request_timeout=request_timeout)


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a local file or directory to disk (a rename is only as durable as what it publishes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SHA_CHUNK = 4 << 20


RETRY_TIMEOUT_ENV = "RLCTL_RETRY_TIMEOUT"  # the budget of a Storage made without one (default 60 s)


def default_retry_timeout() -> float:
    """Seconds a Storage retries a transient failure when its caller named no budget: 60, or
    $RLCTL_RETRY_TIMEOUT (for commands that read a run before its config, such as inspect)."""
    value = os.environ.get(RETRY_TIMEOUT_ENV, "60")
    try:
        return max(0.0, float(value))
    except ValueError:
        raise ConfigError(f"${RETRY_TIMEOUT_ENV} must be a number of seconds, not {value!r}") from None


class Storage:
    def __init__(
        self,
        url: str,
        options: dict[str, Any] | None = None,
        *,
        retry_timeout: float | None = None,
        request_timeout: float | None = None,
    ):
        """``retry_timeout``: seconds a transient failure is retried (None: ``default_retry_timeout()``);
        ``request_timeout``: a reader's bound on each object-store request's connect and read timeouts
        (``for_reading``)."""
        if (problem := url_problem(str(url))) is not None:  # (before "s3://" is cut to a local "s3:")
            raise ConfigError(problem)
        self.url = str(url).rstrip("/") or "/"
        self.options = dict(options or {})
        self.retry_timeout = default_retry_timeout() if retry_timeout is None else float(retry_timeout)
        self.request_timeout = request_timeout
        opened = functools.partial(open_fs, self.url, dict(options or {}), request_timeout)
        self.fs, self.root = guarded("open", self.url, opened, 0.0)
        protocols = _protocols(self.fs)
        self.is_local = "file" in protocols
        self.in_process = "memory" in protocols  # no other process sees it (memory://)
        if not self.is_local:
            fence_third_party_random()

    @classmethod
    def for_reading(cls, url: str, seconds: float, options: dict[str, Any] | None = None) -> Storage:
        """A read-only command's storage (``--timeout``): a store that does not answer is given up on
        (StorageError) after about ``seconds``: that is the retry budget, and no object-store request
        waits longer than it to connect or for a read."""
        return cls(url, options, retry_timeout=seconds, request_timeout=seconds)

    def beside(self, url: str, options: dict[str, Any] | None, retry_timeout: float) -> Storage:
        """Another location that goes with this one (a run's checkpoint storage): with ``retry_timeout``,
        or, beside a reader's storage (``for_reading``), with the reader's bounds."""
        if self.request_timeout is not None:
            return Storage.for_reading(url, self.request_timeout, options)
        return Storage(url, options, retry_timeout=retry_timeout)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def __reduce__(self):
        # another process (the snapshot writer) opens the same location with the same options
        return _reopen, (self.url, self.options, self.retry_timeout, self.request_timeout)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts) if parts else self.root

    def url_of(self, *parts: str) -> str:
        return posixpath.join(self.url, *parts) if parts else self.url

    def child(self, *parts: str) -> Storage:
        sub = Storage.__new__(Storage)
        sub.url, sub.fs, sub.is_local = self.url_of(*parts), self.fs, self.is_local
        sub.options, sub.in_process = self.options, self.in_process
        sub.root, sub.retry_timeout = self.path(*parts), self.retry_timeout
        sub.request_timeout = self.request_timeout
        return sub

    def with_retry_timeout(self, seconds: float) -> Storage:
        """The same location with another retry budget (the lease's heartbeat retries within one beat)."""
        sub = self.child()
        sub.retry_timeout = float(seconds)
        return sub

    def local_path(self, *parts: str) -> str | None:
        """The OS path of a local location; None on a remote filesystem."""
        return self.path(*parts) if self.is_local else None

    def _call(
        self,
        action: str,
        parts: tuple[str, ...],
        fn: Callable[[], T],
        passthrough=ABSENCE,
    ) -> T:
        if not self.is_local:
            fence_third_party_random()
        return guarded(action, self.url_of(*parts), fn, self.retry_timeout, passthrough)

    # -- reading ----------------------------------------------------------------------------------
    def _fresh(self, path: str) -> str:
        """Drop what an object-store client cached about ``path`` and its parents: other processes (the
        other ranks, a resume on another host) write here too, and a stale listing would say that a
        file written since is missing, or that a file moved away is still there."""
        if not self.is_local:
            self.fs.invalidate_cache(path)
        return path

    def exists(self, *parts: str) -> bool:
        return self._call("check", parts, lambda: self.fs.exists(self._fresh(self.path(*parts))))

    def read_bytes(self, *parts: str) -> bytes:
        return self._call("read", parts, lambda: self.fs.cat_file(self.path(*parts)))

    def size(self, *parts: str) -> int:
        return self._call(
            "read the size of",
            parts,
            lambda: int(self.fs.size(self._fresh(self.path(*parts)))),
        )

    def sha256(self, *parts: str) -> str:
        """The sha256 (hex) of one file, streamed in chunks: no local copy, on any backend."""

        def digest() -> str:
            h = hashlib.sha256()
            with self.fs.open(self._fresh(self.path(*parts)), "rb") as fh:
                while chunk := fh.read(SHA_CHUNK):
                    h.update(chunk)
            return h.hexdigest()

        return self._call("read", parts, digest)

    def listdir(self, *parts: str) -> list[str]:
        """Names (not paths) directly under a directory; [] when it does not exist."""
        base = self.path(*parts)
        try:
            entries = self._call("list", parts, lambda: self.fs.ls(self._fresh(base), detail=False))
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries if e.rstrip("/") != base.rstrip("/"))

    def walk_files(self, *parts: str) -> list[str]:
        """Paths of every file under a directory, relative to it."""
        return sorted(self.file_sizes(*parts))

    def file_sizes(self, *parts: str) -> dict[str, int]:
        """The size of every file under a directory, by its path relative to it (one listing; on a
        local disk straight from the directory entries: every commit's retention lists each snapshot)."""
        base = self.path(*parts).rstrip("/")
        if self.is_local:
            return self._call("list", parts, lambda: _local_sizes(base))
        found = self._call("list", parts, lambda: self.fs.find(self._fresh(base), detail=True))
        return {posixpath.relpath(f, base): int(info["size"]) for f, info in found.items()}

    # -- writing ----------------------------------------------------------------------------------
    def makedirs(self, *parts: str) -> None:
        self._call("create directory", parts, lambda: self._makedirs(self.path(*parts)), ())

    def _makedirs(self, path: str) -> None:
        if self.is_object_store:  # no directories there, and s3fs and adlfs would create a missing bucket
            if S3 & _protocols(self.fs):
                # but on S3 one request before the upload: botocore's upload waits for the server's "100
                # Continue" with no timeout, so a store that went silent (paused) is found here instead,
                # by a request that times out (as s3fs's makedirs found it before: it asked too), and
                # a missing bucket is a FileNotFoundError (a refusal), never created
                bucket = path.split("/", 1)[0]
                try:
                    self.fs.info(bucket)
                    missing = False
                except Exception as exc:
                    if not (isinstance(exc, FileNotFoundError) or not_found(exc)):
                        raise
                    missing = True
                if missing:  # (raised out of the handler: no 404 answer in its chain, so a refusal: is_refusal)
                    raise FileNotFoundError(f"{bucket}: no such bucket")
            return
        _ensure_dir(self.fs.makedirs, path)

    @property
    def is_object_store(self) -> bool:
        return bool(set(EXTRAS) & _protocols(self.fs))

    def check_reachable(self) -> None:
        """Before any work: that an object store answers, the location's bucket exists and the location
        may be listed. StorageRefused (exit 13) for a missing bucket, access denied or bad credentials,
        StorageError (12) for a store that does not answer within the retry budget; nothing to check on a
        local path or in memory (a write there says what is wrong)."""
        if self.is_object_store:
            self._call("list", (), self._probe, ())

    def _probe(self) -> None:
        try:
            self.fs.ls(self._fresh(self.root), detail=False)
        except FileNotFoundError as exc:  # nothing there yet; or no bucket (S3 and Azure say so, GCS not)
            bucket = self.root.split("/", 1)[0]
            try:
                self.fs.info(bucket)  # (a refusal here proves nothing: a key may list its prefix alone)
            except FileNotFoundError:
                raise refused("open", self.url, exc) from exc
            except Exception:
                pass

    def write_bytes(self, rel: str, data: bytes, exclusive: bool = False) -> None:
        """Write a whole file. ``exclusive``: fail with FileExistsError if it exists (an atomic create
        on local disks and, through If-None-Match, on S3). Readers never see half a file."""
        path = self.path(rel)
        self._call(
            "write",
            (rel,),
            lambda: self._write(path, data, exclusive),
            (FileExistsError,),
        )

    def _write(self, path: str, data: bytes, exclusive: bool) -> None:
        self._makedirs(posixpath.dirname(path))
        if not self.is_local:
            if exclusive:  # one conditional PUT (If-None-Match) of the whole object
                with self.fs.open(path, "xb") as fh:
                    fh.write(data)
            else:
                write_whole(self.fs, path, data)  # (over an append blob of ours too)
            return
        # complete a temporary file, then rename it into place, or (exclusive) link it: link fails if
        # the name exists, where an "xb" open would show the file empty first
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            if exclusive:
                os.link(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def append_bytes(self, rel: str, data: bytes) -> None:
        """Append to a file (created if it does not exist); on a local disk a failed append is cut back,
        never left half-written. On an object store only the new bytes are sent (``storage.appends``),
        and a try after a failed one completes what the failed one began, never appends twice."""
        path = self.path(rel)
        remote = None if self.is_local else appender(self.fs, path, data)
        self._call("append to", (rel,), lambda: self._append(path, data, remote), ())

    def _append(self, path: str, data: bytes, remote: Callable[[], None] | None) -> None:
        self._makedirs(posixpath.dirname(path))
        if remote is not None:
            remote()
            return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)

    def rm(self, *parts: str, recursive: bool = False) -> None:
        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(*parts), recursive=recursive)

        self._call("remove", parts, remove)

    def move_dir(self, src: str, dst: str) -> None:
        """Move a directory within this storage. Local: one atomic rename. Object stores (where a
        recursive move fails part-way): copy every file, then delete the source, manifest first."""
        if self.is_local:
            target = self.path(dst)
            self._call(
                f"move {self.url_of(src)} to",
                (dst,),
                lambda: self._rename(self.path(src), target),
            )
            return
        files = self.walk_files(src)
        for rel in files:
            copy = functools.partial(self.fs.copy, self.path(src, rel), self.path(dst, rel))
            self._call(f"copy {self.url_of(src, rel)} to", (dst, rel), copy)
        for rel in sorted(files, key=lambda r: r != "manifest.json"):
            self.rm(src, rel)
        self.rm(src, recursive=True)

    @staticmethod
    def _rename(src: str, dst: str) -> None:
        _ensure_dir(os.makedirs, os.path.dirname(dst))
        os.rename(src, dst)

    def put_dir(self, local_dir: str, *parts: str, workers: int = 8) -> int:
        """Upload every file of a local directory below ``parts``, ``workers`` files at a time (a large
        file goes up in parts, as its filesystem does multipart uploads). Returns the bytes uploaded."""
        uploads = []
        for root, _, files in os.walk(local_dir):
            for name in files:
                src = os.path.join(root, name)
                rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
                put = functools.partial(self._put, src, self.path(*parts, rel))
                uploads.append(functools.partial(self._call, "upload to", (*parts, rel), put, ()))
        if len(uploads) > 1 and workers > 1:
            with ThreadPoolExecutor(max_workers=min(workers, len(uploads)), thread_name_prefix="rlctl-upload") as pool:
                for done in [pool.submit(upload) for upload in uploads]:
                    done.result()
        else:
            for upload in uploads:
                upload()
        return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(local_dir) for n in names)

    def _put(self, src: str, dst: str) -> None:
        self._makedirs(posixpath.dirname(dst))
        self.fs.put_file(src, dst)

    def get_dir(self, local_dir: str, *parts: str, files: Iterable[str] | None = None) -> None:
        """Download every file below ``parts`` (or only ``files``, relative to it; those that do not
        exist are left out) into a local directory."""
        wanted = None if files is None else set(files)
        for rel in self.walk_files(*parts):
            if wanted is not None and rel not in wanted:
                continue
            get = functools.partial(
                self._get,
                self.path(*parts, rel),
                os.path.join(local_dir, *rel.split("/")),
            )
            self._call("download", (*parts, rel), get)

    def _get(self, src: str, dst: str) -> None:
        _ensure_dir(os.makedirs, os.path.dirname(dst))
        self.fs.get_file(src, dst)

    def local_copy(self, *parts: str, files: Iterable[str] | None = None) -> tuple[str, Callable[[], None]]:
        """A local directory holding the files below ``parts`` (at least ``files``, relative to it),
        and a cleanup function. On a local filesystem that is the directory itself and the cleanup does
        nothing; from object storage, only ``files`` are downloaded when given."""
        if self.is_local:
            return self.path(*parts), lambda: None
        tmp = self._call("download", parts, lambda: tempfile.mkdtemp(prefix="rlctl-dl-"), ())
        try:
            self.get_dir(tmp, *parts, files=files)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp, lambda: shutil.rmtree(tmp, ignore_errors=True)


def _local_sizes(base: str, prefix: str = "") -> dict[str, int]:
    """The size of every file under local directory ``base`` by its relative path ({} when there is none)."""
    sizes: dict[str, int] = {}
    try:
        entries = list(os.scandir(base))
    except (FileNotFoundError, NotADirectoryError):
        return sizes
    for entry in entries:
        rel = f"{prefix}{entry.name}"
        try:
            if entry.is_dir(follow_symlinks=False):
                sizes.update(_local_sizes(entry.path, f"{rel}/"))
            else:
                sizes[rel] = entry.stat().st_size
        except FileNotFoundError:  # gone since the listing (a temporary renamed into place, a purge), or a
            continue  # dangling link: not there
    return sizes


def _protocols(fs: Any) -> set[str]:
    return set(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else {fs.protocol}
