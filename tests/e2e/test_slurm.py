"""The project's Slurm scripts under a real Slurm (tests/support/slurm_cluster.py: Debian's slurm-wlm, a controller
and two node daemons on this machine), as an operator submits them: examples/slurm-requeue.sbatch (one node)
and examples/slurm-ray-multinode.sbatch (a Ray head started by the job, here on its one node). The scripts
ask for GPUs (`--gres`), which the test lifts (`--gres=none`). Each job lives through both accidents of a
night on a cluster, one after the other:

- **its node dies.** On a cluster of two nodes (``SlurmCluster(nodes=...)``: two slurmds under other
  NodeNames, each in a UTS namespace of its own, so each node's jobs see its name as their hostname), the
  job runs on node-a; once it has committed step 2's snapshot, every process of node-a is SIGKILLed
  (slurmd, the batch script, rlctl, the Ray head) and node-a is set DOWN, which is how Slurm learns of a
  dead node and what makes it requeue the job. The requeued job runs on node-b, finds node-a's lease with
  a recent heartbeat, takes it over as the job's earlier run's (no --force, no person) and resumes;
- **it is preempted** as Slurm does before a time limit (SIGUSR1 to the batch shell, `--signal=B:USR1`)
  after step 3: rlctl commits a snapshot and exits 75, the script requeues the job, and the requeued job
  resumes the run to its end.

Every step is trained once and the job ends with the run complete. Slurm holds a requeued job until its
old job credential has expired (AuthInfo's cred_expire + 1 s: 121 s by default, 11 s in this cluster's
slurm.conf); started sooner, the node refuses it ("Job credential revoked")."""

import calendar
import json
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, events_of, has_step, metrics_of, settled_before
from ray_nodes import SYSTEM_CONFIG, free_port
from slurm_cluster import SlurmCluster

STEPS = 4
CONFIG = {
    "name": "slurm",
    "trainer": {"total_steps": STEPS, "prompts_per_step": 4},
    "algorithm": {"group_size": 4},
    "rollout": {"max_new_tokens": 6},
    "checkpoint": {"every": 2},
    "faults": "sleep@2=120,sleep@3=120",  # held after step 2 (its node dies), after step 3 (preempted)
}
JOB_TIMEOUT_S = 240  # each accident's (a Ray job of the test alone took 114 s of it on a loaded 2-core machine)
# what the scripts say last, other than "preempted ...; requeueing"
ENDS = ("run complete", "rlctl exited with", "leaving it to a person", "not starting a second writer", "did not start")


