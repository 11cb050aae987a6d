"""Losing a node of a real Ray cluster (tests/ray_nodes.py: two raylets on this machine) in the middle
of a run: the driver says so with exit 76 and a ``node_lost`` event, keeps what was committed, and the run
resumes on a healthy cluster."""

import json
import time

import pytest
from ray_nodes import ENV as RAY_ENV
from ray_nodes import RayNodes

from rlctl.errors import ExitCode
from rlctl.inspect import CHECK_CODES
from rlctl.storage import Storage

from helpers import events_of, invoke, metrics_of, run_cli, spawn_start, wait_for

BASE = ["--set", "trainer.prompts_per_step=4", "--set", "algorithm.group_size=2", "--set", "rollout.max_new_tokens=8"]
# two Ray nodes of one CPU each, one rank on each (as in test_multirank's two-node test)
TWO_NODES = ["--set", "trainer.nnodes=2", "--set", "trainer.n_devices_per_node=1", "--set", "cluster.cpus_per_rank=0.5"]
# a pause after step 3 (a window for the kill), with step 2's snapshot committed and step 3's held back
DRILLS = "sleep@3=8,commit_delay@3=300"
TIMEOUT = 8  # cluster.node_loss_timeout: the pings' bound (Ray's own health checks take about 14 s here)


def test_a_lost_node_stops_the_run_with_exit_76_and_it_resumes_on_a_fresh_node(s3_env, monkeypatch):
    """After step 3 (step 2's snapshot committed; step 3's files written, its manifest held back: mid-commit)
    the non-head node's whole process group (raylet, workers, agents) is SIGKILLed, as a node losing
    power, while both ranks pause; the surviving rank may then go on into step 4's collectives with its
    dead peer (which fail on loopback, where a dead peer's connections are reset: a crash of its own). The
    driver notices within cluster.node_loss_timeout (or sooner, once Ray declares the node dead), stops
    the survivor, records ``node_lost`` last, naming the node and its rank, and exits 76; `inspect --check`
    says 47; step 2's snapshot is intact and step 3's was never committed. A fresh node joins the head,
    and `rlctl resume` completes the run from step 2."""
    pytest.importorskip("ray")
    import fsspec.config

    s3, opts = s3_env
    monkeypatch.setitem(fsspec.config.conf, "s3", opts)  # this process reads the run as its ranks write it
    env, url = {**s3, **RAY_ENV}, "s3://rlctl-runs/ray/node-loss"
    run, step3 = Storage(url), "checkpoints/step-000003"
    nodes = RayNodes(2)
    try:
        args = ["--ray-address", nodes.address, *TWO_NODES, "--set", f"cluster.node_loss_timeout={TIMEOUT}"]
        proc = spawn_start(url, *BASE, *args, steps=4, every=1, faults=DRILLS, env=env)
        wait_for(lambda: any(e["step"] == 3 for e in events_of(url, "drill_fired")), proc)
        wait_for(lambda: any(e["step"] == 2 for e in events_of(url, "snapshot_committed")), proc)
        wait_for(lambda: run.exists(f"{step3}/state.pt"), proc)
        state = nodes.state()
        lost = next(n for n in state["nodes"] if n != state["head"])
        on_lost = [a for a in state["actors"] if a["class"] == "RankActor" and a["node"] == lost]
        nodes.kill(1)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        noticed = time.monotonic() - killed
        assert proc.returncode == ExitCode.NODE_LOST, err
        assert noticed < TIMEOUT + 20, noticed  # the pings' bound, with the driver's own teardown
        event = events_of(url)[-1]
        assert event["event"] == "node_lost", err
        assert [n["id"] for n in event["nodes"]] == [lost] and len(on_lost) == 1, event
        assert event["nodes"][0]["ranks"] in ([0], [1]) and event["exit_code"] == 76
        assert "Ray node " in err and f"rlctl resume {url} --from latest" in err, err
        check = invoke("inspect", url, "--check")
        assert check.returncode == CHECK_CODES["node_lost"] == 47, check.stdout + check.stderr
        assert f"NODE LOST {url}" in check.stdout and lost[:12] in check.stdout
        listed = invoke("checkpoints", url, "--verify", "--format", "json")  # (every file's sha256 read)
        snapshots = {row["step"]: row for row in json.loads(listed.stdout)}
        assert snapshots[2]["committed"] and snapshots[2]["usable"], listed.stdout
        assert not run.exists(f"{step3}/manifest.json")  # the commit in flight never happened
        assert 3 not in snapshots or not snapshots[3]["committed"], listed.stdout
        nodes.add()  # a fresh node in place of the lost one
        r = run_cli("resume", url, "--from", "latest", env=env)
    finally:
        nodes.stop()
    assert r.returncode == 0, r.stderr
    resumed = events_of(url, "resume")[-1]
    assert resumed["step"] == 2 and resumed["snapshot"] == "step-000002", resumed
    assert events_of(url)[-1]["event"] == "completed"
    assert [row["step"] for row in metrics_of(url)] == [1, 2, 3, 4]
