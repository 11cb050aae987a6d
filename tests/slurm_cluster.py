"""A real Slurm on this machine: Debian's slurm-wlm, a controller (slurmctld) and one node daemon (slurmd)
started as root with a configuration of their own, and a munge daemon of their own for authentication,
all in a temporary folder (state, spool, logs, munge's socket) with free ports, so that nothing on the
machine is touched and the daemons, and only those, are stopped at the end.

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

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun")
START_TIMEOUT_S = 60.0
MUNGE_KEY = Path("/etc/munge/munge.key")


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
KillWait=10
SchedulerParameters=sched_interval=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """One controller and one node of ``cpus`` CPUs; ``env`` is what a client (sbatch, squeue) needs."""

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

    def __init__(self, cpus: int = 2):
        self.dir = Path(tempfile.mkdtemp(prefix="rlctl-slurm-", dir="/tmp"))  # short: munge's socket lives here
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir()
        self.conf = self.dir / "slurm.conf"
        host = socket.gethostname()
        self.conf.write_text(
            CONF.format(host=host, ctld_port=_free_port(), d_port=_free_port(), dir=self.dir, cpus=cpus)
        )
        self.env = {"SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []
        try:
            d = self.dir
            self._start("munged", "-F", "-f", f"--socket={d}/munge.sock", f"--key-file={MUNGE_KEY}",
                        f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed")  # fmt: skip
            self._until(lambda: (d / "munge.sock").exists(), "munged")
            self._start("slurmctld", "-D", "-f", str(self.conf))
            self._start("slurmd", "-D", "-f", str(self.conf))
            self._until(self._idle, "the Slurm node")
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, *args: str) -> None:
        with open(self.dir / f"{name}.out", "wb") as log:
            self.procs.append(
                subprocess.Popen([_which(name), *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def _idle(self) -> bool:
        done = self.run("sinfo", "-h", "-o", "%t", check=False)
        return done.returncode == 0 and done.stdout.strip() == "idle"

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
