"""Local ranks forked from a starter process that imported what a rank imports, where that is safe.

A local rank exec'd anew spends about 5 s of CPU importing torch, transformers and rlctl's engine before
it can train, every rank at every start and resume. The starter is forked from the driver as a run
begins, while the driver runs one thread: it imports those modules once, beside the driver's own
preflight, and then forks each rank the driver asks for. A rank so forked is the process an exec'd
rank is: the same environment (a request whose environment differs from the starter's, whose modules
read theirs at import, is refused, and the driver execs that rank instead), its stop signals held
until it can take them, Ctrl-C left to the driver, death with its parent, fresh random seeds; it runs
the rank's ``main`` (which leaves with ``os._exit``, as an exec'd rank does).

The starter forks only while it runs one thread and has initialized no accelerator
(``rlctl.checkpoint.forked.can_fork``; a BLAS pool started by numpy's import, where OMP_NUM_THREADS
does not hold it to one thread, rules it out): otherwise every rank is exec'd, as without a starter.
It dies with the driver, and its ranks with it; it reaps them and tells the driver their exit codes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping

import orjson

from rlctl.checkpoint.forked import can_fork, die_with_parent, flush_std_streams, name_process, preload
from rlctl.ranks.stops import STOP_SIGNALS, STOPS, block_stop_signals

# what a rank imports before its first step, imported once by the starter (DeepSpeed is not: it picks
# its accelerator as it is first used, by DS_ACCELERATOR, which each rank sets for its device), and
# ("module:function") what it builds at its first model load and sample, built once (rlctl.engine.warm)
PRELOAD = ("torch", "transformers", "rlctl.engine.trainer", "rlctl.engine.warm:warm_caches")

START_TIMEOUT_S = 300.0  # the longest a rank waits for the starter's imports before it is exec'd instead

_current: RankStarter | None = None


class RankStarter:
    """The driver's handle on its starter process (module docstring)."""

    def __init__(self, pid: int, sock: socket.socket, env: Mapping[str, str]):
        self.pid, self._sock, self.env = pid, sock, dict(env)
        self._buffer = b""
        self._codes: dict[int, int] = {}
        self._started: list[int | None] = []  # the starter's answers to ``spawn``, in order
        self._alive = True
        # the socket is read by one caller at a time: a stop signal's handler (the StopForwarder polls the
        # ranks) that lands while ``spawn`` or a poll reads it answers from what was read already
        self._busy = False

    @classmethod
    def fork(cls, main: Callable[[], None]) -> RankStarter | None:
        """A starter forked from this process now, whose ranks run ``main`` (with ``sys.argv`` [_, SPEC,
        RANK], as ``python -m rlctl.ranks.local SPEC RANK``), or None where a fork is not safe."""
        if not can_fork():
            return None
        ours, theirs = socket.socketpair()
        env, parent = dict(os.environ), os.getpid()
        flush_std_streams()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _serve(theirs, main, parent)  # never returns
        theirs.close()
        return cls(pid, ours, env)

    def spawn(self, spec_path: str, rank: int, env: Mapping[str, str], cleared: frozenset[str]) -> ForkedRank | None:
        """Rank ``rank`` forked to run with ``env`` (this process's environment less ``cleared``), or None
        where the starter cannot fork it: then exec it. A starter that fails to answer (stuck in its
        imports, gone) is ended, with any rank it forked, and forks no more."""
        ours = {k: v for k, v in self.env.items() if k not in cleared}
        if not self._alive or dict(env) != ours:
            return None
        self._busy = True
        try:
            self._sock.sendall(orjson.dumps({"spec": spec_path, "rank": rank, "cleared": sorted(cleared)}) + b"\n")
            while not self._started:
                if not self._read(START_TIMEOUT_S):
                    self.close()
                    return None
            pid = self._started.pop(0)
        except OSError:
            self.close()
            return None
        finally:
            self._busy = False
        return None if pid is None else ForkedRank(self, pid)

    def exit_code(self, pid: int) -> int | None:
        """The exit code of rank ``pid`` once it has ended (as ``Popen.returncode``), else None."""
        if pid not in self._codes and self._alive and not self._busy:
            self._busy = True
            try:
                while pid not in self._codes and self._read(0):
                    pass
            except OSError:
                self._alive = False
            finally:
                self._busy = False
        if pid in self._codes:
            return self._codes[pid]
        return None if self._alive else -signal.SIGKILL  # the starter died: its ranks with it

    def close(self) -> None:
        """End the starter, and with it any rank it forked that still runs."""
        self._alive = False
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)

    def _read(self, timeout: float) -> bool:
        """Read what the starter sent within ``timeout`` seconds: whether anything came. It is gone (not
        alive) when its end of the socket closed; an answer is kept, and so is an exit code."""
        if not select.select([self._sock], [], [], timeout)[0]:
            return False
        chunk = self._sock.recv(65536)
        if not chunk:
            self._alive = False
            return False
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = orjson.loads(line)
            if "exited" in message:
                self._codes[message["exited"]] = message["code"]
            else:
                self._started.append(message["pid"])
        return True


