"""Snapshots and resume end to end: the installed `rlctl` in subprocesses, real DeepSpeed, real storage,
real signals. Faults come from RLCTL_FAULTS (rlctl/faults.py)."""

import json
import shutil
import signal

import orjson
import pytest

from rlctl.errors import ExitCode

from helpers import (
    REPO,
    SMALL,
    completed_hash,
    events_of,
    has_step,
    hf_weights_sha256,
    invoke,
    kill_and_resume,
    metrics_of,
    run_cli,
    spawn,
    stable,
    start_args,
    wait_for,
)

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("finished",)


@pytest.mark.parametrize("stage", [3, 2])
def test_sigkill_and_resume_is_exact(tmp_path, stage):
    """An uninterrupted run and one killed with SIGKILL after step 4 (last snapshot: 3) and resumed end
    with bit-identical weights and identical per-step metrics. ZeRO-3, whose parameters are partitioned,
    and actor.zero_stage 2 (the default), which one rank trains at stage 0, DeepSpeed without partitioning
    (no ZeRO files: the model states file holds it all; an explicit stage 0 trains the same engine), and
    keeps on resume; ZeRO-2 itself resumes exactly after SIGKILL with two ranks (test_multirank.py), and a
    1-rank ZeRO-2 snapshot keeps its stage on resume (test_elastic_resume.py)."""
    common = [
        *SMALL,
        "--set",
        "trainer.total_steps=6",
        "--set",
        "checkpoint.every=3",
        "--set",
        f"actor.zero_stage={stage}",
    ]
    ref = tmp_path / "ref"
    r = invoke("start", *start_args(ref), *common, cwd=REPO)
    assert r.returncode == 0
    trained = 0 if stage == 2 else stage
    if stage == 2:
        assert "actor.zero_stage 2 trains at ZeRO stage 0: a world of one rank needs no partitioning" in r.stderr

    run = tmp_path / "killed"
    r = kill_and_resume(run, common, 4)
    assert "continuing from step 3" in r.stderr

    assert completed_hash(run) == completed_hash(ref)
    assert stable(metrics_of(run)) == stable(metrics_of(ref))
    abandoned = metrics_of(run, "metrics.abandoned.jsonl")
    assert [row["step"] for row in abandoned] == [4]
    assert abandoned[0]["abandoned"]["event"] == "resume" and abandoned[0]["abandoned"]["from_step"] == 3
    resume = [e for e in events_of(run) if e["event"] == "resume"][-1]
    assert resume["step"] == 3 and resume["snapshot"] == "step-000003" and resume["abandoned_metric_rows"] == 1
    for step in (3, 6):  # the stage trained, before the kill and after the resume, and its files
        m = orjson.loads((run / "checkpoints" / f"step-{step:06d}" / "manifest.json").read_bytes())
        assert m["zero_stage"] == trained, m
        assert any("zero_pp_rank" in f for f in m["files"]) == (trained != 0), sorted(m["files"])

    # export consolidates ZeRO-3's partitioned weights (stage 0's whole ones) into a Hugging Face directory, bit for bit
    out = tmp_path / "hf"
    r = invoke("export", str(run), str(out))
    assert r.returncode == 0 and r.stdout == f"{out}\n", r.stderr
    assert hf_weights_sha256(out) == completed_hash(ref)


