"""One writer per run: a lease file in the run directory.

``lease.json`` is created exclusively and holds the owner's host, pid and a heartbeat that a
background thread renews. A second writer is refused while the lease is live. A lease is stale when
its heartbeat is older than the timeout, or when its owner ran on this host and that process is gone
(then it is taken over at once: a crash cannot have left a live writer). A stale lease from another
host is taken over only with ``--force``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from typing import Any

import orjson

from rlctl.errors import LeaseError
from rlctl.storage import Storage

LEASE_FILE = "lease.json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_lease(storage: Storage) -> dict[str, Any] | None:
    """The lease record, with ``_digest`` (a hash of its bytes); a corrupt one reads as long stale."""
    try:
        raw = storage.read_bytes(LEASE_FILE)
    except FileNotFoundError:
        return None
    digest = hashlib.sha256(raw).hexdigest()[:16]
    try:
        return {**orjson.loads(raw), "_digest": digest}
    except orjson.JSONDecodeError:
        return {"owner": "?", "host": "?", "pid": -1, "heartbeat": 0.0, "_digest": digest}


def lease_state(lease: dict[str, Any] | None, timeout: float, now: float | None = None) -> str:
    """'free', 'live', 'dead' (owner on this host is gone) or 'stale' (heartbeat older than timeout)."""
    if lease is None:
        return "free"
    now = time.time() if now is None else now
    if lease.get("host") == socket.gethostname() and not _pid_alive(int(lease.get("pid", -1))):
        return "dead"
    if now - float(lease.get("heartbeat", 0)) > timeout:
        return "stale"
    return "live"


class Lease:
    def __init__(self, storage: Storage, timeout: float = 120.0, heartbeat: float = 15.0):
        self.storage = storage
        self.timeout = timeout
        self.interval = heartbeat
        self.owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.taken_over: dict[str, Any] | None = None  # the stale lease this one replaced
        self.lost = False

    def _record(self) -> bytes:
        return orjson.dumps(
            {
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "heartbeat": time.time(),
            }
        )

    def acquire(self, force: bool = False) -> Lease:
        for _ in range(3):
            try:
                self.storage.write_bytes(LEASE_FILE, self._record(), exclusive=True)
                break
            except FileExistsError:
                held = read_lease(self.storage)
                state = lease_state(held, self.timeout)
                if state == "free":
                    continue  # released between our create and our read: try the create again
                age = time.time() - float((held or {}).get("heartbeat", 0))
                who = f"{(held or {}).get('host')} pid {(held or {}).get('pid')}, heartbeat {age:.0f}s ago"
                if state == "live":
                    raise LeaseError(f"run {self.storage.url} is being written by {who}; one writer per run") from None
                if state == "stale" and not force:
                    raise LeaseError(
                        f"run {self.storage.url} has a stale lease ({who}); if that process is really gone, "
                        "take it over with --force"
                    ) from None
                # Takeover is itself exclusive: the first to create the marker named after this stale
                # lease's bytes replaces it; a second taker fails here instead of deleting the winner's
                # fresh lease. Markers are a few bytes each and are kept.
                try:
                    self.storage.write_bytes(f".lease/takeover-{held['_digest']}", self._record(), exclusive=True)
                except FileExistsError:
                    raise LeaseError(f"another process is taking over the stale lease of {self.storage.url}") from None
                self.taken_over = {k: v for k, v in held.items() if k != "_digest"}
                self.storage.rm(LEASE_FILE)  # then race for the exclusive create again
        else:
            raise LeaseError(f"another process took the lease of {self.storage.url} at the same moment")
        self._thread = threading.Thread(target=self._beat, name="rlctl-lease", daemon=True)
        self._thread.start()
        return self

    @property
    def held(self) -> bool:
        return self._thread is not None and not self.lost

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            held = read_lease(self.storage)
            if held is None or held.get("owner") != self.owner:
                self.lost = True
                return
            try:
                self.storage.write_bytes(LEASE_FILE, self._record())
            except OSError:
                pass  # try again at the next beat; the timeout is many beats long

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        held = read_lease(self.storage)
        if held is not None and held.get("owner") == self.owner:
            self.storage.rm(LEASE_FILE)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
