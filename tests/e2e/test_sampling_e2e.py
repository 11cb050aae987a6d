"""rollout.top_p/top_k/stop through the real CLI on the HF backend: a run killed with SIGKILL after a
snapshot and resumed ends bit-identical to an uninterrupted one (the truncated sampler regenerates the
same rollouts), and the rollout's log-probs still equal the actor's (both untruncated)."""

from helpers import SMALL, completed_hash, kill_and_resume, metrics_of, stable, start_here


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
    r = start_here(ref, *common)
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
