"""Several DeepSpeed ranks: local processes (`--nproc 2`) and Ray actors on two Ray nodes of this
machine (tests/support/ray_nodes.py), real gloo process groups, real signals. A 2-rank run samples exactly what a
1-rank run samples (seeds depend on the prompt and sample, not on the rank) and takes the same gradient
up to float rounding; it snapshots every rank's files under one manifest (on local disk or object
storage) and resumes bit-exactly after SIGKILL or SIGTERM."""

import os
import signal
import time
from pathlib import Path

import orjson
import pytest

from rlctl.errors import ExitCode
from rlctl.inspect import CHECK_CODES
from rlctl.storage import Storage

from helpers import (
    REPO,
    completed_hash,
    events_of,
    has_step,
    invoke,
    metrics_of,
    run_cli,
    spawn,
    stable,
    start_args,
    wait_for,
)
from ray_nodes import ENV as RAY_ENV
from ray_nodes import RayNodes

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("one_rank", "two_local")

BASE = ["--set", "trainer.prompts_per_step=8", "--set", "algorithm.group_size=4", "--set", "rollout.max_new_tokens=12"]
# validation too: 5 held-out prompts over 2 ranks, so one rank's share is padded (ZeRO-3 gathers together)
VAL = ["--set", "trainer.val_every=3", "--set", "data.builtin_val_size=5"]
COMMON = [*BASE, "--set", "trainer.total_steps=6", "--set", "checkpoint.every=2", *VAL]
# two Ray nodes of one CPU each (tests/support/ray_nodes.py), one rank on each
TWO_NODES = ["--set", "trainer.nnodes=2", "--set", "trainer.n_devices_per_node=1", "--set", "cluster.cpus_per_rank=0.5"]
NODE_LOSS_TIMEOUT = 8  # cluster.node_loss_timeout: the pings' bound (Ray's own health checks take about 14 s here)
# the 2-rank ZeRO-3 runs micro-batch by token budget (test_token_budget_...); ZeRO-2's take one per rank
BUDGET = {2: [], 3: ["--set", "actor.max_tokens_per_micro_batch=40"]}
# files of both ranks that a 2-rank snapshot's manifest lists
RANK_FILES = (
    "state.pt",
    "state.rank-1.pt",
    "ranks/rank-1.json",
    "actor/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "actor/zero_pp_rank_1_mp_rank_00_optim_states.pt",
)


def close_to_one_rank(rows2, rows1):
    """Step 1 (same weights, same seeds): the same samples, and the same gradient and token means up to
    float rounding (token-mean is over every token of the batch on every rank). Later steps within
    tolerance: Adam's first steps move every weight by about ±lr, so weights whose gradient is float noise
    around 0 may go either way, and the samples drift apart from there."""
    assert len(rows2) == len(rows1) == 6
    assert [r["step"] for r in rows2 if "val/score/mean" in r] == [r["step"] for r in rows1 if "val/score/mean" in r]
    assert [r["step"] for r in rows2 if "val/score/mean" in r] == [3, 6]
    assert rows2[0]["critic/score/mean"] == rows1[0]["critic/score/mean"]
    assert rows2[0]["perf/tokens_seen"] == rows1[0]["perf/tokens_seen"]
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "actor/pg_clipfrac"):
        assert rows2[0][key] == pytest.approx(rows1[0][key], rel=1e-4, abs=1e-6), key
    for a, b in zip(rows2, rows1):
        assert a["step"] == b["step"]
        assert abs(a["critic/score/mean"] - b["critic/score/mean"]) < 0.05
        assert abs(a["actor/entropy"] - b["actor/entropy"]) < 0.05
        assert abs(a["actor/grad_norm"] - b["actor/grad_norm"]) < 0.1 * b["actor/grad_norm"] + 0.05
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) < 0.02


def committed(run, step) -> bool:
    return any(e["event"] == "snapshot_committed" and e["step"] == step for e in events_of(run))


def manifest(run, step):
    return orjson.loads((run / "checkpoints" / f"step-{step:06d}" / "manifest.json").read_bytes())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """1-rank reference runs, actor.zero_stage 2 (which one rank trains at stage 0) and ZeRO-3."""
    out = {}
    for stage in (2, 3):
        run = tmp_path_factory.mktemp("one") / f"z{stage}"
        r = invoke("start", *start_args(run), *COMMON, "--set", f"actor.zero_stage={stage}", cwd=REPO)
        assert r.returncode == 0, r.stderr
        out[stage] = run
    return out


