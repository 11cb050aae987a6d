"""One sandboxed execution of Python code (``execute``): the jail started, its output read up to the
limit, the wall clock kept, and every process it started gone when it returns.

An execution's outcome is a ``Result``: what the code printed (stdout and stderr, each cut at ``output_kb``),
the value of its last expression, a short traceback when it raised, and which limit it hit, if any
(``wall_time``, ``cpu_time``, ``memory``, ``processes``, ``output``). Those are the code's doing (the
model's), never an infrastructure failure: only a jail that did not start is (``SandboxUnavailable``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import selectors
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlctl.sandbox.jail import UNSAFE, Limits, PidsCgroup, SandboxUnavailable, interpreter, jail_argv

RUNNER = (Path(__file__).parent / "runner.py").read_text(encoding="utf-8")
LIMIT_WORDS = {
    "wall_time": "it ran past the wall-time limit of {wall_time_s:g} s",
    "cpu_time": "it used more than the CPU-time limit of {cpu_time_s} s",
    "memory": "it ran out of memory (the limit is {memory_mb} MB)",
    "processes": "it started more processes than the limit of {processes}",
    "output": "it printed more than the output limit of {output_kb} KB",
}


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    value: str | None  # repr of the last expression's value
    error: str | None  # a short traceback, or a sentence
    limit: str | None  # the limit hit (LIMIT_WORDS' keys), or None
    returncode: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None and self.limit is None and self.returncode == 0


def limit_sentence(limit: str, limits: Limits) -> str:
    """The sentence the model reads for a limit hit: 'The code was stopped: it ran past ...'."""
    return "The code was stopped: " + LIMIT_WORDS[limit].format(**limits.__dict__) + "."


def _preexec(limits: Limits, cgroup: PidsCgroup | None):
    memory, cpu = limits.memory_mb << 20, max(1, int(limits.cpu_time_s))

    def setup() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the worker
        if cgroup is not None:
            cgroup.join()
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.tmp_mb << 20, limits.tmp_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return setup


def _read(proc: subprocess.Popen, limits: Limits, started: float) -> tuple[bytes, bytes, str | None]:
    """stdout and stderr until the program ends, or until a limit (wall time, output) kills it."""
    cap, deadline = limits.output_kb << 10, started + limits.wall_time_s
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as sel:
        for stream in out:
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out[proc.stdout]), bytes(out[proc.stderr]), "wall_time"
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                out[key.fileobj] += chunk
                if len(out[key.fileobj]) > cap:
                    return bytes(out[proc.stdout][:cap]), bytes(out[proc.stderr][:cap]), "output"
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return bytes(out[proc.stdout]), bytes(out[proc.stderr]), "wall_time"
    return bytes(out[proc.stdout]), bytes(out[proc.stderr]), None


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap and its session; the PID namespace dies with its PID 1
    proc.wait()


def execute(code: str, limits: Limits, cells: tuple[str, ...] = (), stdin: str = "") -> Result:
    """Run ``code`` (after the earlier ``cells``, silently: a stateful conversation's variables) in the
    sandbox with ``stdin``; a SandboxUnavailable when the jail did not start."""
    python = interpreter()[0]
    cgroup = PidsCgroup.make(limits.processes) if limits.mode != UNSAFE else None
    job = json.dumps({"cells": list(cells), "code": code, "chars": 2000}).encode()
    with (
        tempfile.TemporaryFile() as job_file,
        tempfile.TemporaryFile() as answer,
        tempfile.TemporaryFile() as given,
        tempfile.TemporaryDirectory(prefix="rlctl-unsafe-") as scratch,
    ):
        job_file.write(job)
        job_file.seek(0)
        given.write(stdin.encode())
        given.seek(0)
        program = [python, "-I", "-c", RUNNER, str(job_file.fileno()), str(answer.fileno())]
        argv = program if limits.mode == UNSAFE else [*jail_argv(limits), *program]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=given,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(job_file.fileno(), answer.fileno()),
                preexec_fn=_preexec(limits, cgroup),
                start_new_session=True,
                cwd=scratch,
                env={"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"} if limits.mode == UNSAFE else None,
            )
        except OSError as exc:
            if cgroup is not None:
                cgroup.remove()
            raise SandboxUnavailable(f"the sandbox did not start ({limits.binary}): {exc}") from None
        try:
            stdout, stderr, limit = _read(proc, limits, started)
        finally:
            _kill(proc)
            proc.stdout.close()
            proc.stderr.close()
            if cgroup is not None:
                forks_refused = cgroup.hit()
                cgroup.remove()
        seconds = time.monotonic() - started
        answer.seek(0)
        told = _answer(answer.read())
    return _result(stdout, stderr, told, limit, proc.returncode, seconds, cgroup is not None and forks_refused, limits)


def _answer(data: bytes) -> dict | None:
    try:
        told = json.loads(data)
    except ValueError:
        return None
    return told if isinstance(told, dict) else None


def _result(stdout, stderr, told, limit, code, seconds, forks_refused, limits) -> Result:
    """The run's Result; a program killed by a signal is read as the limit that sends it."""
    if limit is None and told is not None and told.get("limit") == "memory":
        limit = "memory"
    if limit is None and code in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGKILL):
        limit = "cpu_time"
    if limit is None and told is None and code != 0 and b"MemoryError" in stderr:
        limit = "memory"
    if forks_refused and limit in (None, "wall_time", "cpu_time"):
        limit = "processes"  # a refused fork is what stopped it (a bomb then spins until a clock ends it)
    error = told.get("error") if told else None
    if told is None and limit is None and code != 0:
        tail = stderr.decode(errors="replace").strip()[-500:]
        if code == 1 and tail.startswith("bwrap:"):
            raise SandboxUnavailable(f"the jail ({limits.binary}) did not start: {tail}")
        error = tail or f"the program ended with exit code {code}"
    return Result(
        stdout.decode(errors="replace"),
        stderr.decode(errors="replace"),
        told.get("value") if told else None,
        error,
        limit,
        code,
        seconds,
    )
