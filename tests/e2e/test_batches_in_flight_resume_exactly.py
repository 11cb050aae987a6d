"""rollout.mode one_step_off and async end to end through the CLI: a batch trains one update (async: up to
max_staleness) after the weights that sampled it, the batches in flight are part of every snapshot (a
SIGKILL while they are generated resumes bit for bit), and a rollback drops them, counted, and completes
the run."""

import pytest

from helpers import (
    REPO,
    SMALL,
    completed_hash,
    drills,
    events_of,
    invoke,
    kill_and_resume,
    metrics_of,
    stable,
    start_args,
)

COMMON = [*SMALL, "--set", "trainer.total_steps=6", "--set", "checkpoint.every=3"]
OFF = [*COMMON, "--set", "rollout.mode=one_step_off"]
ASYNC = [*COMMON, "--set", "rollout.mode=async", "--set", "rollout.max_staleness=2"]
ZERO3 = ["--set", "actor.zero_stage=3"]
DYNAMIC = ["--set", "algorithm.dynamic_sampling.enabled=true", "--set", "algorithm.dynamic_sampling.max_gen_batches=3"]


def test_one_step_off_starts_as_sync_and_then_trains_on_older_weights(tmp_path):
    ref, sync = tmp_path / "ref", tmp_path / "sync"
    assert invoke("start", *start_args(ref), *OFF, cwd=REPO).returncode == 0
    assert invoke("start", *start_args(sync), *COMMON, cwd=REPO).returncode == 0
    rows = metrics_of(ref)
    same = {k for k in stable(rows)[0] if not k.startswith("rollout/staleness")}
    first = [{k: r[k] for k in same} for r in (stable(rows)[0], stable(metrics_of(sync))[0])]
    assert first[0] == first[1]  # step 1: both sampled by the initial weights and trained alike
    # later, the weights that sampled a batch are an update older than the actor's: their log-probs differ
    assert max(r["rollout/logprob_diff"] for r in rows) > 1e-2
    assert max(r["rollout/logprob_diff"] for r in metrics_of(sync)) < 1e-5
    # inspect and --check say the mode and how stale the last batch was (sync runs say only the mode)
    assert (
        f"OK {ref} completed at step 6/6 (one_step_off, staleness 1)" in invoke("inspect", str(ref), "--check").stdout
    )
    assert "rollout    one_step_off on hf, staleness 1 at the last step" in invoke("inspect", str(ref)).stdout
    assert f"OK {sync} completed at step 6/6\n" == invoke("inspect", str(sync), "--check").stdout
    assert "rollout    sync on hf\n" in invoke("inspect", str(sync)).stdout


@pytest.mark.parametrize(
    ("args", "staleness"),
    [(OFF, [0, 1, 1, 1, 1, 1]), (ASYNC, [0, 1, 2, 2, 2, 2]), ([*OFF, *ZERO3], [0, 1, 1, 1, 1, 1])],
    ids=["one_step_off", "async2", "one_step_off-zero3"],
)
def test_a_sigkill_while_batches_are_generated_ahead_resumes_exactly(tmp_path, args, staleness):
    """Killed after step 4, while the next batches are generated; snapshot 3 holds the batches made
    during step 3 (one_step_off: step 4's; async 2: steps 4 and 5). Under ZeRO-3 a plain model generates,
    its weights the actor's gathered shards."""
    ref = tmp_path / "ref"
    assert invoke("start", *start_args(ref), *args, cwd=REPO).returncode == 0
    rows = metrics_of(ref)
    assert [r["rollout/staleness/max"] for r in rows] == staleness
    assert rows[0]["rollout/logprob_diff"] < 1e-5  # the generator's copy holds the weights step 1 trains
    run = tmp_path / "killed"
    r = kill_and_resume(run, args, 4)
    assert "continuing from step 3" in r.stderr
    assert completed_hash(run) == completed_hash(ref)
    assert stable(metrics_of(run)) == stable(rows)


def test_a_rollback_drops_the_batch_in_flight_and_skips_the_offending_prompts(tmp_path):
    run = tmp_path / "nan"
    faults = "nan_log_prob@5"
    r = invoke("start", *start_args(run), *OFF, "--set", "policies=[policies/default.yaml]", *drills(faults), cwd=REPO)
    assert r.returncode == 0, r.stderr
    (back,) = events_of(run, "rollback")
    assert back["from_step"] == 5 and back["to_step"] == 3
    assert back["dropped_trajectories"] == 16  # step 6's batch, in flight, sampled by undone weights
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3, 4, 5, 6]
    assert metrics_of(run)[3]["rollout/staleness/mean"] == 1.0  # snapshot 3's batch of step 4 trained as sampled


def test_dynamic_sampling_generates_ahead_and_resumes_exactly(tmp_path):
    """one_step_off with dynamic sampling: the batch made ahead draws more prompts as its rounds go, so a
    snapshot first waits for it (the cursor it holds is the one after its last round). Killed after step 2
    and resumed: bit for bit the uninterrupted run. (Over several ranks the generators agree on their
    rounds in a process group of their own: tests/unit/test_dist_groups.py.)"""
    args = [*OFF, *DYNAMIC, "--set", "trainer.total_steps=3", "--set", "checkpoint.every=1"]
    ref = tmp_path / "ref"
    assert invoke("start", *start_args(ref), *args, cwd=REPO).returncode == 0
    rows = metrics_of(ref)
    assert [r["rollout/staleness/max"] for r in rows] == [0, 1, 1]
    assert max(r["dynamic_sampling/rounds"] for r in rows[1:]) > 1  # a batch made ahead took several rounds
    run = tmp_path / "killed"
    r = kill_and_resume(run, args, 2)
    # snapshot 1 or 2 (its asynchronous commit may end before the kill), holding the next step's batch
    assert "continuing from step 1" in r.stderr or "continuing from step 2" in r.stderr
    assert completed_hash(run) == completed_hash(ref)
    assert stable(metrics_of(run)) == stable(rows)
