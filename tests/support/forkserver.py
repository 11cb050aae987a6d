"""The tests' fork server: `rlctl` processes that start without paying for their imports.

A process that trains spends about 5 s of CPU importing torch, transformers and DeepSpeed before its
first step; the end-to-end tests start a few hundred such processes. This server imports them once
(per pytest-xdist worker), then forks a child for each run the tests ask for. The child is a real
process of its own, like one from ``subprocess.Popen``: it takes the test's argv, environment, working
directory and pipes, runs the CLI's entry point (``rlctl.cli:main``) as the installed console script
does, and exits as the interpreter would (threads joined, atexit handlers, flushes), its exit status reported back.
Tests signal and kill it by its pid, and its ranks and snapshot writer are started by it as by any
`rlctl`.

What a fork cannot give differs from a fresh interpreter only in what was decided at import: the
environment a module read then. So a request is forked only when its environment differs from the
server's in variables read at run time; one that differs in a variable read at import (``IMPORT_TIME``:
PYTHONPATH, DS_ACCELERATOR=cuda, HF_HOME, ...) makes ``helpers`` start the console script instead. ``tests/e2e/test_forkserver.py`` checks that a forked run equals one of the
console script, byte for byte. RLCTL_TEST_FORKSERVER=0 turns the server off.

Run as ``python tests/support/forkserver.py SOCKET``: it prints ``ready`` once its imports are done.
"""

import contextlib
import json
import locale
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

# variables the server's modules read when they are imported (torch, DeepSpeed, transformers, the
# Hugging Face hub's cache paths, the OpenMP and BLAS runtimes, the interpreter): a child whose value
# differs is started from the console script. The others (PYTEST_CURRENT_TEST, RLCTL_*, what an
# in-process test's imports set, such as VLLM_* or RAY_*) are read at run time, from the child's own
# environment. FSSPEC_* is read at import too, and read again in the child (``_become``).
IMPORT_TIME = (
    "PYTHON",
    "LD_",
    "TORCH_",
    "PYTORCH",
    "TORCHDYNAMO",
    "TRITON",
    "CUDA",
    "DS_",
    "DEEPSPEED",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS",
    "XDG_",
    "HOME",
    "RLCTL_TEST_RUN",  # (not read at import, but read by tests from /proc/PID/environ: the exec'd environment)
)
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "rlctl")
_HEADER = struct.Struct("!I")


# -- the server ------------------------------------------------------------------------------------------


# what a run imports as it goes (the commands, the rollout, the model's classes, transformers' quantizers
# as it loads a model, the progress display): imported once here, not in every child's run
FIRST_RUN_IMPORTS = (
    "rlctl.commands.start",
    "rlctl.commands.resume",
    "rlctl.commands.progress",
    "rlctl.preflight",
    "rlctl.algos.kl",
    "rlctl.engine.rollout.hf",
    "rlctl.engine.reward.builtin",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.quantizers.auto",
    "rich.progress",
    "rich.live",
    "deepspeed.ops.op_builder.all_ops",  # (setuptools with it: DeepSpeed's op builders, as an engine is made)
    "deepspeed.module_inject.auto_ep_layer",
    "deepspeed.ops.triton_ops",
    "setuptools",
)


def _preload() -> None:
    """What `rlctl start` imports, the way it imports it (DeepSpeed through rlctl's own importer)."""
    import rlctl.cli  # noqa: F401
    import rlctl.engine.model  # noqa: F401
    import rlctl.engine.trainer  # noqa: F401
    import rlctl.run  # noqa: F401
    from rlctl.engine.runtime import import_deepspeed

    import_deepspeed()
    import importlib

    for name in FIRST_RUN_IMPORTS:  # (each child would import them again in its first, and only, run)
        importlib.import_module(name)
    from rlctl.engine.warm import warm_caches

    warm_caches()  # (and build what a run's first model load and sample build)
    import gc

    gc.freeze()


