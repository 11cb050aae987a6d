"""The project's Slurm scripts under a real Slurm (tests/slurm_cluster.py: Debian's slurm-wlm, a controller
and a node daemon on this machine), as an operator submits them: examples/slurm-requeue.sbatch (one node)
and examples/slurm-ray-multinode.sbatch (a Ray head started by the job, here on its one node). Each job is
preempted as Slurm does before a time limit (SIGUSR1 to the batch shell, `--signal=B:USR1`), rlctl
commits a snapshot and exits 75, the script requeues the job, and the requeued job resumes the run to its
end: every step trained once, one preemption, exit 0. The scripts ask for GPUs (`--gres`), which the test
lifts (`--gres=none`). Slurm holds a requeued job until its old job credential has expired (AuthInfo's
cred_expire + 1 s: 121 s by default, 11 s in this cluster's slurm.conf); started sooner, the node refuses
it ("Job credential revoked").

A node that dies: on a cluster of two nodes (``SlurmCluster(nodes=...)``: two slurmds under other
NodeNames, each in a UTS namespace of its own, so each node's jobs see its name as their hostname), the job
runs on node-a; once it has committed step 2's snapshot, every process of node-a is SIGKILLed (slurmd, the
batch script, rlctl, the Ray head) and node-a is set DOWN, which is how Slurm learns of a dead node and
what makes it requeue the job. The requeued job runs on node-b, finds node-a's lease with a recent
heartbeat, takes it over as the job's earlier run's (no --force, no person) and completes every step
once."""

import calendar
import json
import sys
import time
from pathlib import Path

import pytest
from ray_nodes import SYSTEM_CONFIG, free_port
from slurm_cluster import SlurmCluster

from helpers import REPO, events_of, has_step, metrics_of, settled_before

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("slurm",)

STEPS = 4
CONFIG = {
    "name": "slurm",
    "trainer": {"total_steps": STEPS, "prompts_per_step": 4},
    "algorithm": {"group_size": 4},
    "rollout": {"max_new_tokens": 6},
    "checkpoint": {"every": 2},
    "faults": "sleep@2=120",  # held after step 2 (once in the run) until Slurm's signal
}
JOB_TIMEOUT_S = 240  # (a Ray job of the test alone took 114 s of it on a loaded 2-core machine)
# what the scripts say last, other than "preempted ...; requeueing"
ENDS = ("run complete", "rlctl exited with", "leaving it to a person", "not starting a second writer", "did not start")


@pytest.fixture(scope="module")
def slurm():
    reason = SlurmCluster.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(cpus=2)
    yield cluster
    cluster.stop()


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


def preempt_and_finish(slurm, job: str, run: Path) -> str:
    """Once the run has trained step 2, SIGUSR1 to the job's batch shell; the job's log once it has left
    the queue, requeued and run again."""
    deadline = time.time() + JOB_TIMEOUT_S
    _until(slurm, job, run, deadline, has_step(run, 2), "the job did not reach step 2")
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    return _finished(slurm, job, run, deadline)


def kill_the_node_and_finish(cluster, job: str, run: Path) -> str:
    """Once the run on node-a has committed step 2's snapshot (it is held after step 2), node-a dies and
    node-b takes jobs; the job's log once Slurm has requeued it onto node-b and it has left the queue."""
    deadline = time.time() + JOB_TIMEOUT_S
    committed = (run / "checkpoints" / "step-000002" / "manifest.json").exists
    _until(cluster, job, run, deadline, lambda: committed() and settled_before(run, 3), "no snapshot of step 2")
    assert json.loads((run / "lease.json").read_text())["host"] == "node-a"
    cluster.set_node("node-b", "RESUME")
    assert cluster.kill_node("node-a")
    return _finished(cluster, job, run, deadline)


def _until(slurm, job: str, run: Path, deadline: float, ready, why: str) -> None:
    while not ready():
        assert slurm.job_state(job) and time.time() < deadline, _log(run, why)
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


