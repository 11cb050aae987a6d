"""The jail a model's code runs in: bubblewrap (``bwrap``, Debian's ``bubblewrap`` package), a namespace
jail run as an ordinary program, and the limits every call runs under.

What the code sees: a new user namespace (uid 65534, every capability dropped), no network (a network
namespace of its own: loopback only, with nothing on it), its own PID, IPC, UTS and cgroup namespaces,
/usr (and /bin, /lib, /lib64, /sbin) and the interpreter's own prefix read-only, a few files of /etc
(the loader's cache, the time zone), a fresh /proc and /dev, and an empty /tmp of ``tmp_mb``. Nothing
else of the machine's files: not the run directory, not the home directory (where the interpreter lives
under it, e.g. pyenv's, only its prefix), not the working directory. When the program ends, the jail's
PID 1 ends and the kernel kills every process left in its PID namespace (a daemonised child included);
when the worker that started the jail dies, the jail dies with it (``--die-with-parent`` and the
worker's own PR_SET_PDEATHSIG on bwrap).

Limits (``Limits``), each the model's error when hit, never an infrastructure failure: CPU seconds
(RLIMIT_CPU), wall seconds (the call is killed), address space (RLIMIT_AS), processes (a pids cgroup
where this process may make one, e.g. as root; RLIMIT_NPROC besides, which a user namespace does not
always enforce), output bytes (the call is killed past them) and the size of /tmp (a tmpfs of that
size; RLIMIT_FSIZE the same).

``unsafe`` runs the same program with the same rlimits but no jail: for machines where no namespace can
be made, chosen explicitly (``sandbox.mode: unsafe``), never a fallback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

JAIL, UNSAFE = "jail", "unsafe"
UID = 65534  # nobody
SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
CGROUP_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))  # cgroup v1's pids, then v2's
FIX = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) and allow unprivileged user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; in a container, a seccomp "
    "or AppArmor profile that permits them), or set {key}.mode: unsafe on a machine where no jail can run "
    "(the model's code then runs with rlimits only, see docs/sandbox.md)"
)


class SandboxUnavailable(Exception):
    """The jail cannot start on this machine (its binary is missing, user namespaces are refused): a
    sentence naming the cause and the fix."""


@dataclass(frozen=True)
class Limits:
    """What a sandboxed call may use (``rlctl.config.sandbox.SandboxConfig`` documents each)."""

    mode: str = JAIL
    binary: str = "bwrap"
    cpu_time_s: int = 5
    wall_time_s: float = 5.0
    memory_mb: int = 1024
    processes: int = 32
    output_kb: int = 64
    tmp_mb: int = 16


def interpreter() -> tuple[str, str]:
    """The Python the code runs with (this one's base interpreter, no virtual environment) and its prefix."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _system_binds() -> list[str]:
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in ETC_FILES:
        args += ["--ro-bind-try", f, f]
    prefix = interpreter()[1]
    if not any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        args += ["--ro-bind", prefix, prefix]  # e.g. pyenv's under the home directory: only the prefix
    return args


def jail_argv(limits: Limits) -> list[str]:
    """The bwrap command line up to the program (which follows it)."""
    namespaces = ["--unshare-all", "--unshare-user", "--uid", str(UID), "--gid", str(UID), "--hostname", "sandbox"]
    safety = ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    env = [
        "--setenv",
        "PATH",
        "/usr/local/bin:/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]
    files = [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(limits.tmp_mb << 20),
        "--tmpfs",
        "/tmp",
        "--chdir",
        "/tmp",
    ]
    return [limits.binary, *namespaces, *safety, *env, *_system_binds(), *files, "--"]


class PidsCgroup:
    """A pids cgroup of one call (``pids.max``: the processes limit), where this process may make one."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def make(cls, processes: int) -> PidsCgroup | None:
        for root in CGROUP_ROOTS:
            if not (root.name == "pids" and (root / "cgroup.procs").exists()) and not _v2_pids(root):
                continue
            path = root / f"rlctl-sandbox-{uuid.uuid4().hex[:12]}"
            try:
                path.mkdir()
                (path / "pids.max").write_text(str(processes))
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
                continue
            return cls(path)
        return None

    def join(self) -> None:
        """Move the calling process in (run in the child before it starts bwrap)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def hit(self) -> bool:
        """Whether a fork was refused for the limit."""
        try:
            events = (self.path / "pids.events").read_text().split()
        except OSError:
            return False
        return len(events) >= 2 and events[0] == "max" and events[1] != "0"

    def remove(self) -> None:
        """Kill what is left in it (nothing, normally: the PID namespace died with its program), then remove it."""
        for _ in range(50):
            try:
                pids = (self.path / "cgroup.procs").read_text().split()
            except OSError:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(int(pid), 9)
            try:
                self.path.rmdir()
                return
            except OSError:
                import time

                time.sleep(0.02)


def _v2_pids(root: Path) -> bool:
    try:
        return "pids" in (root / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


def check(limits: Limits, key: str) -> None:
    """Start one jail that prints a word; a SandboxUnavailable naming ``key``, the cause and the fix when it
    cannot (the binary missing, user namespaces refused). Nothing is checked in ``unsafe`` mode."""
    if limits.mode == UNSAFE:
        return
    fix = FIX.format(key=key)
    if shutil.which(limits.binary) is None:
        raise SandboxUnavailable(
            f"'{key}.binary': {limits.binary!r} is not on PATH ({os.environ.get('PATH', '')}); {fix}"
        )
    python = interpreter()[0]
    argv = [*jail_argv(limits), python, "-I", "-c", "print('ready')"]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"'{key}': the jail ({limits.binary}) did not start: {exc}; {fix}") from None
    if done.returncode != 0 or done.stdout.strip() != b"ready":
        said = " ".join(done.stderr.decode(errors="replace").split())[:300] or f"exit code {done.returncode}"
        raise SandboxUnavailable(f"'{key}': the jail ({limits.binary}) cannot start on this machine ({said}); {fix}")


def version(binary: str = "bwrap") -> str | None:
    """``bubblewrap 0.8.0``, or None where it is not installed."""
    try:
        return subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# -- this process's limits (a tool worker's, set from the run's rollout.multi_turn.sandbox) ---------------
_limits = Limits()


def configure(limits: Limits) -> None:
    """Set this process's limits (a tool worker's, from the run's ``rollout.multi_turn.sandbox``)."""
    global _limits
    _limits = limits


def current() -> Limits:
    """This process's limits (the defaults until ``configure``)."""
    return _limits
