"""A real Ray cluster of several nodes on this machine, as a cluster's nodes are started: a head by `ray
start --head`, then each other node by `ray start --address HEAD`, every one a raylet of its own with its
own CPUs and its own Ray node id. Each node runs in a process group of its own (`ray start --block`), so
that the cluster's processes, and only those, are killed at the end.

The cluster keeps to itself: its temporary directory is its own (`ray start` writes the address a bare
`ray.init()` would join there, not in /tmp/ray, so another test's `--ray-address local` still starts its
own Ray), its fixed ports (GCS, dashboard, client server, dashboard agent) are free ones outside the
kernel's ephemeral range (``ports.server_port``; a head whose GCS cannot bind its port is started again
on fresh ones), and token authentication is off (a token in ~/.ray would otherwise turn it on for the head only)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ports import server_port

RAY = str(Path(sys.executable).parent / "ray")
# what the processes of the cluster and its clients (rlctl, the state query) need in their environment
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# as rlctl's own local Ray: no idle workers started ahead of the actors
SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
START_TIMEOUT_S = 90.0
HEAD_TRIES = 3  # starts of the head, each on fresh ports (a port may be taken before Ray's GCS binds it)

# the cluster's alive nodes and all its actors, read by a client of its GCS (no dashboard needed), as JSON
_ACTORS = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
head = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
print(json.dumps({"nodes": nodes, "head": head[0] if head else None, "actors": [
    {"class": a["ActorClassName"], "node": a["Address"]["NodeID"], "job": a["JobID"], "state": a["State"]}
    for a in ray._private.state.actors().values()]}))
"""


def free_port() -> int:
    """A port for a server Ray starts (it binds the port itself, later): see ``ports.server_port``."""
    return server_port()


class RayNodes:
    """``n`` Ray nodes of ``cpus`` CPUs each, all started at once (a node retries the head's GCS until it
    answers); ``address`` is the head's (what `--ray-address` takes). Returns once the head is up: a run
    can connect, and its placement group waits for the other nodes to join (``state`` waits for them)."""

    def __init__(self, n: int, cpus: float = 1):
        self.tmp = tempfile.mkdtemp(prefix="rlctl-ray-", dir="/tmp")  # short: Ray's sockets live under it
        self.procs: list[subprocess.Popen] = []
        self.killed: set[int] = set()
        try:
            self.address = self._start_head(cpus)
            for _ in range(n - 1):
                self._start("--address", self.address, cpus=cpus)
        except BaseException:
            self.stop()
            raise

    def _start_head(self, cpus: float) -> str:
        """Start the head and wait until it is up; its address. Its GCS binds a port probed free before,
        which another process may take first: `ray start` then exits, and the head is started again on
        fresh ports, ``HEAD_TRIES`` times at most."""
        config = json.dumps(SYSTEM_CONFIG)
        for attempt in range(HEAD_TRIES):
            address = f"127.0.0.1:{free_port()}"
            self._start("--head", "--port", address.split(":")[1], "--system-config", config, cpus=cpus)
            head, deadline = self.procs[0], time.time() + START_TIMEOUT_S
            while not self._started()[0] and head.poll() is None and time.time() < deadline:
                time.sleep(0.2)
            if self._started()[0]:
                return address
            if head.poll() is None or attempt == HEAD_TRIES - 1:  # (still starting: not a port taken)
                self._until(lambda: self._started()[0], "the Ray head")  # raises, with the logs, unless it is up
                return address
            self.stop(keep_tmp=True)  # what is left of its processes; its log is written anew by the next
            self.procs.clear()
        raise RuntimeError("the Ray head did not start")  # (HEAD_TRIES is at least 1: not reached)

    def _start(self, *args: str, cpus: float) -> None:
        ports = ["--dashboard-agent-listen-port", str(free_port())]  # (by default, ports one per machine)
        if "--head" in args:
            ports += ["--dashboard-port", str(free_port()), "--ray-client-server-port", str(free_port())]
        cmd = [RAY, "start", "--block", "--num-cpus", str(cpus), "--node-ip-address", "127.0.0.1"]
        cmd += ["--temp-dir", self.tmp, "--disable-usage-stats", *ports]
        cmd += ["--include-dashboard", "false"] if "--head" in args else []
        with open(os.path.join(self.tmp, f"node-{len(self.procs)}.log"), "wb") as log:
            proc = subprocess.Popen(
                [*cmd, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **ENV},
                start_new_session=True,  # its own process group: the node's processes, see ``stop``
            )
        self.procs.append(proc)

    def _started(self) -> list[bool]:
        """Whether each node is up (the head first): `ray start` says so once its raylet has joined."""
        return [b"Ray runtime started" in log.read_bytes() for log in self._logs()]

    def _logs(self) -> list[Path]:
        return sorted(Path(self.tmp).glob("node-*.log"))

    def _until(self, ready, what: str) -> None:
        deadline = time.time() + START_TIMEOUT_S
        while not ready():
            dead = [p.args for i, p in enumerate(self.procs) if p.poll() is not None and i not in self.killed]
            if dead or time.time() > deadline:
                logs = "".join(log.read_text(errors="replace")[-2000:] for log in self._logs())
                raise RuntimeError(f"{what} did not start ({dead or 'timed out'}): {logs}")
            time.sleep(0.2)

    def add(self, cpus: float = 1) -> None:
        """Start one more node, joining the head (as a fresh node of an allocation would)."""
        self._start("--address", self.address, cpus=cpus)

    def kill(self, index: int) -> None:
        """SIGKILL node ``index``'s process group at once (0: the head): its raylet, its workers (the
        rank actors placed there) and its agents, as a node that loses power."""
        os.killpg(self.procs[index].pid, signal.SIGKILL)
        self.procs[index].wait(timeout=30)
        self.killed.add(index)

    def state(self) -> dict:
        """Ray's own account, from its GCS, once every node that was not killed is up: the alive nodes ({id: IP
        address}), the head's id ("head") and every actor the cluster has had ({"class", "node", "job",
        "state"}: a dead actor keeps the node it ran on)."""
        self._until(
            lambda: all(up or i in self.killed for i, up in enumerate(self._started())),
            f"{len(self.procs)} Ray nodes",
        )
        done = subprocess.run(
            [sys.executable, "-c", _ACTORS, self.address],
            capture_output=True,
            text=True,
            env={**os.environ, **ENV},
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"cannot read the Ray cluster's state: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def stop(self, keep_tmp: bool = False) -> None:
        """Kill every node's process group (a raylet, its workers and agents; the head's GCS too)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=30)
        if not keep_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
