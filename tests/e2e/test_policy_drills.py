"""Fault drills: rollback policies acting on real runs (real DeepSpeed; `rlctl start` in this process,
its drills in the run's config, or the installed `rlctl` in a subprocess with RLCTL_FAULTS where the run
is killed)."""

import json
import math
import signal
import textwrap

from rlctl.errors import ExitCode

from helpers import REPO, SMALL, drills, events_of, invoke, metrics_of, run_cli, spawn, start_args, wait_for


def policy_config(tmp_path, rules, every=2, steps=8):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        json.dumps(
            {
                "trainer": {"total_steps": steps},
                "checkpoint": {"every": every},
                "actor": {"lr": 2e-3},
                "policies": [{"rules": rules}],
            }
        )
    )
    return str(cfg)


def test_nan_log_prob_rolls_back_to_last_good_and_completes(tmp_path):
    run = tmp_path / "run"
    r = invoke(
        "start",
        *start_args(run, steps=10, every=3),
        *SMALL,
        "--set",
        "policies=[policies/default.yaml]",
        *drills("nan_log_prob@5"),
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    (fired,) = events_of(run, "policy")
    assert fired["rule"] == "nonfinite" and fired["step"] == 5 and math.isnan(fired["value"])
    (rollback,) = events_of(run, "rollback")
    assert (rollback["from_step"], rollback["to_step"], rollback["abandoned_metric_rows"]) == (5, 3, 2)
    (skip,) = events_of(run, "skip")
    assert len(skip["prompts"]) == 4
    assert [row["step"] for row in metrics_of(run)] == list(range(1, 11))
    assert all(row["actor/nonfinite/log_prob"] == 0 for row in metrics_of(run))
    abandoned = metrics_of(run, "metrics.abandoned.jsonl")
    assert [(a["step"], a["abandoned"]["event"]) for a in abandoned] == [(4, "rollback"), (5, "rollback")]
    assert abandoned[1]["actor/nonfinite/log_prob"] == 1
    committed = [e["step"] for e in events_of(run, "snapshot_committed")]
    assert 5 not in committed and committed[-1] == 10  # the failed step was never snapshotted
    assert json.loads((run / "policy_state.json").read_text())["skipped_prompts"] == sorted(skip["prompts"])
    assert events_of(run, "completed")


def test_kl_spike_adjust_lowers_lr_and_it_survives_kill_and_resume(tmp_path):
    rules = [
        {
            "name": "kl",
            "when": "actor/ppo_kl > 1.0",
            "actions": [{"type": "rollback"}, {"type": "adjust", "multiply": {"actor.lr": 0.5}}],
        }
    ]
    cfg = policy_config(tmp_path, rules, every=4, steps=10)
    run = tmp_path / "run"
    proc = spawn("start", *start_args(run, config=cfg), *SMALL, faults="metric@5=actor/ppo_kl:5.0,sleep@6=120")
    wait_for(lambda: (run / "metrics.jsonl").exists() and any(r["step"] == 6 for r in metrics_of(run)), proc)
    proc.send_signal(signal.SIGKILL)  # after the adjustment, before any snapshot that holds it
    proc.wait()
    (adjust,) = events_of(run, "adjust")
    assert adjust["changes"] == {"actor.lr": {"from": 2e-3, "to": 1e-3}}
    assert events_of(run, "rollback")[0]["to_step"] == 4
    assert "lr: 0.001" in (run / "config.yaml").read_text()

    r = run_cli("resume", str(run))  # the latest snapshot is step 4, taken before the adjustment
    assert r.returncode == 0, r.stderr
    lrs = {row["step"]: row["actor/lr"] for row in metrics_of(run)}
    assert [lrs[s] for s in range(1, 5)] == [2e-3] * 4
    assert [lrs[s] for s in range(5, 11)] == [1e-3] * 6  # lowered, after the rollback and after the resume
    assert len(events_of(run, "policy")) == 1  # the drill fired once; the trigger count came back with the resume


def test_max_triggers_escalates_to_halt(tmp_path):
    rules = [
        {
            "name": "kl",
            "when": "actor/ppo_kl > 1.0",
            "actions": [{"type": "rollback"}],
            "max_triggers": 1,
            "then": "halt",
        }
    ]
    cfg = policy_config(tmp_path, rules, every=2, steps=8)
    run = tmp_path / "run"
    r = invoke(
        "start",
        *start_args(run, config=cfg),
        *SMALL,
        *drills("metric@3=actor/ppo_kl:5.0,metric@5=actor/ppo_kl:7.0"),
        cwd=REPO,
    )
    assert r.returncode == ExitCode.HALTED == 20, r.stderr
    assert "policy rule 'kl' halted the run at step 5" in r.stderr and "the last good snapshot is step 4" in r.stderr
    assert "Traceback" not in r.stderr
    fired = events_of(run, "policy")
    assert [(f["step"], f["escalated"]) for f in fired] == [(3, False), (5, True)]
    assert events_of(run, "halted")[0]["step"] == 5 and not events_of(run, "completed")
    committed = [e["step"] for e in events_of(run, "snapshot_committed")]
    assert 5 not in committed and max(committed) == 4
    assert not (run / "lease.json").exists()
    listed = json.loads(invoke("checkpoints", str(run), "--format", "json").stdout)
    assert all(c["good"] for c in listed)


def test_warn_only_policy_logs_and_changes_nothing(tmp_path):
    rules = [{"name": "kl-watch", "when": "actor/ppo_kl > 1.0", "actions": [{"type": "warn"}]}]
    cfg = policy_config(tmp_path, rules, every=2, steps=4)
    run = tmp_path / "run"
    r = invoke("start", *start_args(run, config=cfg), *SMALL, *drills("metric@3=actor/ppo_kl:5.0"), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert [f["step"] for f in events_of(run, "policy")] == [3]
    assert not events_of(run, "rollback") and not (run / "metrics.abandoned.jsonl").exists()
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3, 4]


def test_bad_policy_stops_before_anything_starts(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text(
        textwrap.dedent("""
        rules:
          - name: kl
            when: "actor/ppo_kl > 0.1"
            actions:
              - type: rollbak
    """)
    )
    r = invoke("start", *start_args(tmp_path / "run"), "--set", f"policies=[{bad}]", cwd=REPO)
    assert r.returncode == ExitCode.CONFIG
    assert "mine.yaml line 6" in r.stderr and "did you mean 'rollback'" in r.stderr
    assert not (tmp_path / "run").exists()
    r = invoke("start", *start_args(tmp_path / "run2"), "--set", "policies=[policies/default.yaml]", cwd=REPO)
    assert r.returncode == ExitCode.CONFIG and "'checkpoint.every' is 0" in r.stderr
    r = invoke("policy", "check", str(bad))
    assert r.returncode == ExitCode.CONFIG and "Error: invalid policy file" in r.stderr
    r = invoke("policy", "check", "policies/default.yaml", "policies/conservative.yaml", "policies/warn-only.yaml")
    assert r.returncode == 0 and "rule nonfinite" in r.stdout


def test_a_last_step_failing_an_adjust_only_rule_is_committed_but_not_good(tmp_path):
    """The run's final state is committed even when its last step failed a rule (exit 0 means on
    storage), as not good: `--from last-good` still goes before it, `--from latest` has nothing to do."""
    rules = [{"name": "kl", "when": "actor/ppo_kl > 1.0", "actions": [{"type": "adjust", "set": {"actor.lr": 1e-4}}]}]
    cfg = policy_config(tmp_path, rules, every=2, steps=4)
    run = tmp_path / "run"
    r = invoke("start", *start_args(run, config=cfg), *SMALL, *drills("metric@4=actor/ppo_kl:5.0"), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert [(e["step"], e["good"]) for e in events_of(run, "snapshot_committed")] == [(2, True), (4, False)]
    assert events_of(run, "adjust")[0]["changes"]["actor.lr"]["to"] == 1e-4
    r = invoke("resume", str(run))
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr
