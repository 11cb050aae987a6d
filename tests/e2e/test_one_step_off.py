"""rollout.mode one_step_off end to end through the CLI: a batch trains one update after the weights that
sampled it, the batch in flight is part of every snapshot (a SIGKILL while it is generated resumes bit for
bit), and a rollback drops it, counted, and completes the run."""

from helpers import SMALL, completed_hash, events_of, kill_and_resume, metrics_of, stable, start_here

COMMON = [*SMALL, "--set", "trainer.total_steps=6", "--set", "checkpoint.every=3"]
OFF = [*COMMON, "--set", "rollout.mode=one_step_off"]


def test_one_step_off_trains_a_step_behind_and_a_sigkill_mid_generation_resumes_exactly(tmp_path):
    ref = tmp_path / "ref"
    assert start_here(ref, *OFF).returncode == 0
    rows = metrics_of(ref)
    assert [r["rollout/staleness/mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    sync = tmp_path / "sync"
    assert start_here(sync, *COMMON).returncode == 0
    same = {k for k in stable(rows)[0] if not k.startswith("rollout/staleness")}
    first = [{k: r[k] for k in same} for r in (stable(rows)[0], stable(metrics_of(sync))[0])]
    assert first[0] == first[1]  # step 1: both sampled by the initial weights and trained alike
    # later, the weights that sampled a batch are an update older than the actor's: their log-probs differ
    assert max(r["rollout/logprob_diff"] for r in rows) > 1e-2
    assert max(r["rollout/logprob_diff"] for r in metrics_of(sync)) < 1e-5

    run = tmp_path / "killed"  # killed after step 4, while step 5's batch was generated; snapshot 3 holds step 4's
    r = kill_and_resume(run, OFF, 4)
    assert "continuing from step 3" in r.stderr
    assert completed_hash(run) == completed_hash(ref)
    assert stable(metrics_of(run)) == stable(rows)


def test_a_rollback_drops_the_batch_in_flight_and_skips_the_offending_prompts(tmp_path):
    run = tmp_path / "nan"
    faults = "nan_log_prob@5"
    r = start_here(run, *OFF, "--set", "policies=[policies/default.yaml]", faults=faults)
    assert r.returncode == 0, r.stderr
    (back,) = events_of(run, "rollback")
    assert back["from_step"] == 5 and back["to_step"] == 3
    assert back["dropped_trajectories"] == 16  # step 6's batch, in flight, sampled by undone weights
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3, 4, 5, 6]
    assert metrics_of(run)[3]["rollout/staleness/mean"] == 1.0  # snapshot 3's batch of step 4 trained as sampled