def submit(slurm, tmp_path: Path, script: str, env: dict[str, str], *opts: str) -> tuple[str, Path]:
    """sbatch ``script`` from ``tmp_path`` (its logs/ there) with ``env`` exported; the job id and the run."""
    (tmp_path / "logs").mkdir()
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(CONFIG))
    run = tmp_path / "run"
    exported = {"RUN": str(run), "CONFIG": str(config), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", **env}
    # sbatch hands its own environment to the job (--export=ALL, the default)
    done = slurm.run(
        "sbatch", "--parsable", "--gres=none", "--chdir", str(tmp_path), *opts, str(REPO / "examples" / script),
        env=exported,
    )  # fmt: skip
    return done.stdout.strip().split(";")[0], run


@pytest.fixture
def two_nodes():
    reason = SlurmCluster.skip_reason() or SlurmCluster.nodes_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(cpus=2, nodes=("node-a", "node-b"))
    cluster.set_node("node-b", "DRAIN")  # the job starts on node-a
    yield cluster
    cluster.stop()


def node_dies_then_preempted(cluster, job: str, run: Path) -> str:
    """Once the run on node-a has committed step 2's snapshot (it is held after step 2), node-a dies and
    node-b takes jobs; once the requeued job on node-b has trained step 3 (held after it), SIGUSR1 to its
    batch shell; the job's log once it has been requeued again, run to its end and left the queue."""
    deadline = time.time() + JOB_TIMEOUT_S
    committed = (run / "checkpoints" / "step-000002" / "manifest.json").exists
    _until(cluster, job, run, deadline, lambda: committed() and settled_before(run, 3), "no snapshot of step 2")
    assert json.loads((run / "lease.json").read_text())["host"] == "node-a"
    cluster.set_node("node-b", "RESUME")
    assert cluster.kill_node("node-a")
    deadline = time.time() + JOB_TIMEOUT_S
    _until(cluster, job, run, deadline, lambda: has_step(run, 3)() and settled_before(run, 4), "no step 3 on node-b")
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    return _finished(cluster, job, run, time.time() + JOB_TIMEOUT_S)


def _until(slurm, job: str, run: Path, deadline: float, ready, why: str) -> None:
    # (a requeued job may be missing from squeue for a moment between its runs: gone for 15 s, it ended)
    seen = time.time()
    while not ready():
        if slurm.job_state(job):
            seen = time.time()
        assert time.time() - seen < 15 and time.time() < deadline, _log(run, why)
        time.sleep(0.5)


def _finished(slurm, job: str, run: Path, deadline: float) -> str:
    # until the job has left the queue with the requeued run's last word in its log (between its runs, a
    # requeued job may be missing from squeue for a moment)
    while (state := slurm.job_state(job)) or not any(end in _log(run, "") for end in ENDS):
        if time.time() > deadline:
            shown = slurm.run("scontrol", "show", "job", job, check=False).stdout
            ctld = (slurm.dir / "slurmctld.log").read_text(errors="replace")[-3000:]
            raise AssertionError(_log(run, f"the job is still {state or 'not done'}: {shown}\n{ctld}"))
        time.sleep(0.5)
    return _log(run, "")


def _log(run: Path, why: str) -> str:
    logs = sorted((run.parent / "logs").glob("*.log"))
    return why + "\n" + "".join(p.read_text(errors="replace") for p in logs)


def ray_script_env() -> dict[str, str]:
    """What examples/slurm-ray-multinode.sbatch is given to run its Ray head on one node of this machine."""
    pytest.importorskip("ray")
    temp = f"/tmp/rlctl-ray-{free_port()}"  # short: Ray's sockets live under it
    head = [
        f"--temp-dir={temp}", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
        f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
        f"--system-config={json.dumps(SYSTEM_CONFIG, separators=(',', ':'))}",
    ]  # fmt: skip
    return {"RANKS_PER_NODE": "1", "RAY_PORT": str(free_port()), "RAY_HEAD_ARGS": " ".join(head)}


def assert_taken_over_preempted_and_complete(cluster, job: str, run: Path, log: str) -> None:
    """The requeued job ran on node-b, took node-a's lease over as the job's earlier run's while its
    heartbeat was still recent, resumed from step 2 with no --force; preempted after step 3, it was
    requeued and resumed from step 3; every step trained once, one preemption, the lease released."""
    assert log.rstrip().endswith("run complete"), log
    assert "took over the lease of node-a pid " in log and f"of Slurm job {job} (run 1)" in log, log
    assert f"it was taken by an earlier run of Slurm job {job} (run 1), which Slurm requeued" in log, log
    assert "preempted with a committed snapshot; requeueing" in log, log
    (taken,) = events_of(run, "lease_taken_over")
    previous = taken["previous"]
    assert previous["host"] == "node-a" and previous["job"]["id"] == job and previous["job"]["restart"] == 0
    taken_at = calendar.timegm(time.strptime(taken["time"], "%Y-%m-%dT%H:%M:%SZ"))
    assert taken_at - previous["heartbeat"] < 120, taken  # live still: the job, not staleness, took it over
    assert [e["step"] for e in events_of(run, "resume")] == [2, 3], log
    assert [e["event"] for e in events_of(run)].count("preempted") == 1, log
    assert [row["step"] for row in metrics_of(run)] == list(range(1, STEPS + 1)), log  # every step once
    assert not (run / "lease.json").exists()  # released at the end by node-b's writer
    restarts = cluster.run("scontrol", "show", "job", job, check=False).stdout
    assert ("Restarts=2" in restarts and "NodeList=node-b" in restarts) or not restarts, restarts


def test_the_single_node_example_survives_its_node_dying_and_a_preemption(two_nodes, tmp_path):
    assert "--force" not in (REPO / "examples" / "slurm-requeue.sbatch").read_text().split("#SBATCH")[-1]
    job, run = submit(two_nodes, tmp_path, "slurm-requeue.sbatch", {})
    log = node_dies_then_preempted(two_nodes, job, run)
    assert_taken_over_preempted_and_complete(two_nodes, job, run, log)


def test_the_ray_script_survives_its_head_node_dying_and_a_preemption(two_nodes, tmp_path):
    """The Ray head (a job step) and rlctl die with node-a; the requeued job starts a new head on node-b
    and its resume takes node-a's lease over as the job's earlier run's. Preempted, it stops the head and
    requeues; the requeued job starts a new head and resumes the run there."""
    job, run = submit(two_nodes, tmp_path, "slurm-ray-multinode.sbatch", ray_script_env(), "--nodes=1")
    log = node_dies_then_preempted(two_nodes, job, run)
    assert_taken_over_preempted_and_complete(two_nodes, job, run, log)
    resumed = events_of(run, "resume")[-1]  # on node-b again: the same head address, no change
    assert resumed["step"] == 3 and resumed["replays_exactly"], resumed
