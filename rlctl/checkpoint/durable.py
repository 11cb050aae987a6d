"""One pass over a snapshot file: write it, hash it, and get it onto the disk, all overlapped.

``DurableFile`` is a binary file object for ``torch.save`` (or anything that calls ``write``):

- a large chunk is hashed by a second thread while this one writes it (sha256 and write both release
  the GIL), so the pair costs the slower of the two, not their sum; the caller's buffer is read in
  place, never copied, and ``write`` returns only when both are done with it;
- every 64 MiB it asks the kernel to start writing back what is dirty (``sync_file_range``), so the
  disk works while serialization goes on instead of all at the final fsync;
- ``close()`` fsyncs and returns the size and sha256, so the commit never reads the file again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import queue
import threading

_SYNC_FILE_RANGE_WRITE = 2
_KICK_EVERY = 64 << 20


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


class DurableFile:
    PARALLEL_MIN = 1 << 20  # smaller chunks are hashed inline: a thread hand-off would cost more

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size = 0
        self._kicked = 0
        self._hash = hashlib.sha256()
        self._todo: queue.Queue = queue.Queue(maxsize=1)
        self._done: queue.Queue = queue.Queue(maxsize=1)
        self._hasher = threading.Thread(target=self._hash_loop, name="rlctl-sha256", daemon=True)
        self._hasher.start()
        self.closed = False

    def _hash_loop(self) -> None:
        while (chunk := self._todo.get()) is not None:
            self._hash.update(chunk)
            self._done.put(True)

    # -- the file-object surface torch.save uses ----------------------------------------------------
    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        parallel = n >= self.PARALLEL_MIN
        if parallel:
            self._todo.put(view)
        else:
            self._hash.update(view)
        try:
            rest = view
            while rest:
                rest = rest[os.write(self._fd, rest) :]
        finally:
            if parallel:
                self._done.get()  # the hash has finished reading the caller's buffer
        self._size += n
        if _sync_file_range is not None and self._size - self._kicked >= _KICK_EVERY:
            _sync_file_range(self._fd, self._kicked, self._size - self._kicked, _SYNC_FILE_RANGE_WRITE)
            self._kicked = self._size
        return n

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self._size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> tuple[int, str]:
        """fsync, finish the hash; (size, sha256 hex). The file is closed even when the fsync fails."""
        if not self.closed:
            self.closed = True
            self._todo.put(None)
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._hasher.join()
        return self._size, self._hash.hexdigest()

    def __enter__(self) -> DurableFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def no_space(path: str) -> OSError:
    """The error a write to ``path`` on a full disk raises."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def save_object(obj, fh) -> None:
    """``torch.save`` of a deferred object into ``fh``, without the zip format's CRC32: the manifest's
    sha256 covers every byte already."""
    import torch
    from torch.utils.serialization import config as serialization_config

    previous = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = False
    try:
        torch.save(obj, fh)
    finally:
        serialization_config.save.compute_crc32 = previous
