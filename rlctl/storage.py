"""A directory on any fsspec filesystem: local paths, file://, s3://, gs://, memory://.

Options for the filesystem come from the caller (``checkpoint.storage_options``) merged over fsspec's
own configuration (``FSSPEC_S3='{"client_kwargs": {"endpoint_url": ...}}'`` or ~/.config/fsspec), so a
run directory on S3 can be read before its config is.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import fsspec

T = TypeVar("T")


class Storage:
    def __init__(self, url: str, options: dict[str, Any] | None = None):
        self.url = str(url).rstrip("/") or "/"
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(options or {}))
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.is_local = "file" in protocols

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts) if parts else self.root

    def url_of(self, *parts: str) -> str:
        return posixpath.join(self.url, *parts) if parts else self.url

    def child(self, *parts: str) -> Storage:
        sub = Storage.__new__(Storage)
        sub.url, sub.fs, sub.is_local = self.url_of(*parts), self.fs, self.is_local
        sub.root = self.path(*parts)
        return sub

    def local_path(self, *parts: str) -> str | None:
        """The OS path of a local location; None on a remote filesystem."""
        return self.path(*parts) if self.is_local else None

    # -- reading ----------------------------------------------------------------------------------
    def _fresh(self, path: str) -> str:
        """Drop what an object-store client cached about ``path`` and its parents: other processes (the
        other ranks, a resume on another host) write here too, and a stale listing would say that a
        file written since is missing, or that a file moved away is still there."""
        if not self.is_local:
            self.fs.invalidate_cache(path)
        return path

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self._fresh(self.path(*parts)))

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def size(self, *parts: str) -> int:
        return int(self.fs.size(self._fresh(self.path(*parts))))

    def listdir(self, *parts: str) -> list[str]:
        """Names (not paths) directly under a directory; [] when it does not exist."""
        base = self.path(*parts)
        try:
            entries = self.fs.ls(self._fresh(base), detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries if e.rstrip("/") != base.rstrip("/"))

    def walk_files(self, *parts: str) -> list[str]:
        """Paths of every file under a directory, relative to it."""
        base = self.path(*parts).rstrip("/")
        found = self.fs.find(self._fresh(base))
        return sorted(posixpath.relpath(f, base) for f in found)

    # -- writing ----------------------------------------------------------------------------------
    def makedirs(self, *parts: str) -> None:
        self.fs.makedirs(self.path(*parts), exist_ok=True)

    def write_bytes(self, rel: str, data: bytes, exclusive: bool = False) -> None:
        """Write a whole file. ``exclusive``: fail with FileExistsError if it exists (an atomic create
        on local disks and, through If-None-Match, on S3)."""
        path = self.path(rel)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if exclusive and self.is_local:
            # complete in a temporary file, then link it into place: link fails if the name exists, and
            # nobody ever sees the file half-written (an "xb" open creates it empty first)
            tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)
            finally:
                os.unlink(tmp)
        elif exclusive:
            # object stores: one conditional PUT (If-None-Match) of the whole object
            with self.fs.open(path, "xb") as fh:
                fh.write(data)
        elif self.is_local:
            # write then rename: a reader never sees half a file
            tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def append_bytes(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with self.fs.open(path, "ab") as fh:
            fh.write(data)

    def rm(self, *parts: str, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(*parts), recursive=recursive)

    def move_dir(self, src: str, dst: str) -> None:
        """Move a directory within this storage. Local: one atomic rename. Object stores (where a
        recursive move fails part-way): copy every file, then delete the source, manifest first."""
        if self.is_local:
            os.makedirs(os.path.dirname(self.path(dst)), exist_ok=True)
            os.rename(self.path(src), self.path(dst))
            return
        files = self.walk_files(src)
        for rel in files:
            self.fs.copy(self.path(src, rel), self.path(dst, rel))
        for rel in sorted(files, key=lambda r: r != "manifest.json"):
            self.rm(src, rel)
        self.rm(src, recursive=True)

    def put_dir(self, local_dir: str, *parts: str) -> None:
        """Upload every file of a local directory below ``parts``."""
        for root, _, files in os.walk(local_dir):
            for name in files:
                src = os.path.join(root, name)
                rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
                dst = self.path(*parts, rel)
                self.fs.makedirs(posixpath.dirname(dst), exist_ok=True)
                self.fs.put_file(src, dst)

    def get_dir(self, local_dir: str, *parts: str, files: Iterable[str] | None = None) -> None:
        """Download every file below ``parts`` (or only ``files``, relative to it; those that do not
        exist are left out) into a local directory."""
        wanted = None if files is None else set(files)
        for rel in self.walk_files(*parts):
            if wanted is not None and rel not in wanted:
                continue
            dst = os.path.join(local_dir, *rel.split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            self.fs.get_file(self.path(*parts, rel), dst)

    def local_copy(self, *parts: str, files: Iterable[str] | None = None) -> tuple[str, Callable[[], None]]:
        """A local directory holding the files below ``parts`` (at least ``files``, relative to it),
        and a cleanup function. On a local filesystem that is the directory itself and the cleanup does
        nothing; from object storage, only ``files`` are downloaded when given."""
        if self.is_local:
            return self.path(*parts), lambda: None
        tmp = tempfile.mkdtemp(prefix="rlctl-dl-")
        self.get_dir(tmp, *parts, files=files)
        return tmp, lambda: shutil.rmtree(tmp, ignore_errors=True)


def with_retries(fn: Callable[[], T], attempts: int = 4, base_delay: float = 0.5, on_retry=None) -> T:
    """Call ``fn``; on an exception retry with exponential backoff (0.5 s, 1 s, 2 s ...)."""
    for attempt in range(attempts):
        try:
            return fn()
        except (FileExistsError, KeyboardInterrupt):
            raise
        except Exception as exc:
            if attempt == attempts - 1:
                raise
            if on_retry is not None:
                on_retry(attempt + 1, exc)
            time.sleep(base_delay * 2**attempt)
    raise AssertionError("unreachable")
