"""rollout.top_p/top_k/stop through the real CLI on the HF backend: a run killed with SIGKILL after a
snapshot and resumed ends bit-identical to an uninterrupted one (the truncated sampler regenerates the
same rollouts), and the rollout's log-probs still equal the actor's (both untruncated)."""

import signal

import yaml

from helpers import (
    REPO,
    SMALL,
    completed_hash,
    has_step,
    invoke,
    kill_and_resume,
    metrics_of,
    run_cli,
    settled_before,
    spawn,
    stable,
    start_args,
    wait_for,
)


def test_truncated_sampling_resumes_exactly(tmp_path):
    common = [
        *SMALL,
        "--set",
        "trainer.total_steps=6",
        "--set",
        "checkpoint.every=2",
        "--set",
        "rollout.top_p=0.9",
        "--set",
        "rollout.top_k=20",
        "--set",
        'rollout.stop=["e", "a"]',
    ]
    ref = tmp_path / "ref"
    r = invoke("start", *start_args(ref), *common, cwd=REPO)
    assert r.returncode == 0, r.stderr

    run = tmp_path / "killed"
    r = kill_and_resume(run, common, 5)
    assert "continuing from step 4" in r.stderr

    assert completed_hash(run) == completed_hash(ref)
    rows = metrics_of(run)
    assert stable(rows) == stable(metrics_of(ref))
    assert [row["step"] for row in rows] == list(range(1, 7))
    diffs = [row["rollout/logprob_diff"] for row in rows if "rollout/logprob_diff" in row]
    assert diffs and max(diffs) < 1e-4, diffs


def test_a_run_started_before_the_counter_sampler_resumes_with_its_generator_exactly(tmp_path):
    """A run directory whose config.yaml has no rollout.sampler (written before the key existed, by an
    rlctl that sampled with one CPU generator per sequence) resumes with that sampler: killed after step 4
    and resumed from step 3, it ends bit-identical to an uninterrupted generator run. Had the resume taken
    the counter sampler (new runs' default), steps 4 to 6 would have sampled other completions."""
    common = [*SMALL, "--set", "trainer.total_steps=6", "--set", "checkpoint.every=3"]
    ref = tmp_path / "ref"
    assert invoke("start", *start_args(ref), *common, "--set", "rollout.sampler=generator", cwd=REPO).returncode == 0

    run = tmp_path / "older"
    proc = spawn("start", "--run-dir", str(run), *common, "--set", "rollout.sampler=generator", faults="sleep@4=120")
    wait_for(lambda: has_step(run, 4)() and settled_before(run, 4), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    config = yaml.safe_load((run / "config.yaml").read_text())
    del config["rollout"]["sampler"]  # as an older rlctl wrote it
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    r = run_cli("resume", str(run), "--from", "latest")
    assert r.returncode == 0, r.stderr
    assert "continuing from step 3" in r.stderr
    assert completed_hash(run) == completed_hash(ref)
    assert stable(metrics_of(run)) == stable(metrics_of(ref))