def assert_requeued_and_complete(slurm, job: str, run: Path, log: str) -> None:
    assert "preempted with a committed snapshot; requeueing" in log, log
    assert log.rstrip().endswith("run complete"), log
    assert [row["step"] for row in metrics_of(run)] == list(range(1, STEPS + 1)), log  # every step once
    assert [e["event"] for e in events_of(run)].count("preempted") == 1, log
    restarts = slurm.run("scontrol", "show", "job", job, check=False).stdout
    assert "Restarts=1" in restarts or not restarts, restarts  # (a finished job may have left the controller)


def test_the_single_node_example_is_preempted_requeued_and_resumed_to_the_end(slurm, tmp_path):
    job, run = submit(slurm, tmp_path, "slurm-requeue.sbatch", {})
    log = preempt_and_finish(slurm, job, run)
    assert_requeued_and_complete(slurm, job, run, log)


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


def test_the_multi_node_ray_script_on_one_node_is_preempted_requeued_and_resumed(slurm, tmp_path):
    """The job starts a Ray head (`srun ray start --head --block`) and rlctl against it; preempted, it
    stops the head and requeues; the requeued job starts a new head and resumes the run there (the resume
    names the new head's address and the allocation's size)."""
    job, run = submit(slurm, tmp_path, "slurm-ray-multinode.sbatch", ray_script_env(), "--nodes=1")
    log = preempt_and_finish(slurm, job, run)
    assert_requeued_and_complete(slurm, job, run, log)
    (resume,) = [e for e in events_of(run) if e["event"] == "resume"]
    assert resume["step"] == 2 and resume["replays_exactly"], resume  # the same head address: no change


def assert_taken_over_from_the_dead_node_and_complete(cluster, job: str, run: Path, log: str) -> None:
    """The requeued job ran on node-b, took node-a's lease over as the job's earlier run's while its
    heartbeat was still recent, resumed from step 2 and trained every step once, with no --force."""
    assert log.rstrip().endswith("run complete"), log
    assert "took over the lease of node-a pid " in log and f"of Slurm job {job} (run 1)" in log, log
    assert f"it was taken by an earlier run of Slurm job {job} (run 1), which Slurm requeued" in log, log
    (taken,) = events_of(run, "lease_taken_over")
    previous = taken["previous"]
    assert previous["host"] == "node-a" and previous["job"]["id"] == job and previous["job"]["restart"] == 0
    taken_at = calendar.timegm(time.strptime(taken["time"], "%Y-%m-%dT%H:%M:%SZ"))
    assert taken_at - previous["heartbeat"] < 120, taken  # live still: the job, not staleness, took it over
    (resume,) = events_of(run, "resume")
    assert resume["step"] == 2, resume
    assert [row["step"] for row in metrics_of(run)] == list(range(1, STEPS + 1)), log  # every step once
    assert not (run / "lease.json").exists()  # released at the end by node-b's writer
    restarts = cluster.run("scontrol", "show", "job", job, check=False).stdout
    assert ("Restarts=1" in restarts and "NodeList=node-b" in restarts) or not restarts, restarts


def test_a_job_whose_node_dies_is_requeued_by_slurm_and_resumed_on_another_node(two_nodes, tmp_path):
    assert "--force" not in (REPO / "examples" / "slurm-requeue.sbatch").read_text().split("#SBATCH")[-1]
    job, run = submit(two_nodes, tmp_path, "slurm-requeue.sbatch", {})
    log = kill_the_node_and_finish(two_nodes, job, run)
    assert_taken_over_from_the_dead_node_and_complete(two_nodes, job, run, log)


def test_the_ray_scripts_head_node_dies_and_the_job_resumes_on_another_node(two_nodes, tmp_path):
    """The Ray head (a job step) and rlctl die with node-a; the requeued job starts a new head on node-b
    and its resume takes node-a's lease over as the job's earlier run's."""
    job, run = submit(two_nodes, tmp_path, "slurm-ray-multinode.sbatch", ray_script_env(), "--nodes=1")
    log = kill_the_node_and_finish(two_nodes, job, run)
    assert_taken_over_from_the_dead_node_and_complete(two_nodes, job, run, log)
