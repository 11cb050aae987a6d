"""The `!!!!` collapse on a real run: the degenerate drill makes every response of one step a single token
repeated, the ready-made degeneration policy sees response/degenerate_frac, rolls back, skips the prompts,
lowers the learning rate, and the run completes healthy (`rlctl start` in this process, real DeepSpeed)."""

import json

from helpers import REPO, drills, events_of, invoke, metrics_of, start_args


def test_degenerate_drill_fires_the_degeneration_policy_and_the_run_recovers(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        json.dumps(
            {
                "trainer": {"total_steps": 7, "prompts_per_step": 4},
                "algorithm": {"group_size": 4},
                "rollout": {"max_new_tokens": 10},
                "checkpoint": {"every": 2},
                "actor": {"lr": 2e-3},
                "policies": ["default", "degeneration"],  # their rule names do not clash
            }
        )
    )
    run = tmp_path / "run"
    r = invoke("start", *start_args(run, config=cfg), *drills("degenerate@4"), cwd=REPO)
    assert r.returncode == 0, r.stderr
    events = events_of(run)
    (fired,) = [e for e in events if e["event"] == "policy"]
    assert (fired["rule"], fired["step"], fired["value"]) == ("degenerate-output", 4, 1.0)
    (rollback,) = [e for e in events if e["event"] == "rollback"]
    assert (rollback["from_step"], rollback["to_step"]) == (4, 2)
    (skip,) = [e for e in events if e["event"] == "skip"]
    assert len(skip["prompts"]) == 4
    (adjust,) = [e for e in events if e["event"] == "adjust"]
    assert adjust["changes"] == {"actor.lr": {"from": 2e-3, "to": 1e-3}}
    assert [e for e in events if e["event"] == "completed"]

    (bad,) = [a for a in metrics_of(run, "metrics.abandoned.jsonl") if a["step"] == 4]
    assert bad["response/degenerate_frac"] == 1.0 and bad["response/repetition/mean"] == 1.0
    assert bad["response/longest_run/max"] == 1.0 and bad["response_length/mean"] == 10
    rows = metrics_of(run)
    assert [row["step"] for row in rows] == list(range(1, 8))
    assert all(row["response/degenerate_frac"] <= 0.5 for row in rows)  # the replayed step 4 too
    assert [row["actor/lr"] for row in rows] == [2e-3] * 2 + [1e-3] * 5
    assert all(row["actor/ppo_ratio/max"] == 1.0 for row in rows)  # on-policy: the update's own forward
    assert all(-30 < row["actor/log_prob/min"] < 0 for row in rows)
