"""The snapshot writer process: serialization, hashing, writing and upload outside the training
process, so none of it holds the training process's GIL.

One writer process per training process, started early and kept (``writer()``): as the run starts, so
that its own imports (torch's reductions, and what its starter names: ``start(preload)``) overlap the
training process's imports and the loading of the models rather than wait for the first snapshot, or
else at the first snapshot. The
training thread hands it a ``WriteJob`` pickled with torch's multiprocessing reductions: the tensors of
the deferred state dicts are moved into shared memory the first time (their storage stays there, in
place, for the rest of the run) and from then on only their handles are sent, a few KB; device tensors
are copied into host buffers in shared memory that are kept from one snapshot to the next (``HostBuffers``:
pinned on CUDA, filled on a side stream). The writer maps them, and:

- ``stage_copy`` (asynchronous snapshots): copies them at once into staging buffers of its own (kept
  from one snapshot to the next, so no page is faulted in twice) and says "staged": the training
  process's next optimizer step, which waits for that, may go on while the writer serializes, hashes,
  writes and uploads from its copy;
- otherwise (a synchronous snapshot: training waits anyway) it serializes straight from the shared
  state, and says "staged" when the files are written.

Then it finishes the job (``job.finish``) and sends back what rank 0 commits. A failure comes back as
the exception it raised. The writer runs niced (training keeps its core) and dies with its parent
(PR_SET_PDEATHSIG): it never outlives the run it writes for, and it never writes a manifest, so killing
either process at any moment leaves no committed partial snapshot. When the writer dies mid-job, the
job fails with ``WriterDied`` and the next job starts a new writer.

On the training side a job costs its pickling (rlctl.checkpoint.handover: the state dicts' structure,
and the copies of device tensors into host buffers) and a blocked read in the manager's commit thread;
everything else runs in the writer.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlctl.checkpoint.forked import Forked, can_fork, die_with_parent, name_process, preload
from rlctl.checkpoint.handover import Payload
from rlctl.checkpoint.job import Written, finish

REDUCTIONS = "torch.multiprocessing.reductions"  # what every job's tensors are rebuilt with


class WriterDied(RuntimeError):
    """The writer process ended in the middle of a job."""


class WriterProcess:
    """The parent's handle on one writer process: ``run`` one pickled job at a time."""

    def __init__(self):
        self.started = 0  # writer processes this handle started (one per run, or one for many)
        self._proc: subprocess.Popen | Forked | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._lock = threading.Lock()
        self._started_in: int | None = None  # the environment the running writer was started in
        self._at_exit = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(
        self, preload: Sequence[str] | None = (), env: Mapping[str, str] | None = None, fork: bool = False
    ) -> None:
        """Start the writer unless it runs (call on a thread that lives as long as the run: the writer
        dies with the thread that started it). Before its first job it imports torch's reductions and
        ``preload``: modules (``package.module``) or functions to call (``package.module:function``),
        what the jobs' state dicts name that the training process imports its own way; ``env``: variables
        it runs with besides this process's. ``fork``: the caller allows forking it from this process
        (``rlctl.checkpoint.forked``: what ``env`` sets must not have been read here already), which
        happens where that is safe. A writer that runs was started for an earlier run of this process:
        it is kept when it was started in this same environment (variables but ``RUN_SCOPED``'s, and
        ``env``), which it holds from then on, and otherwise replaced; ``preload`` None: any writer that
        runs is kept. Neither the import path nor ``preload`` is its environment: each job brings the
        path, and a kept writer started with another preload imports what a job names as it unpickles
        it (a preload only moves imports ahead of the first job)."""
        with self._lock:
            if preload is None and self.alive():
                return
            preload = preload or ()
            started_in = _environment(env)
            if self.alive() and started_in == self._started_in:
                return
            if self.alive():
                self._stop()
            self._close_conn()
            self._started_in = started_in
            if not self._at_exit:  # stopped at this process's exit, at once: not left to die with it
                self._at_exit = True
                atexit.register(self.stop)
            ours, theirs = socket.socketpair()
            parent, preload = os.getpid(), [REDUCTIONS, *preload]
            variables = {**(env or {}), "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
            if fork and can_fork():  # (rlctl.checkpoint.forked: no imports to repeat)
                fd = theirs.fileno()
                self._proc = Forked(lambda: main(fd, parent, preload, variables), keep=fd)
            else:
                # the writer unpickles what this process pickles: it imports from where this process does
                path = os.pathsep.join(p or os.getcwd() for p in sys.path)
                env = {**os.environ, **variables, "PYTHONPATH": path}
                cmd = [sys.executable, "-m", "rlctl.checkpoint.writer", str(theirs.fileno()), str(parent), *preload]
                # its own session: a stop signal for the trainer's process group (Slurm, Ctrl-C) never
                # reaches it, not even while it starts (it dies with its parent, PR_SET_PDEATHSIG)
                self._proc = subprocess.Popen(
                    cmd, pass_fds=(theirs.fileno(),), env=env, close_fds=True, start_new_session=True
                )
            theirs.close()
            self._conn = multiprocessing.connection.Connection(ours.detach())
            self._conn.send_bytes(bytes(multiprocessing.current_process().authkey))
            self.started += 1

    def run(self, payload: Payload, stage_copy: bool, staged: Callable[[], None], hold: float = 0.0) -> Written | None:
        """Send one pickled job and wait for its outcome (on the manager's commit thread: waiting
        releases the GIL). ``staged`` is called when the writer no longer reads the live state, also
        when it fails; the payload's host copies are given back then. ``hold``: the write_delay drill,
        seconds the writer waits before it reads the state. Raises what the job raised, or WriterDied."""

        def done_reading() -> None:
            payload.copies.release()
            staged()

        with self._lock:
            try:
                conn = self._conn
                if conn is None or not self.alive():
                    raise WriterDied("the snapshot writer process is not running")
                self._send(conn, (stage_copy, hold, tuple(sys.path), payload.data))
                while True:
                    kind, value = self._receive(conn)
                    if kind == "staged":
                        done_reading()
                    elif kind == "done":
                        return value
                    else:
                        raise value
            finally:
                done_reading()

    def _send(self, conn, message) -> None:
        try:
            conn.send(message)
        except OSError as exc:  # it died since alive() said it ran
            raise self._died() from exc

    def _receive(self, conn) -> tuple[str, Any]:
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died() from exc

    def _died(self) -> WriterDied:
        code = self._proc.wait() if self._proc is not None else None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited ({code})"
        return WriterDied(f"the snapshot writer process (pid {self.pid}) {how} in the middle of the snapshot")

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def stop(self) -> None:
        """Stop the writer at once, whatever it is importing (call when no job is in flight)."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        self._close_conn()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def rest(self) -> None:
        """A run of this process ended (no job in flight): the writer frees the staging buffers it kept for
        that run's snapshots and waits for the next run's first job, which then needs no new interpreter
        (it dies with this process, or is replaced by ``start`` in another environment)."""
        from rlctl.checkpoint.handover import HOST_BUFFERS

        HOST_BUFFERS.clear()
        with self._lock:
            if self._conn is not None and self.alive():
                with contextlib.suppress(OSError):
                    self._conn.send(None)

    def close(self) -> None:
        """Stop the writer (it finishes nothing: call when no job runs)."""
        with self._lock:
            self._close_conn()  # EOF: the writer leaves its loop
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None


# variables a process sets for itself as it trains a run, which a writer started before they were set
# may lack: its rank and process group, its temp folder (ranks/tmpdir.py), its threads and accelerator
# (the writer sets its own: ``start``'s variables); the writer reads none of the others
RUN_SCOPED = frozenset(
    {
        "TMPDIR",
        "RLCTL_MACHINE_TMPDIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "OMP_NUM_THREADS",
        "DS_ACCELERATOR",
        "TOKENIZERS_PARALLELISM",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
    }
)


def _environment(env: Mapping[str, str] | None) -> int:
    """What a writer started now would run in: this process's variables but ``RUN_SCOPED``'s, and ``env``
    (a hash, to tell one from another)."""
    variables = frozenset((k, v) for k, v in os.environ.items() if k not in RUN_SCOPED)
    return hash((variables, frozenset((env or {}).items())))


_writer: WriterProcess | None = None
_writer_lock = threading.Lock()


def writer() -> WriterProcess:
    """This process's writer (one per rank, shared by every snapshot manager of the process)."""
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = WriterProcess()
        return _writer


# -- the writer process ------------------------------------------------------------------------------


class _StagingBuffers:
    """Buffers of the writer's own that shared storages are copied into, kept for the next snapshot."""

    def __init__(self):
        self._free: dict[int, list[Any]] = {}
        self._used: list[Any] = []

    def take(self, nbytes: int):
        import torch

        pool = self._free.get(nbytes)
        buf = pool.pop() if pool else torch.UntypedStorage(nbytes)
        self._used.append(buf)
        return buf

    def release(self) -> None:
        for buf in self._used:
            self._free.setdefault(buf.nbytes(), []).append(buf)
        self._used = []


class _Unpickler(pickle.Unpickler):
    """Unpickles a job in the writer. Each shared storage is mapped with its page tables filled at once
    (one call, not a page fault per 4 KiB), and, given ``buffers``, copied into a staging buffer as it
    is mapped (once per storage: views of one storage stay views of one copy)."""

    def __init__(self, data: bytes, buffers: _StagingBuffers | None):
        super().__init__(io.BytesIO(data))
        self._buffers, self._copies = buffers, {}
        self._mapped: list[Any] = []  # alive while unpickling: torch maps a storage sent twice once

    def load(self):
        try:
            return super().load()
        finally:
            self._mapped = []

    def find_class(self, module: str, name: str):
        found = super().find_class(module, name)
        if module == "torch.multiprocessing.reductions" and name.startswith("rebuild_storage"):
            return self._mapping(found)
        return found

    def _mapping(self, rebuild):
        def rebuild_mapped(*args):
            shared = rebuild(*args)
            if not shared.nbytes():  # (empty: nothing to map or copy, and every empty storage its own)
                return shared
            key = (shared.data_ptr(), shared.nbytes())
            if key not in self._copies:
                _populate(shared.data_ptr(), shared.nbytes())
                self._mapped.append(shared)
                copy = self._buffers.take(shared.nbytes()).copy_(shared) if self._buffers is not None else shared
                self._copies[key] = copy
            return self._copies[key]

        return rebuild_mapped


_MADV_POPULATE_READ = 22  # Linux 5.14+; elsewhere madvise fails and pages fault in as they are read
_libc = None


def _populate(address: int, length: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    _libc.madvise(start, length + address - start, _MADV_POPULATE_READ)


def _serve(conn) -> None:
    buffers = _StagingBuffers()
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:  # (the run ended: ``rest``)
            buffers = _StagingBuffers()
            continue
        stage_copy, hold, path, payload = message
        sys.path.extend(p for p in path if p not in sys.path)  # (what the training process imports from)
        try:
            time.sleep(hold)  # (the write_delay drill: before the live state is read)
            job = _Unpickler(payload, buffers if stage_copy else None).load()
            job.hold = 0.0
            if stage_copy:
                conn.send(("staged", None))
                result = finish(job, staged=lambda: None)
            else:
                result = finish(job, staged=lambda: conn.send(("staged", None)))
            conn.send(("done", result))
        except Exception as exc:
            conn.send(("error", _sendable(exc)))
        finally:
            job = None
            buffers.release()


def _sendable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def main(fd: int, parent: int, preload: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
    """The writer process: ``fd`` its end of the socket pair, ``parent`` the training process's pid;
    ``env``: its variables, for a writer forked from the training process (an exec'd one starts with them)."""
    die_with_parent()
    if os.getppid() != parent:  # the parent died before we could ask to die with it
        return
    name_process(b"rlctl-writer")  # (what ps, top and the tests see, forked or exec'd)
    if env is not None:
        os.environ.update(env)  # (for what it imports from here; torch, imported, is told its threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    # stop signals are the trainer's to honour (it finishes its step and its last snapshot, which needs
    # this writer); group signals never come here (its own session), and these ignore one sent to every
    # rlctl process by name; the writer ends at EOF or with its parent
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    os.nice(10)
    conn = multiprocessing.connection.Connection(fd)
    multiprocessing.current_process().authkey = conn.recv_bytes()  # torch's shared fds come through it
    _import_all(preload)
    _serve(conn)


def _import_all(names: Sequence[str]) -> None:
    """Import ``names`` (``module``, or ``module:function`` to call) now, while the training process
    does its own imports and loads its models (a job waits in the pipe meanwhile); one that fails is
    left for the first job to import, and to say why."""
    for name in names:
        with contextlib.suppress(Exception):
            preload(name)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
