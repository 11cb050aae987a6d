"""Failed snapshots: the cause said in words, and the count of failures in a row.

A snapshot that fails is reported at once (``snapshot_failed``); ``max_failures`` of them in a row stop
the run with a StorageError (exit 12) naming the step, the storage, the cause and the last committed
snapshot, or a StorageRefused (exit 13) when the last of them was refused by the store (a missing
bucket, access denied, bad credentials, a read-only disk: no requeue mends it). A successful commit
resets the count.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from rlctl.errors import RlctlError, StorageError, StorageRefused
from rlctl.storage.failures import causes, is_refusal

_TORCH_WRITE_FAILED = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")
_NEARLY_FULL = 64 << 20  # free bytes below which (or below 1% of the disk) a failed write means a full disk


def _os_cause(exc: OSError) -> str:
    words = os.strerror(exc.errno).lower() if exc.errno else str(exc.strerror or exc)
    return f"{words} ({exc.filename})" if exc.filename else words


def _disk_full(path: str | None) -> bool:
    if not path:
        return False
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or "/")
    except OSError:
        return False
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return free < min(_NEARLY_FULL, max(total // 100, 64 << 10))


def describe(exc: BaseException, local_dir: str | None = None) -> str:
    """The cause of a failed snapshot in words: a storage error's sentence, an OSError's reason (e.g.
    "no space left on device (PATH)"), and torch's bare write failures ("unexpected pos") for what they
    are when the disk they wrote to ``local_dir`` is full."""
    for e in causes(exc):
        if isinstance(e, RlctlError):
            return e.message
        if isinstance(e, OSError) and (e.errno or e.strerror):
            return _os_cause(e)
    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    if isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TORCH_WRITE_FAILED) and _disk_full(local_dir):
        said = text.rpartition("] . ")[2] or text  # (after torch's "[enforce fail at inline_container.cc:N] . ")
        return f"{os.strerror(errno.ENOSPC).lower()} ({local_dir} is full; torch said: {said})"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def refused(exc: BaseException) -> bool:
    """Whether a snapshot failed because the store refused it for good (not an outage)."""
    return any(isinstance(e, StorageRefused) for e in causes(exc)) or is_refusal(exc)


@dataclass
class Failure:
    step: int
    cause: str
    refused: bool = False


class FailureCount:
    """Consecutive failed snapshots of one manager, and whether the run must stop because of them."""

    def __init__(self, max_failures: int, url: str):
        if max_failures < 1:
            raise ValueError("max_failures must be at least 1")
        self.max_failures, self.url = max_failures, url
        self.consecutive = 0
        self.last: Failure | None = None  # the last failed snapshot (None once one commits)

    def failed(self, step: int, cause: str, refused: bool = False) -> dict:
        """Count a failure (``refused``: by the store, for good); the ``snapshot_failed`` event that reports it."""
        self.consecutive += 1
        self.last = Failure(step, cause, refused)
        return {
            "event": "snapshot_failed",
            "step": step,
            "error": f"the snapshot of step {step} was not committed to {self.url}: {cause}",
            "consecutive": self.consecutive,
            "max_failures": self.max_failures,
        }

    def committed(self) -> None:
        self.consecutive, self.last = 0, None

    def stop_error(self, last_committed: int | None) -> StorageError | None:
        """The error that ends the run once ``max_failures`` snapshots in a row have failed, else None."""
        if self.last is None or self.consecutive < self.max_failures:
            return None
        error = StorageRefused if self.last.refused else StorageError
        return error(
            f"{self.consecutive} snapshots in a row failed (checkpoint.max_failures: {self.max_failures}); the "
            f"last, of step {self.last.step}, could not be committed to {self.url}: {self.last.cause}; "
            f"{last_committed_words(last_committed)}"
        )


def last_committed_words(step: int | None) -> str:
    if step is None:
        return "no snapshot of this run is committed yet, so a resume starts over"
    return f"the last committed snapshot is step {step}, and a resume continues from it"
