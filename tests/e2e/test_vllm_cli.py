"""`rollout.backend: vllm` end to end through the CLI: real vLLM (the CPU build), real DeepSpeed ranks.

The rollout engine must sample from the actor's current weights: after every update and every restore.
`rollout/logprob_diff` (vLLM's log-probs of the sampled tokens against the actor's) shows it every
step, and the default policy halts a run whose sync is broken."""

import pytest

from rlctl.errors import ExitCode

from helpers import assert_steps_run_again_alike, events_of, metrics_of, run_cli, stable, start_args

pytest.importorskip("vllm")

COMMON = [
    "--set",
    "rollout.backend=vllm",
    "--set",
    "trainer.prompts_per_step=8",
    "--set",
    "algorithm.group_size=4",
    "--set",
    "rollout.max_new_tokens=10",
]


def test_two_ranks_with_vllm_stay_in_sync_and_a_restore_regenerates_exactly(tmp_path):
    run = tmp_path / "run"
    r = run_cli("start", *start_args(run, steps=4, every=2), "--nproc", "2", *COMMON)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{run}\n"
    rows = metrics_of(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["rollout/logprob_diff"] < 1e-4 for row in rows), [row["rollout/logprob_diff"] for row in rows]

    # back to step 2: the weights are restored and pushed into the engine, so steps 3-4 come out the same
    r = run_cli("resume", str(run), "--from", "step-2")
    assert r.returncode == 0, r.stderr
    abandoned = metrics_of(run, "metrics.abandoned.jsonl")
    assert [row["step"] for row in abandoned] == [3, 4]
    assert stable(metrics_of(run)[2:]) == stable(abandoned)


def test_one_step_off_with_vllm_on_two_ranks_samples_a_step_behind_and_resumes_exactly(tmp_path):
    """rollout.mode one_step_off on the vllm backend: each rank's engine, shared by the trainer's rollout and
    the one generating ahead, samples step N+1's batch while step N trains, by the weights step N started
    from (loaded into the engine as the batch starts). Step 1 is sampled by the weights it trains, the
    later ones an update behind; resumed from snapshot 2 (which holds step 3's batch), steps 3 and 4 and
    the final weights come out bit for bit."""
    run = tmp_path / "run"
    r = run_cli(
        "start", *start_args(run, steps=4, every=2), "--nproc", "2", *COMMON, "--set", "rollout.mode=one_step_off"
    )
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert [row["rollout/staleness/mean"] for row in rows] == [0.0, 1.0, 1.0, 1.0]
    assert rows[0]["rollout/logprob_diff"] < 1e-4  # the engine held the actor's weights
    r = run_cli("resume", str(run), "--from", "step-2")
    assert r.returncode == 0, r.stderr
    assert_steps_run_again_alike(run, [3, 4])


def test_a_broken_weight_sync_is_caught_by_the_default_policy(tmp_path):
    """The stale_rollout drill never pushes updated weights: vLLM keeps sampling from the initial
    policy, rollout/logprob_diff climbs, and default.yaml's rollout-sync rule halts the run (exit 20)."""
    run = tmp_path / "run"
    r = run_cli(
        "start",
        *start_args(run, steps=60, every=10),
        *COMMON,
        "--set",
        "actor.lr=3e-3",
        "--set",
        "policies=[policies/default.yaml]",
        faults="stale_rollout",
    )
    assert r.returncode == ExitCode.HALTED, r.stderr
    assert "policy rule 'rollout-sync' halted the run" in r.stderr
    diffs = [row["rollout/logprob_diff"] for row in metrics_of(run)]
    assert diffs[0] < 1e-4 and all(d > 0.5 for d in diffs[-3:]) and len(diffs) < 60
    halted = [e for e in events_of(run) if e["event"] == "halted"]
    assert halted and halted[-1]["rule"] == "rollout-sync"