def test_a_live_run_holds_its_lease_and_sigkill_during_commit_leaves_no_partial_snapshot(tmp_path):
    """While a run lives (the commit of its step-6 snapshot held by a drill), a second writer is refused
    (exit 10, naming the owner's pid). SIGKILL then leaves step 6 written but never committed: it is
    listed as unusable; a resume on the same host takes the dead owner's lease over without --force,
    removes the uncommitted directory (never loads it), continues from step 3, commits step 6 anew and
    leaves no lease behind."""
    run = tmp_path / "run"
    proc = spawn("start", *start_args(run, steps=9, every=3), *SMALL, faults="commit_delay@6=120")
    step6 = run / "checkpoints" / "step-000006"
    wait_for(lambda: (step6 / "state.pt").exists(), proc)
    r = run_cli("resume", str(run))
    assert r.returncode == ExitCode.LEASE_HELD == 10
    assert "is being written by" in r.stderr and f"pid {proc.pid}" in r.stderr
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (step6 / "manifest.json").exists()

    listed = json.loads(invoke("checkpoints", str(run), "--format", "json").stdout)
    assert [(c["step"], c["committed"], c["usable"]) for c in listed] == [(3, True, True), (6, False, False)]
    assert "no manifest" in listed[1]["problem"]

    r = run_cli("resume", str(run))  # same host, owner gone: taken over without --force
    assert r.returncode == 0, r.stderr
    assert "continuing from step 3" in r.stderr
    events = events_of(run)
    assert {"event": "uncommitted_removed", "steps": [6]}.items() <= [
        e for e in events if e["event"] == "uncommitted_removed"
    ][0].items()
    taken = [e for e in events if e["event"] == "lease_taken_over"]
    assert taken and taken[0]["previous"]["pid"] == proc.pid
    assert [r["step"] for r in metrics_of(run)] == list(range(1, 10))
    assert (step6 / "manifest.json").exists()  # re-made, committed, by the resumed run
    assert not (run / "lease.json").exists()


