"""The snapshot writer (rlctl.checkpoint.writer) forked from the training process, where that is safe,
behind the handle ``subprocess.Popen`` gives (``pid``, ``poll``, ``wait``, ``kill``).

A forked writer starts with torch, DeepSpeed and rlctl imported already, where a new interpreter spends
about 2 s of CPU importing them again, at every start of every rank. A fork is safe only while this
process runs one thread (a lock another thread holds at the fork would stay held in the child forever)
and has initialized no accelerator (a CUDA or NPU context does not survive a fork): ``can_fork`` says
so. The caller says whether the variables the child runs with can still take effect there (a library
that reads them must not have read them here already); otherwise it execs a new interpreter.

The child is what an exec'd writer is: a session of its own, only stdio and the descriptor it is given;
it frees nothing it inherited (its collector leaves those objects alone: their pages stay shared), and
never returns into this process's code: it leaves with ``os._exit``, running no atexit handler and no
finalizer of an inherited object."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def can_fork() -> bool:
    """Whether a child may be forked from this process now (module docstring)."""
    if sys.platform != "linux" or not hasattr(os, "fork"):
        return False
    try:
        if len(os.listdir("/proc/self/task")) != 1:
            return False
    except OSError:
        return False
    torch = sys.modules.get("torch")
    if torch is not None:
        for name in ("cuda", "npu", "xpu", "mps"):
            backend = getattr(torch, name, None)
            initialized = getattr(backend, "is_initialized", None)
            if initialized is not None and initialized():
                return False
    return True


class Forked:
    """A child forked to run ``target()`` in a session of its own, with stdio and ``keep`` its only
    descriptors; it exits 0 when ``target`` returns, 1 when it raises."""

    def __init__(self, target: Callable[[], None], keep: int):
        self.returncode: int | None = None
        flush_std_streams()
        self.pid = os.fork()
        if self.pid == 0:  # the child
            _run_child(target, keep)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"writer {self.pid}", timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _run_child(target: Callable[[], None], keep: int) -> None:
    code = 0
    try:
        gc.freeze()  # the inherited objects stay out of this process's collections: their pages stay shared
        os.setsid()
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        target()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


def flush_std_streams() -> None:
    """Flush stdout and stderr before a fork: what they hold would be written twice, by the child too."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def name_process(name: bytes) -> None:
    """This process's name in /proc/PID/comm (what ps and top show; 15 bytes at most)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def preload(name: str) -> None:
    """What a process that imports once and then forks (the rank starter, the snapshot writer) does ahead
    of its work for ``name``: import a ``module``, or import it and call ``module:function``."""
    module, _, function = name.partition(":")
    imported = importlib.import_module(module)
    if function:
        getattr(imported, function)()
