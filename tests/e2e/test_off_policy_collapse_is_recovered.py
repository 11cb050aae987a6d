"""The cheapest collapse of benchmarks/collapse_zoo.py under the ready-made default: caught and recovered.

The zoo's off-policy run (the built-in task, async rollout 4 steps ahead at lr 1e-2, no drill) drifts on
its own: the rollout engine's log-probs leave the actor's (rollout/logprob_diff above 0.5 from step 6,
19 at step 70) and the answers collapse into one repeated token. Its first 20 steps under `default`:
stale-drift sees the gap on steps 6-8, rolls back to step 0 and halves the learning rate, and the run
trains on to its end with the gap under the limit (docs/policies.md, "Real collapses: the zoo").
"""

from __future__ import annotations

from helpers import REPO, events_of, invoke, metrics_of, start_args

OFF_POLICY = {
    "name": "zoo-off-policy",
    "seed": 0,
    "trainer": {"total_steps": 20, "prompts_per_step": 16},
    "algorithm": {"group_size": 8},
    "actor": {"lr": 1.0e-2, "zero_stage": 2},
    "rollout": {"max_new_tokens": 8, "mode": "async", "max_staleness": 4},
    "checkpoint": {"every": 10, "keep_last": 4},
    "policies": ["default"],
}


def test_the_off_policy_collapse_is_caught_by_default_and_recovered(tmp_path):
    run = tmp_path / "run"
    r = invoke("start", *start_args(run, config=OFF_POLICY), cwd=REPO)
    assert r.returncode == 0, r.stderr

    first = events_of(run, "policy")[0]
    assert (first["rule"], first["step"]) == ("stale-drift", 8)
    assert [a["type"] for a in first["actions"]] == ["rollback", "adjust"]
    (back,) = events_of(run, "rollback")
    assert (back["from_step"], back["to_step"]) == (8, 0)

    abandoned = metrics_of(run, "metrics.abandoned.jsonl")  # the drift as it began, by itself
    assert [row["step"] for row in abandoned] == list(range(1, 9))
    assert all(row["rollout/logprob_diff"] > 0.5 for row in abandoned[-3:])

    kept = metrics_of(run)
    assert [row["step"] for row in kept] == list(range(1, 21))
    assert all(row["actor/lr"] == 5.0e-3 for row in kept)
    assert max(row["rollout/logprob_diff"] for row in kept) < 0.5
