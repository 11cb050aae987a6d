"""Knobs on real runs (the installed `rlctl`, real DeepSpeed, the tiny built-in model): a KL warm-up
schedule shows in `actor/kl_coef` step by step; an expression trigger fires a bounded `add` twice, and a
SIGKILL after a firing that no snapshot holds, then a resume, re-run that step bit for bit: the knob is
the snapshot's again, and the firing moves it once more, never compounding."""

import json
import signal

import pytest
import yaml

from helpers import REPO, SMALL, events_of, invoke, metrics_of, run_cli, spawn, stable, start_args, wait_for


def test_a_kl_warm_up_and_an_lr_ramp_show_in_each_steps_row(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        json.dumps(
            {
                "trainer": {"total_steps": 10},
                "algorithm": {"kl_coef": {"schedule": [{"until": 0.4, "value": 0.0}, {"value": 0.001}]}},
                "actor": {
                    "lr": {
                        "schedule": [{"until": 1, "value": 1e-3}, {"until": 3, "value": 3e-3}],
                        "mode": "linear",
                        "unit": "step",
                    }
                },
            }
        )
    )
    run = tmp_path / "run"
    r = invoke("start", *start_args(run, config=cfg), *SMALL, cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert [row["actor/kl_coef"] for row in rows] == [0.0] * 4 + [0.001] * 6  # 0 for the first 40%
    assert [row["actor/lr"] for row in rows] == pytest.approx([1e-3, 2e-3] + [3e-3] * 8, rel=1e-12)
    # the reference was loaded from the start (the KL is measured while its coefficient is still 0)
    assert any(row["actor/kl_loss"] > 0 for row in rows[:4])
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["algorithm"]["kl_coef"], saved["actor"]["lr"]) == (0.001, 3e-3)  # the values at the last step
    assert saved["schedules"]["algorithm.kl_coef"]["schedule"] == [
        {"until": 0.4, "value": 0.0},
        {"until": None, "value": 0.001},
    ]


def test_an_expression_trigger_and_a_bounded_add_survive_kill_and_resume(tmp_path):
    rules = [
        {
            "name": "kl-up",
            "when": "actor/ppo_kl * 10 > 1",
            "actions": [{"type": "adjust", "add": {"algorithm.kl_coef": 0.01}, "max": {"algorithm.kl_coef": 0.015}}],
        }
    ]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        json.dumps({"trainer": {"total_steps": 8}, "checkpoint": {"every": 2}, "policies": [{"rules": rules}]})
    )
    run = tmp_path / "run"
    # step 5 fails the rule, so no drill runs after it (nor a snapshot); step 6 is snapshotted, but its
    # commit is held while the run sleeps: the kill comes with step 4 the newest committed snapshot
    drills = "metric@2=actor/ppo_kl:5.0,metric@5=actor/ppo_kl:5.0,commit_delay@6=120,sleep@6=120"
    proc = spawn("start", *start_args(run, config=cfg), *SMALL, faults=drills)

    def after_step_6_with_snapshot_4():
        rows = (run / "metrics.jsonl").exists() and metrics_of(run)
        return (
            bool(rows) and rows[-1]["step"] == 6 and any(e["step"] == 4 for e in events_of(run, "snapshot_committed"))
        )

    wait_for(after_step_6_with_snapshot_4, proc)
    proc.send_signal(signal.SIGKILL)  # after the firing of step 5, which the newest committed snapshot predates
    proc.wait()
    fired_at_5 = (5, {"algorithm.kl_coef": {"from": 0.01, "to": 0.015}})  # 0.02, held at the action's max
    adjusts = [(e["step"], e["changes"]) for e in events_of(run, "adjust")]
    assert adjusts == [(2, {"algorithm.kl_coef": {"from": 0.0, "to": 0.01}}), fired_at_5]
    assert yaml.safe_load((run / "config.yaml").read_text())["algorithm"]["kl_coef"] == 0.015
    before_kill = stable(metrics_of(run))

    r = run_cli("resume", str(run), env={"RLCTL_FAULTS": "metric@5=actor/ppo_kl:5.0"})  # step 5 re-runs its drill
    assert r.returncode == 0, r.stderr
    assert "continuing from step 4" in r.stderr
    rows = metrics_of(run)
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert [row["actor/kl_coef"] for row in rows] == [0.0, 0.0] + [0.01] * 3 + [0.015] * 3
    assert stable(rows)[:6] == before_kill  # steps 5-6 re-run from the snapshot of step 4: bit for bit
    abandoned = metrics_of(run, "metrics.abandoned.jsonl")
    assert [a["step"] for a in abandoned] == [5, 6] and stable(abandoned) == before_kill[4:]
    assert [f["step"] for f in events_of(run, "policy")] == [2, 5, 5]  # the drills' steps, step 5 once per run
    assert [(e["step"], e["changes"]) for e in events_of(run, "adjust")] == [*adjusts, fired_at_5]  # not from 0.015
    assert yaml.safe_load((run / "config.yaml").read_text())["algorithm"]["kl_coef"] == 0.015


def test_an_adjustment_of_an_adaptive_kl_coefficient_survives_the_rollback_of_the_same_verdict(tmp_path):
    """Rollback first, then adjust: the restore loads the snapshot's controller, and the adjustment
    applies to that (done the other way round, the restore would undo it)."""
    rules = [
        {
            "name": "kl",
            "when": "actor/ppo_kl > 1.0",
            "actions": [{"type": "rollback"}, {"type": "adjust", "multiply": {"algorithm.kl_coef": 0.5}}],
        }
    ]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        json.dumps(
            {
                "trainer": {"total_steps": 6},
                "checkpoint": {"every": 2},
                "algorithm": {"kl_coef": 0.05, "kl_ctrl": {"type": "adaptive", "target_kl": 0.01, "horizon": 100}},
                "policies": [{"rules": rules}],
            }
        )
    )
    run = tmp_path / "run"
    r = run_cli("start", *start_args(run, config=cfg), *SMALL, faults="metric@5=actor/ppo_kl:5.0")
    assert r.returncode == 0, r.stderr
    (rollback,) = events_of(run, "rollback")
    assert (rollback["from_step"], rollback["to_step"]) == (5, 4)
    (abandoned,) = [a for a in metrics_of(run, "metrics.abandoned.jsonl") if a["step"] == 5]
    snapshot_4 = abandoned["actor/kl_coef"]  # step 5 ran with the controller's value after step 4
    (adjust,) = events_of(run, "adjust")
    assert adjust["changes"] == {"algorithm.kl_coef": {"from": snapshot_4, "to": snapshot_4 * 0.5}}
    rows = {row["step"]: row for row in metrics_of(run)}
    assert rows[5]["actor/kl_coef"] == snapshot_4 * 0.5  # the re-run step 5 uses the adjusted coefficient
    assert yaml.safe_load((run / "config.yaml").read_text())["algorithm"]["kl_coef"] == snapshot_4 * 0.5