def serve(path: str) -> dict:
    """Accept requests on the Unix socket ``path`` until the parent goes; in each forked child, return
    the request (the child then becomes the run: ``_become``). Never returns in the server."""
    parent = os.getppid()
    _preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([server], [], [], 0.05)
        if readable:
            conn, _ = server.accept()
            request, fds = _receive(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                for other in children.values():
                    other.close()
                conn.close()
                return {**request, "fds": fds}
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        _reap(children)
    for pid in children:
        with _quiet():
            os.kill(pid, signal.SIGKILL)
    os.unlink(path)
    _flush()
    os._exit(0)  # (no teardown: triton's bindings complain of leaks at the end of a gc.freeze'd process)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    (size,) = _HEADER.unpack_from(data)
    while len(data) < _HEADER.size + size:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the request was cut short")
        data += more
    return json.loads(data[_HEADER.size :]), fds


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        with _quiet():
            conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
        conn.close()


def _quiet():
    return contextlib.suppress(OSError)


def _become(request: dict) -> None:
    """This forked child becomes the requested `rlctl` process: its pipes on 0, 1 and 2, its working
    directory, its environment (and the fsspec config read from it), its argv, fresh random seeds."""
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import fsspec.config

    fsspec.config.conf.clear()
    fsspec.config.set_conf_files(fsspec.config.conf_dir, fsspec.config.conf)
    fsspec.config.set_conf_env(fsspec.config.conf)
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [CONSOLE_SCRIPT, *request["args"]]
    main = sys.modules["__main__"]
    main.__file__ = CONSOLE_SCRIPT  # a spawned multiprocessing child re-imports the console script, as it would
    main.__spec__ = None


# -- the client (the tests' side) ------------------------------------------------------------------------


class ForkServer:
    """One server per test process, started on first use and stopped with that process."""

    _instance: "ForkServer | None" = None

    def __init__(self, env: dict[str, str], cwd: Path):
        self.path = f"/tmp/rlctl-forkserver-{os.getpid()}-{time.monotonic_ns()}.sock"
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path],
            cwd=cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the tests' fork server did not start (exit {self.proc.wait()})")

    @classmethod
    def get(cls, env: dict[str, str], cwd: Path) -> "ForkServer":
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = cls(env, cwd)
        return cls._instance

    def forkable(self, env: dict[str, str]) -> bool:
        """Whether a child with ``env`` is the process the console script would be (see the module)."""
        changed = {k for k in self.env.keys() | env.keys() if self.env.get(k) != env.get(k)}
        return not any(k.startswith(IMPORT_TIME) for k in changed)

    def spawn(self, args: list[str], env: dict[str, str], cwd: Path) -> "Forked":
        return Forked(self.path, args, env, cwd)


def enabled() -> bool:
    return os.environ.get("RLCTL_TEST_FORKSERVER", "1") != "0"


class Forked:
    """A forked `rlctl` process, with the part of ``subprocess.Popen`` the tests use (text pipes)."""

    def __init__(self, path: str, args: list[str], env: dict[str, str], cwd: Path):
        self.args = ["rlctl", *args]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(path)
            body = json.dumps({"args": list(args), "env": env, "cwd": str(cwd)}).encode()
            socket.send_fds(self._conn, [_HEADER.pack(len(body)) + body], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        self._replies = self._conn.makefile("rb")
        self.pid = json.loads(self._replies.readline())["pid"]
        encoding = locale.getpreferredencoding(False)
        self.stdout = open(out_r, encoding=encoding)  # noqa: SIM115 (closed by communicate or __exit__)
        self.stderr = open(err_r, encoding=encoding)  # noqa: SIM115
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_exit()
        return self.returncode

    def _read_exit(self) -> None:
        line = self._replies.readline()
        if not line:
            raise RuntimeError("the tests' fork server went away before its child ended")
        self.returncode = json.loads(line)["returncode"]
        self._replies.close()
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both pipes read to their end, then the exit waited for (``Popen.communicate``)."""
        if not hasattr(self, "_readers"):
            self._chunks = {"out": [], "err": []}
            self._readers = [
                threading.Thread(target=self._drain, args=(f, self._chunks[k]), daemon=True)
                for k, f in (("out", self.stdout), ("err", self.stderr))
            ]
            for t in self._readers:
                t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return "".join(self._chunks["out"]), "".join(self._chunks["err"])

    @staticmethod
    def _drain(f, into: list[str]) -> None:
        into.append(f.read())
        f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdout, self.stderr):
            if not f.closed:
                f.close()
        if self.returncode is None:
            self.kill()
            self.wait()


def _run_as_console_script() -> None:
    """``sys.exit(main())`` of the console script, and Python's exit after it: the exit status of a
    SystemExit, a traceback and 1 for an uncaught exception, non-daemon threads joined, atexit handlers
    run, stdio flushed. The interpreter's teardown of the server's modules is skipped (``os._exit``): it
    costs about 1.5 s of CPU and does nothing a test can see."""
    import atexit

    from rlctl.cli import main

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # as Python does: die of SIGINT
        threading._shutdown()
        atexit._run_exitfuncs()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with _quiet():
            stream.flush()


if __name__ == "__main__":
    sys.path[0] = str(Path(CONSOLE_SCRIPT).parent)  # the console script's sys.path, not tests/'s
    _become(serve(sys.argv[1]))  # serve returns only in a forked child
    _run_as_console_script()
