"""A temp directory of its own for each process that trains a run on a machine.

Python's multiprocessing makes a ``pymp-*`` folder in the temp directory for the sockets it shares
tensors through, and removes it only when the process exits normally: a SIGKILLed run leaves it behind,
one or more per kill, in the machine's ``/tmp``. A run's process therefore works in a folder of its own,

    $TMPDIR/rlctl-<run>/<pid>-<start time>/

(``<run>``: a hash of the run directory's URL; short, as multiprocessing's Unix sockets live under it
and a socket's path has at most 107 bytes: where TMPDIR is too long for that, the process stays in
TMPDIR as it is), set as ``tempfile.tempdir`` and as TMPDIR
for its children (local ranks, the ranks' starter, the snapshot writer) while the run trains here. As a
process of the run enters it, the folders of that run's processes that are gone (no process with that
id and start time) are removed: what a kill left is gone at the next start or resume. A live process's
folder is never touched, whichever run it belongs to. A process that ends normally removes its own
folder as it exits (after multiprocessing's own clean-up); a Ray rank's actor as its rank ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator

PREFIX = "rlctl-"
MACHINE_TMPDIR = "RLCTL_MACHINE_TMPDIR"  # the machine's temp directory, set as a process enters a run's folder

_removal_scheduled: set[str] = set()


# what multiprocessing adds to the temp directory for a socket: /pymp-XXXXXXXX/listener-XXXXXXXX
SOCKET_TAIL = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
SOCKET_PATH_MAX = 107  # a Unix socket's path, in bytes (sun_path less its NUL)


def run_key(url: str) -> str:
    """The run's folder name under the machine's temp directory: ``rlctl-<hash of the URL>``."""
    url = url.removeprefix("file://").rstrip("/")
    url = url if "://" in url else os.path.abspath(url)
    return f"{PREFIX}{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux's /proc), "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def process_name(pid: int) -> str:
    return f"{pid}-{_start_time(pid)}"


def _alive(name: str) -> bool:
    """Whether the process a folder is named after still runs (a name not of that form: kept)."""
    pid, sep, started = name.partition("-")
    if not (sep and pid.isdigit()):
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return not started or _start_time(int(pid)) in ("", started)  # (an id reused by another process: gone)


def remove_gone(root: str) -> list[str]:
    """Remove the folders under ``root`` (a run's) whose processes are gone; their names."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    gone = [n for n in sorted(names) if not _alive(n)]
    for name in gone:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return gone


def _machine_tempdir() -> str:
    """The machine's temp directory, also when this process works in a run's folder already."""
    current = tempfile.gettempdir()
    root = os.path.dirname(current)
    if os.path.basename(root).startswith(PREFIX) and os.path.basename(current) == process_name(os.getpid()):
        return os.path.dirname(root)
    return current


@contextlib.contextmanager
def run_tempdir(url: str, *, remove_at_end: bool = False) -> Iterator[str]:
    """Within the block, this process's temp folder for the run at ``url`` (module docstring): the
    run's gone processes' folders removed first, then ``tempfile.tempdir`` and TMPDIR set to it; both
    restored after. The folder is removed as the process exits normally, or at the block's end with
    ``remove_at_end`` (a process that is killed right after: a Ray rank's actor)."""
    before = tempfile.tempdir, os.environ.get("TMPDIR")
    machine = _machine_tempdir()
    os.environ.setdefault(MACHINE_TMPDIR, machine)  # for caches meant to outlive the run (vLLM's)
    root = os.path.join(machine, run_key(url))
    remove_gone(root)
    own = os.path.join(root, process_name(os.getpid()))
    if len(os.fsencode(own)) + SOCKET_TAIL > SOCKET_PATH_MAX:  # (multiprocessing's sockets would not fit)
        yield tempfile.gettempdir()
        return
    os.makedirs(own, exist_ok=True)
    tempfile.tempdir, os.environ["TMPDIR"] = own, own
    try:
        yield own
    finally:
        tempfile.tempdir = before[0]
        if before[1] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before[1]
        if remove_at_end:
            _remove(own)
        else:
            _remove_at_exit(own)


def _remove(own: str) -> None:
    shutil.rmtree(own, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(own))  # the run's folder, once no other process of it has one there


def _remove_at_exit(own: str) -> None:
    """Remove ``own`` as this process exits normally, after multiprocessing has removed its ``pymp-*``
    folder in it (a finalizer of lower priority than multiprocessing's -100: it runs later)."""
    if own in _removal_scheduled:
        return
    from multiprocessing.util import Finalize

    _removal_scheduled.add(own)
    Finalize(None, _remove, args=(own,), exitpriority=-200)