def test_sigterm_snapshots_and_exits_resume_me(tmp_path):
    run = tmp_path / "run"
    proc = spawn("start", *start_args(run, steps=6), *SMALL, faults="sleep@4=120")
    wait_for(has_step(run, 4), proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.PREEMPTED == 75, err
    assert "stopped by SIGTERM after step 4; snapshot of step 4 committed" in err
    assert f"rlctl resume {run} --from latest" in err
    kinds = [e["event"] for e in events_of(run)]
    assert kinds[-2:] == ["snapshot_committed", "preempted"]

    r = run_cli("resume", str(run), "--from", "latest")
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in metrics_of(run)] == list(range(1, 7))
    assert not (run / "metrics.abandoned.jsonl").exists()  # nothing was after the snapshot
    # idempotent: resuming a complete run is a no-op that succeeds
    r = run_cli("resume", str(run), "--from", "latest")
    assert r.returncode == 0 and "already complete" in r.stderr
    assert len(metrics_of(run)) == 6


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An uninterrupted 6-step run with a snapshot every 2 steps; each test that changes it works on a copy."""
    run = tmp_path_factory.mktemp("finished") / "run"
    r = invoke("start", *start_args(run, steps=6, every=2), *SMALL, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return run


def copy_of(run, tmp_path):
    """A copy of the finished run ``run`` (a run directory is self-contained: test_copied_run.py)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_corrupt_and_missing_snapshots(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    blob = run / "checkpoints" / "step-000006" / "state.pt"
    data = bytearray(blob.read_bytes())
    data[-20] ^= 0xFF
    blob.write_bytes(bytes(data))  # same size, one byte flipped

    listed = json.loads(invoke("checkpoints", str(run), "--format", "json", "--verify").stdout)
    assert listed[-1]["problem"] == "file state.pt does not match its sha256 (corrupt)"
    table = invoke("checkpoints", str(run)).stdout
    assert "step" in table and "committed" in table and "MiB" in table

    r = invoke("resume", str(run), "--from", "step-6", "--set", "trainer.total_steps=8")
    assert r.returncode == ExitCode.SNAPSHOT == 11
    assert "snapshot step-000006 is not usable: file state.pt does not match its sha256 (corrupt)" in r.stderr

    (run / "checkpoints" / "step-000002" / "manifest.json").unlink()
    listed = json.loads(invoke("checkpoints", str(run), "--format", "json").stdout)
    assert listed[0]["problem"] == "no manifest: never committed (interrupted or in progress)"
    r = invoke("resume", str(run), "--from", "step-2")  # an uncommitted directory is removed, never loaded
    assert r.returncode == 11 and "no snapshot of step 2" in r.stderr and "usable steps: 4, 6" in r.stderr
    assert not (run / "checkpoints" / "step-000002").exists()

    r = invoke("resume", str(run), "--from", "latest", "--set", "trainer.total_steps=8")
    assert r.returncode == 0, r.stderr
    assert "warning: snapshot step-000006 is not usable" in r.stderr and "continuing from step 4" in r.stderr
    assert [row["step"] for row in metrics_of(run)] == list(range(1, 9))
    resume = [e for e in events_of(run) if e["event"] == "resume"][-1]
    assert resume["changes"] == {"trainer.total_steps": {"from": 6, "to": 8}}


def test_resume_set_only_safe_keys_and_lr_change_is_applied(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    r = invoke("resume", str(run), "--set", "model.builtin.num_layers=4")
    assert r.returncode == ExitCode.CONFIG and "'model.builtin.num_layers' cannot change on resume" in r.stderr
    r = invoke("resume", str(run), "--set", "trainer.total_steps=8", "--set", "actor.lr=5e-4")
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert [row["actor/lr"] for row in rows] == [2e-3] * 6 + [5e-4] * 2  # the demo's lr, then the new one
    assert "lr: 0.0005" in (run / "config.yaml").read_text()

    # export consolidates the weights of the default stage (2, trained at stage 0 on one rank) into a
    # Hugging Face directory, bit for bit
    out = tmp_path / "hf"
    r = run_cli("export", str(run), str(out))
    assert r.returncode == 0 and r.stdout == f"{out}\n", r.stderr
    assert hf_weights_sha256(out) == completed_hash(run)


def test_resume_of_something_that_is_not_a_run(tmp_path):
    r = invoke("resume", str(tmp_path))
    assert r.returncode == ExitCode.CONFIG and "is not an rlctl run directory" in r.stderr


def test_run_and_snapshots_on_s3(tmp_path, s3_env):
    env, opts = s3_env
    url = "s3://rlctl-runs/exp/run1"
    proc = spawn("start", *start_args(url, steps=6, every=2), *SMALL, env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    listed = run_cli("checkpoints", url, "--format", "json", env=env)
    assert [c["step"] for c in json.loads(listed.stdout)] == [2, 4, 6], listed.stderr

    proc = spawn("resume", url, "--from", "step-2", env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    import s3fs

    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    events = [orjson.loads(line) for line in fs.cat(f"{url}/events.jsonl").splitlines()]
    hashes = [e["weights_sha256"] for e in events if e["event"] == "completed"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    steps = [orjson.loads(line)["step"] for line in fs.cat(f"{url}/metrics.jsonl").splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert fs.exists(f"{url}/metrics.abandoned.jsonl") and not fs.exists(f"{url}/lease.json")


@pytest.mark.parametrize("protocol", ["gs", "az"])
def test_run_and_snapshots_on_gcs_and_azure(protocol, request):
    """A run and its snapshots on GCS and on Azure Blob (real servers on loopback): every event and metric
    row kept (gcsfs cannot append: rlctl writes the object back whole), a resume from a snapshot ending
    where the run ended."""
    import fsspec

    env, opts = request.getfixturevalue({"gs": "gcs_env", "az": "azure_env"}[protocol])
    url = f"{protocol}://rlctl-runs/exp/run1"
    proc = spawn("start", *start_args(url, steps=4, every=2), *SMALL, env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    proc = spawn("resume", url, "--from", "step-2", env=env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    fs = fsspec.filesystem(protocol, **opts, skip_instance_cache=True)
    events = [orjson.loads(line) for line in fs.cat(f"{url}/events.jsonl").splitlines()]
    assert [e["event"] for e in events][:2] == ["start", "snapshot_committed"] and "resume" in [
        e["event"] for e in events
    ]
    hashes = [e["weights_sha256"] for e in events if e["event"] == "completed"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    steps = [orjson.loads(line)["step"] for line in fs.cat(f"{url}/metrics.jsonl").splitlines()]
    assert steps == [1, 2, 3, 4]
    assert not fs.exists(f"{url}/lease.json")
    listed = run_cli("checkpoints", url, "--format", "json", env=env)
    assert [c["step"] for c in json.loads(listed.stdout)] == [2, 4], listed.stderr