class ForkedRank:
    """A rank forked by the starter, behind the part of ``subprocess.Popen`` a LocalRank uses."""

    def __init__(self, starter: RankStarter, pid: int):
        self.starter, self.pid = starter, pid

    def poll(self) -> int | None:
        return self.starter.exit_code(self.pid)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@contextlib.contextmanager
def rank_starter(wanted: bool, main: Callable[[], None]) -> Iterator[None]:
    """Within the block, the local ranks' starter (``current()``), whose ranks run ``main``, when
    ``wanted`` and a fork is safe now."""
    global _current
    starter = RankStarter.fork(main) if wanted else None
    _current = starter
    try:
        yield
    finally:
        _current = None
        if starter is not None:
            starter.close()


def current() -> RankStarter | None:
    return _current


# -- the starter's side ------------------------------------------------------------------------------
def _serve(sock: socket.socket, main: Callable[[], None], parent: int) -> None:
    """The starter: import, then fork the ranks asked for and report how each ended, until the driver
    is gone. One that cannot fork once its imports are done (they started a thread) says so by leaving."""
    code = 0
    try:
        die_with_parent()
        if os.getppid() != parent:  # (the driver died before the line above)
            return
        gc.freeze()  # what the driver left here stays out of the collections (as a forked writer's)
        os.closerange(3, sock.fileno())  # the driver's files and pipes are the driver's (as exec'd ranks have)
        os.closerange(sock.fileno() + 1, os.sysconf("SC_OPEN_MAX"))
        STOPS.__init__()  # a fresh process's: nothing requested, nothing raised at once
        name_process(b"rlctl-ranks")
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        block_stop_signals()  # held, as in an exec'd rank's process, until a rank can take them; Ctrl-C is the driver's
        for name in PRELOAD:
            preload(name)
            if not can_fork():  # (numpy's BLAS pool, without OMP_NUM_THREADS=1): the ranks are exec'd
                return
        _serve_requests(sock, main)
    except BaseException as exc:  # one sentence: the run goes on, its ranks started as new processes
        print(
            f"warning: the local ranks' starter stopped ({type(exc).__name__}: {exc}); ranks start anew",
            file=sys.stderr,
        )
        code = 1
    finally:
        os._exit(code)


def _serve_requests(sock: socket.socket, main: Callable[[], None]) -> None:
    buffer, ranks = b"", set()
    while True:
        readable = select.select([sock], [], [], 0.05)[0]
        _reap(sock, ranks)
        if not readable:
            continue
        chunk = sock.recv(65536)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = orjson.loads(line)
            pid = _fork_rank(request, sock, main) if can_fork() else None
            if pid is not None:
                ranks.add(pid)
            sock.sendall(orjson.dumps({"pid": pid}) + b"\n")


def _reap(sock: socket.socket, ranks: set[int]) -> None:
    for pid in list(ranks):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            ranks.discard(pid)
            sock.sendall(orjson.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}) + b"\n")


def _fork_rank(request: dict, sock: socket.socket, main: Callable[[], None]) -> int:
    flush_std_streams()
    starter = os.getpid()
    pid = os.fork()
    if pid == 0:
        _run_rank(request, sock, main, starter)
    return pid


def _run_rank(request: dict, sock: socket.socket, main: Callable[[], None], starter: int) -> None:
    """A forked rank: what ``python -m rlctl.ranks.local SPEC RANK`` would be; it leaves with ``os._exit``
    (``main`` does so itself; should it return or raise, here, with its code)."""
    code = 0
    try:
        die_with_parent()
        if os.getppid() != starter:  # (the starter died before the line above)
            os._exit(1)
        sock.close()
        for name in request["cleared"]:
            os.environ.pop(name, None)
        _fresh_seeds()
        sys.argv = [sys.argv[0], request["spec"], str(request["rank"])]
        name_process(f"rlctl-rank-{request['rank']}".encode())
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        _exit(code)


def _fresh_seeds() -> None:
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def _exit(code: int) -> None:
    """Leave as ``main`` does (``os._exit``, its streams flushed): no teardown of what was inherited."""
    try:
        flush_std_streams()
    finally:
        os._exit(code)