@pytest.fixture(scope="module")
def two_local(tmp_path_factory):
    """Uninterrupted 2-rank runs on this machine by ZeRO stage (``BUDGET``), made on first use: ZeRO-2's as
    local processes (--nproc 2), ZeRO-3's as actors of a Ray that rlctl starts itself (--ray-address local),
    so that both ways of placing ranks on one machine run end to end."""
    runs = {}

    def get(stage: int):
        if stage not in runs:
            run = tmp_path_factory.mktemp("two") / f"z{stage}"
            where = (
                ["--nproc", "2"] if stage == 2 else ["--ray-address", "local", "--set", "trainer.n_devices_per_node=2"]
            )
            kw = {} if stage == 2 else {"env": RAY_ENV}
            r = run_cli(
                "start", *start_args(run), *where, *COMMON, "--set", f"actor.zero_stage={stage}", *BUDGET[stage], **kw
            )
            assert r.returncode == 0, r.stderr
            assert r.stdout == f"{run}\n"  # data only: the ranks' chatter stays on stderr
            runs[stage] = run
        return runs[stage]

    return get


def test_local_two_ranks_match_one_rank_and_resume_exactly_after_sigkill(tmp_path, one_rank, two_local, s3_env):
    """Two local ranks take the 1-rank run's steps; SIGKILL after step 5 kills the ranks with their driver.
    The killed run keeps its snapshots on S3 (the run directory stays local): each rank stages its own
    files and uploads them before listing them, rank 0 commits only after checking every listed object's
    size, and a resume from S3 ends bit-identical to the uninterrupted local run."""
    import s3fs

    ref = two_local(2)
    close_to_one_rank(metrics_of(ref), metrics_of(one_rank[2]))
    m = manifest(ref, 6)
    assert m["world_size"] == 2
    for f in RANK_FILES:
        assert f in m["files"], sorted(m["files"])

    # SIGKILL the driver after step 5 (last snapshot: 4): its ranks die with it, resume is exact
    env, opts = s3_env  # (FSSPEC_S3 points s3fs at the endpoint: the demo config stays the base)
    run, url = tmp_path / "killed", "s3://rlctl-runs/ckpts/two-ranks"
    args = ["--nproc", "2", *COMMON, "--set", f"checkpoint.dir={url}"]
    proc = spawn("start", *start_args(run), *args, env=marked(run, env), faults="sleep@5=120")
    wait_for(lambda: has_step(run, 5)() and committed(run, 4), proc)  # an upload may end after the next step
    assert _ranks_alive(run)  # (the check sees this run's ranks)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _ranks_end(run), "rank processes outlived their driver"
    r = run_cli("resume", str(run), "--from", "latest", env=env)
    assert r.returncode == 0, r.stderr
    assert "continuing from step 4" in r.stderr
    assert completed_hash(run) == completed_hash(ref)
    assert stable(metrics_of(run)) == stable(metrics_of(ref))
    assert [row["step"] for row in metrics_of(run, "metrics.abandoned.jsonl")] == [5]
    assert not (run / "checkpoints").exists()  # every snapshot went to the object store
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    m = orjson.loads(fs.cat_file(f"{url}/step-000006/manifest.json"))
    assert m["world_size"] == 2 and all(f in m["files"] for f in RANK_FILES), sorted(m["files"])

    # a ZeRO stage the snapshots were not written with is refused, with the reason (another world size
    # is not: tests/e2e/test_elastic_resume.py)
    cfg = (run / "config.yaml").read_text().replace("zero_stage: 2", "zero_stage: 1")
    (run / "config.yaml").write_text(cfg)
    r = run_cli("resume", str(run), "--from", "step-4", env=env)
    assert r.returncode == ExitCode.SNAPSHOT, r.stderr
    assert "written with ZeRO stage 2; this run uses stage 1 (the stage cannot change on resume)" in r.stderr


def marked(run, env=None) -> dict:
    """``env`` with a variable naming ``run``, which its driver hands on to its ranks (see ``_ranks_alive``;
    the fork server starts such a driver from the console script: /proc/PID/environ shows the variable
    only where a process, or the process it was forked from, was exec'd with it)."""
    return {**(env or {}), "RLCTL_TEST_RUN": str(run)}


def _ranks_end(run, within: float = 10.0) -> bool:
    """Whether every rank process of ``run`` has ended within ``within`` seconds: PDEATHSIG is delivered at
    once, but a rank with torch loaded takes a moment to exit on a loaded machine (the driver's SIGKILL
    ends the starter, whose death ends its ranks)."""
    deadline = time.monotonic() + within
    while _ranks_alive(run):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _ranks_alive(run) -> bool:
    """Whether a rank process of ``run`` (started with ``marked``) is alive: the ranks of other runs on
    this machine (another pytest-xdist worker's, another user's) do not count."""
    mark = f"RLCTL_TEST_RUN={run}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            comm = Path(f"/proc/{pid}/comm").read_text()
            status = Path(f"/proc/{pid}/status").read_text()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = b"rlctl.ranks.local" in cmd or comm.startswith("rlctl-rank")  # exec'd, or forked (and their starter)
        if rank and mark in environ and "State:\tZ" not in status:
            return True
    return False


