"""Validation, best snapshots and trackers through the real CLI: a run that validates, whose validation
score drops (a drill), rolls back to its best snapshot; its trackers show one value per step; then
`resume --from best`, `export --step best` and `checkpoints` find that snapshot."""

import json
import math

import pytest

from helpers import REPO, events_of, invoke, metrics_of, mlflow_runs, start_args, steps_of, tb_scalars, wandb_run

VAL = "val/score/mean"
ALL = ("tensorboard", "wandb", "mlflow")


def drop_config(tmp_path, loggers=()):
    cfg = {
        "trainer": {
            "total_steps": 8,
            "prompts_per_step": 4,
            "val_every": 2,
            "val_before_train": True,
            "loggers": list(loggers),
        },
        "algorithm": {"group_size": 4},
        "rollout": {"max_new_tokens": 6},
        "actor": {"lr": 2e-3},
        "data": {"builtin_val_size": 16},
        "checkpoint": {"every": 2, "keep_last": 1, "keep_best": {"metric": VAL, "mode": "max", "k": 1}},
        # step 6's validation reads -1.0: far below the best so far (once per run, so the replay is clean)
        "faults": f"metric@6={VAL}:-1.0",
        "policies": [
            {
                "rules": [
                    {
                        "name": "val-drop",
                        "trigger": {"kind": "drop", "metric": VAL, "amount": 0.5},
                        "actions": [{"type": "rollback", "to": "best"}],
                        "max_triggers": 2,
                    }
                ]
            }
        ],
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    return str(path)


def best_step(rows, until):
    """The step of the highest validation score at or before ``until`` (the earliest of a tie)."""
    scored = [(r[VAL], -r["step"]) for r in rows if VAL in r and r["step"] <= until]
    return -max(scored)[1]


def quiet_trackers(tmp_path):
    """W&B and MLflow kept inside the test's directory, offline."""
    home = tmp_path / "tracker-home"
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        **{var: str(home / var.lower()) for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")},
    }


def series(rows, key):
    return [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def test_a_validation_drop_rolls_back_to_the_best_snapshot_which_resume_and_export_find(tmp_path):
    run, env = tmp_path / "run", quiet_trackers(tmp_path)
    r = invoke("start", *start_args(run, config=drop_config(tmp_path, ALL)), env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert [row["step"] for row in rows] == list(range(9))  # step 0: the validation before training
    assert [row["step"] for row in rows if VAL in row] == [0, 2, 4, 6, 8]
    assert all(math.isfinite(row[VAL]) and f"{VAL.rsplit('/', 1)[0]}/best@1" in row for row in rows if VAL in row)

    [firing] = [e for e in events_of(run) if e["event"] == "policy"]
    assert (firing["rule"], firing["step"], firing["value"]) == ("val-drop", 6, -1.0)
    [rollback] = [e for e in events_of(run) if e["event"] == "rollback"]
    assert (rollback["from_step"], rollback["to_step"]) == (6, best_step(rows, 4))
    assert "rollbacks   1:" in r.stderr and f"step 6: rule val-drop -> back to step {rollback['to_step']}" in r.stderr

    listed = invoke("checkpoints", str(run), "--format", "json")
    assert listed.returncode == 0, listed.stderr
    snaps = [s for s in json.loads(listed.stdout) if s["usable"]]
    assert all(VAL in s for s in snaps)
    best = max(snaps, key=lambda s: (s[VAL], -s["step"]))
    assert best["step"] == best_step(rows, 8)  # retention kept it (keep_last is 1)

    out = tmp_path / "exported"
    r = invoke("export", str(run), str(out), "--step", "best")
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()

    r = invoke("resume", str(run), "--from", "best", "--set", "trainer.total_steps=9", env=env)
    assert r.returncode == 0, r.stderr
    resume = [e for e in events_of(run) if e["event"] == "resume"][-1]
    assert (resume["from"], resume["step"]) == ("best", best["step"])
    rows = metrics_of(run)
    assert [row["step"] for row in rows] == list(range(10))
    trackers_show_the_run_as_metrics_jsonl_does(run, rows, rollback["to_step"])


def trackers_show_the_run_as_metrics_jsonl_does(run, rows, rolled_back_to):
    """After a rollback and a resume from an earlier snapshot (with a change; the config's drill fired
    once in the run, so the resumed steps are clean), each tracker holds one value per step, the one
    metrics.jsonl holds: TensorBoard purged the abandoned steps; W&B and MLflow are on their third branch,
    the kept history replayed into it."""
    for key in ("critic/score/mean", VAL):
        want = series(rows, key)
        tb = tb_scalars(run)[key]
        assert [s for s, _ in tb] == [s for s, _ in want]
        assert [v for _, v in tb] == pytest.approx([v for _, v in want], rel=1e-6)  # float32 event files
        branch = json.loads((run / "trackers.json").read_text())
        history, _, _ = wandb_run(run, branch["wandb"]["run_id"])
        assert series([{"step": s, **h} for s, h in sorted(history.items())], key) == want
        client, runs = mlflow_runs(run, "run")
        assert runs[-1].info.run_id == branch["mlflow"]["run_id"] and len(runs) == branch["mlflow"]["branch"] == 3
        assert steps_of(client, branch["mlflow"]["run_id"], key) == want
    assert (rolled_back_to, 1.0) in tb_scalars(run)["events/rollback"]
