"""A real Slurm on this machine: Debian's slurm-wlm, a controller (slurmctld) and one node daemon (slurmd)
started as root with a configuration of their own, and a munge daemon of their own for authentication,
all in a temporary folder (state, spool, logs, munge's socket) with free ports, so that nothing on the
machine is touched and the daemons, and only those, are stopped at the end.

A cluster of named nodes (``SlurmCluster(nodes=("node-a", "node-b"))``) runs one slurmd per node, each in
a UTS and mount namespace of its own (``unshare``): its hostname is the node's name, and its /etc/hosts (a
file of the cluster's, bound over it there) resolves every node's name to 127.0.0.1. The jobs a node runs
inherit its namespaces, so a job requeued onto another node sees another hostname, as on a real cluster.
Two slurmds under other NodeNames share the machine's network, so each listens on a port of its own
(``Port=`` on its node line). ``kill_node`` is a node that dies: every process of its namespace (slurmd,
slurmstepd, the batch script, rlctl and what they started) SIGKILLed at once, then the node set DOWN, as
slurmctld does once it stops hearing from it (SlurmdTimeout), without waiting for that.

``SlurmCluster.skip_reason()`` says why one cannot start here (the packages missing, not root), for a
test to skip with; CI installs the packages (.ci/run)."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from helpers import DIST_VARS  # a test process's own process group: not for a job's ranks
from ports import server_port

DAEMONS = ("munged", "slurmctld", "slurmd", "unshare")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun")
START_TIMEOUT_S = 60.0
MUNGE_KEY = Path("/etc/munge/munge.key")


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None
    )


def _free_port() -> int:
    """A port for slurmctld or slurmd, which bind it themselves later: see ``ports.server_port``."""
    return server_port()


CONF = """\
ClusterName=rlctltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
KillWait=10
SchedulerParameters=sched_interval=2
{node_lines}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
NODE = "NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory=4000 State=UNKNOWN"


class SlurmCluster:
    """One controller and nodes of ``cpus`` CPUs each: one named after this host in its own namespaces
    (``nodes`` empty), or one per name in ``nodes``, each in namespaces of its own (see the module's
    docstring). ``env`` is what a client (sbatch, squeue) needs."""

    @staticmethod
    def skip_reason() -> str | None:
        missing = [n for n in (*DAEMONS, *CLIENTS) if _which(n) is None]
        if missing:
            return f"no Slurm here ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
        if os.geteuid() != 0:
            return "the Slurm daemons of the tests run as root"
        if not MUNGE_KEY.exists():
            return f"munge has no key ({MUNGE_KEY})"
        return None

    @staticmethod
    def nodes_skip_reason() -> str | None:
        """Why nodes of their own namespaces cannot run here, or None."""
        done = subprocess.run(
            ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", "hostname node-x && mount --bind /etc/hosts /etc/hosts"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return None if done.returncode == 0 else f"no UTS and mount namespaces here: {done.stderr.strip()}"

    def __init__(self, cpus: int = 2, nodes: tuple[str, ...] = ()):
        self.dir = Path(tempfile.mkdtemp(prefix="rlctl-slurm-", dir="/tmp"))  # short: munge's socket lives here
        host = socket.gethostname()
        self.nodes = nodes or (host,)
        (self.dir / "state").mkdir()
        for name in self.nodes:
            (self.dir / f"spool-{name}").mkdir()
        (self.dir / "hosts").write_text(f"127.0.0.1 localhost {' '.join(nodes)}\n")
        self.conf = self.dir / "slurm.conf"
        d_port = _free_port()
        lines = [NODE.format(name=n, port=d_port if n == host else _free_port(), cpus=cpus) for n in self.nodes]
        self.conf.write_text(
            CONF.format(host=host, ctld_port=_free_port(), d_port=d_port, dir=self.dir, node_lines="\n".join(lines))
        )
        self.env = {"SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []
        self.node_procs: dict[str, subprocess.Popen] = {}
        try:
            d = self.dir
            self._start("munged", "-F", "-f", f"--socket={d}/munge.sock", f"--key-file={MUNGE_KEY}",
                        f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed")  # fmt: skip
            self._until(lambda: (d / "munge.sock").exists(), "munged")
            self._start("slurmctld", "-D", "-f", str(self.conf))
            for name in self.nodes:
                self._start_node(name)
            self._until(self._idle, "the Slurm nodes")
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, *args: str, log: str = "", under: tuple[str, ...] = ()) -> subprocess.Popen:
        with open(self.dir / f"{log or name}.out", "ab") as out:
            proc = subprocess.Popen(
                [*under, _which(name), *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def _start_node(self, name: str) -> None:
        slurmd = ("-D", "-N", name, "-f", str(self.conf))
        if name == socket.gethostname():
            self.node_procs[name] = self._start("slurmd", *slurmd, log=f"slurmd-{name}")
            return
        # unshare execs sh, which execs slurmd: the process started is the node's slurmd
        inside = f'mount --bind {self.dir}/hosts /etc/hosts && hostname {name} && exec "$0" "$@"'
        under = ("unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", inside)
        self.node_procs[name] = self._start("slurmd", *slurmd, log=f"slurmd-{name}", under=under)

    def _idle(self) -> bool:
        done = self.run("sinfo", "-h", "-N", "-o", "%t", check=False)
        return done.returncode == 0 and done.stdout.split() == ["idle"] * len(self.nodes)

    def set_node(self, name: str, state: str) -> None:
        """``scontrol update`` a node's state: drain, resume, down."""
        self.run("scontrol", "update", f"NodeName={name}", f"State={state}", "Reason=set by the test")

    def kill_node(self, name: str) -> list[int]:
        """The node dies: every process of its namespace SIGKILLed at once (their pids returned), then the
        node set DOWN, which requeues a job that allows it (``--requeue``) onto the nodes left."""
        killed = self._kill_namespace(name)
        self.node_procs[name].wait(timeout=15)
        self.set_node(name, "DOWN")
        return killed

    def _kill_namespace(self, name: str) -> list[int]:
        """SIGKILL every process in the UTS namespace of node ``name``'s slurmd (never this machine's own)."""
        uts = os.readlink(f"/proc/{self.node_procs[name].pid}/ns/uts")
        if uts == os.readlink("/proc/self/ns/uts"):
            raise RuntimeError(f"node {name} runs in this machine's own namespace: killing it would kill everything")
        killed = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.readlink(entry / "ns" / "uts") == uts:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass  # ended meanwhile
        return killed

    def _until(self, ready, what: str) -> None:
        deadline = time.time() + START_TIMEOUT_S
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.time() > deadline:
                logs = "".join(p.read_text(errors="replace")[-1500:] for p in sorted(self.dir.glob("*.out")))
                raise RuntimeError(f"{what} did not start ({dead or 'timed out'}): {logs}")
            time.sleep(0.2)

    def run(self, *cmd: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster, with ``env`` added to its environment."""
        done = subprocess.run(
            [_which(cmd[0]) or cmd[0], *cmd[1:]],
            capture_output=True,
            text=True,
            timeout=60,
            env={**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, **self.env, **(env or {})},
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr}")
        return done

    def job_state(self, job: str) -> str:
        """``STATE REASON`` of a job still in the queue; "" once it has left it."""
        return self.run("squeue", "-h", "-j", job, "-o", "%T %r", check=False).stdout.strip()

    def stop(self) -> None:
        for name, proc in self.node_procs.items():  # a node's jobs first: they live in its namespace only
            if proc.poll() is None and name != socket.gethostname():
                self._kill_namespace(name)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