def test_token_budget_micro_batches_on_two_ranks_take_the_one_rank_gradient(one_rank, two_local):
    """Micro-batches by token budget under ZeRO-3 on two ranks: each rank sorts its share by length and
    cuts it by the budget, the ranks agree on one count (a rank that needs fewer splits its largest, since
    every forward gathers parameters and every backward reduces together), and the no-grad passes go by
    the same budget. The run takes the 1-rank run's gradient at step 1 (token-mean is exact whatever the
    cut) and stays close to it. (The run is the ZeRO-3 reference of the Ray test.)"""
    close_to_one_rank(metrics_of(two_local(3)), metrics_of(one_rank[3]))


def test_ray_two_nodes_lose_one_then_are_preempted_and_end_exactly_as_one_uninterrupted_run(
    one_rank, two_local, s3_env, monkeypatch
):
    """Two Ray nodes on this machine (`ray start --head`, `ray start --address`: two raylets of one CPU
    each) take one rank each (STRICT_SPREAD over trainer.nnodes, asserted from Ray's own state), with the
    run directory on S3 (ranks on several nodes need storage that every node reaches). One run, three
    processes of rlctl, as a night on a cluster goes:

    - **a node lost** after step 4 (step 2's snapshot committed; step 4's files written, its manifest held
      back: mid-commit): the non-head node's whole process group (raylet, workers, agents) is SIGKILLed,
      as a node losing power, while both ranks pause. The survivor may go on into step 5's collectives
      with its dead peer (which fail on loopback: a crash of its own). The driver notices within
      cluster.node_loss_timeout (or sooner, once Ray declares the node dead), stops the survivor, records
      ``node_lost`` last, naming the node and its rank, and exits 76; `inspect --check` says 47; step 2's
      snapshot verifies and step 4's was never committed;
    - **a preemption**: a fresh node joins the head and `rlctl resume` goes on from step 2; SIGTERM after
      step 5: the driver forwards it to the actors, every rank stops after the same step, rank 0 commits
      that step's snapshot, exit 75;
    - resumed again on the cluster (placed anew), the run ends bit-identical to an uninterrupted local
      2-rank run on one node.

    Each process's ``ranks_placed`` event names the nodes Ray's own state shows its ranks on.

    ZeRO-3 only: ZeRO-2's two ranks are proven by the local SIGKILL test, and placement does not depend
    on the stage."""
    pytest.importorskip("ray")
    import fsspec.config

    s3, opts = s3_env
    monkeypatch.setitem(fsspec.config.conf, "s3", opts)  # this process reads the run as its ranks write it
    env, url, stage = {**s3, **RAY_ENV}, "s3://rlctl-runs/ray/two-nodes", 3
    ref, run, step4 = two_local(stage), Storage(url), "checkpoints/step-000004"
    nodes = RayNodes(2)  # the run connects once the head is up; its placement waits for the other node
    try:
        args = ["--ray-address", nodes.address, *TWO_NODES, "--set", f"actor.zero_stage={stage}", *BUDGET[stage]]
        args += ["--set", f"cluster.node_loss_timeout={NODE_LOSS_TIMEOUT}"]
        proc = spawn("start", *start_args(url), *COMMON, *args, env=env, faults="sleep@4=120,commit_delay@4=300")
        wait_for(lambda: any(e["step"] == 4 for e in events_of(url, "drill_fired")), proc)
        wait_for(lambda: committed(url, 2) and run.exists(f"{step4}/state.pt"), proc)
        placed = nodes.state()
        lost = next(n for n in placed["nodes"] if n != placed["head"])
        nodes.kill(1)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        noticed = time.monotonic() - killed
        assert proc.returncode == ExitCode.NODE_LOST, err
        assert noticed < NODE_LOSS_TIMEOUT + 20, noticed  # the pings' bound, with the driver's own teardown
        node_lost = events_of(url)[-1]
        assert "Ray node " in err and f"rlctl resume {url} --from latest" in err, err
        check = invoke("inspect", url, "--check")
        listed = invoke("checkpoints", url, "--verify", "--format", "json")  # (every file's sha256 read)

        nodes.add()  # a fresh node in place of the lost one
        proc = spawn("resume", url, "--from", "latest", faults="sleep@5=120", env=env)
        wait_for(lambda: any(e["step"] == 5 for e in events_of(url, "drill_fired")), proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == ExitCode.PREEMPTED, err
        assert "snapshot of step 5 committed" in err, err
        assert [e["event"] for e in events_of(url)][-2:] == ["snapshot_committed", "preempted"], err
        r = run_cli("resume", url, "--from", "latest", env=env)
        rows, resumes, placements = metrics_of(url), events_of(url, "resume"), events_of(url, "ranks_placed")
        last = orjson.loads(run.read_bytes("checkpoints/step-000006/manifest.json"))
        done = completed_hash(url)
        state = nodes.state()
    finally:
        nodes.stop()
    assert node_lost["event"] == "node_lost" and node_lost["exit_code"] == 76, node_lost
    assert (node_lost["step"], node_lost["snapshot"]) == (4, 2), node_lost  # trained; where a resume goes on
    on_lost = [a for a in placed["actors"] if a["class"] == "RankActor" and a["node"] == lost]
    assert [n["id"] for n in node_lost["nodes"]] == [lost] and len(on_lost) == 1, node_lost
    assert node_lost["nodes"][0]["ranks"] in ([0], [1])
    assert check.returncode == CHECK_CODES["node_lost"] == 47, check.stdout + check.stderr
    assert f"NODE LOST {url}" in check.stdout and lost[:12] in check.stdout
    snapshots = {row["step"]: row for row in orjson.loads(listed.stdout)}
    assert snapshots[2]["committed"] and snapshots[2]["usable"], listed.stdout
    assert 4 not in snapshots or not snapshots[4]["committed"], listed.stdout  # the commit in flight never happened
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{url}\n"
    assert [(e["step"], e["snapshot"]) for e in resumes] == [(2, "step-000002"), (5, "step-000005")]
    # Ray's own account: each of the three processes' two rank actors on two nodes, one each; the
    # resumes' on the head and the fresh node
    assert len(state["nodes"]) == 2 and lost not in state["nodes"], state
    by_job = {}
    for actor in (a for a in state["actors"] if a["class"] == "RankActor"):
        by_job.setdefault(actor["job"], []).append(actor["node"])
    first = sorted(placed["nodes"])
    assert sorted(map(sorted, by_job.values())) == sorted([first, *[sorted(state["nodes"])] * 2]), state
    # and the run's own: each process's rank 0 recorded where its ranks were placed, as Ray says
    recorded = [sorted(r["node"] for r in e["ranks"]) for e in placements]
    assert recorded == [first, *[sorted(state["nodes"])] * 2], recorded
    assert all([r["rank"] for r in e["ranks"]] == [0, 1] for e in placements)
    assert last["world_size"] == 2
    assert done == completed_hash(ref)  # the weights and every row of the uninterrupted local run
    assert stable(rows) == stable(metrics_of(ref))
    close_to_one_rank(rows, metrics_of(one_rank[stage]))


def test_a_lost_rank_stops_the_run_with_its_error(tmp_path):
    """Rank 1 dies after step 3: rank 0 would wait in a collective forever, so the driver stops it,
    records the crash and exits 1 with rank 1's error; nothing is left running; inspect says crashed."""
    run = tmp_path / "run"
    r = run_cli("start", *start_args(run), "--nproc", "2", *COMMON, env=marked(run), faults="crash@3=1")
    assert r.returncode == ExitCode.INTERNAL, r.stderr
    assert "rank 1 crashed after step 3" in r.stderr
    assert r.stdout == ""
    assert _ranks_end(run)
    # the outcome recorded is the crash (step 2's asynchronous commit may finish, and say so, after it)
    assert [e["event"] for e in events_of(run) if e["event"] != "snapshot_committed"][-1] == "crashed"
    assert (run / "checkpoints" / "step-000002" / "manifest.json").exists()  # the last snapshot stands
    assert invoke("inspect", str(run), "--check").returncode == 43


def test_a_nan_on_one_rank_is_rolled_back_by_every_rank(tmp_path):
    """Only rank 1's batch gets a NaN log-prob: the ranks agree to drop the update (backward and step
    are collectives), the reduced row shows the NaN to both, and default.yaml rolls both back."""
    run = tmp_path / "run"
    r = run_cli(
        "start",
        *start_args(run),
        "--nproc",
        "2",
        *COMMON,
        "--set",
        "policies=[policies/default.yaml]",
        faults="nan_log_prob@3=1",
    )
    assert r.returncode == 0, r.stderr
    rollbacks = [e for e in events_of(run) if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["from_step"] == 3 and rollbacks[0]["to_step"] == 2
    assert [row["step"] for row in metrics_of(run)] == list(range(1, 7))
    assert metrics_of(run, "metrics.abandoned.jsonl")[0]["actor/skipped_updates"] >= 1
