"""Snapshots that fail or cannot be read, end to end: the installed `rlctl` in subprocesses, real
DeepSpeed, a full disk from the `enospc` fault drill (rlctl/faults.py), hand-damaged run files.

A commit either happens or the user hears about it (exit 12, never `completed`); what cannot be read
is moved aside, never deleted, and a resume says why it skipped it; a resume takes the policy state
of the step it restores."""

import json
import signal

import torch

from rlctl.errors import ExitCode

from helpers import REPO, SMALL, events_of, invoke, metrics_of, run_cli, small_tmpfs, spawn, start_args, wait_for


def listed(run_dir):
    return json.loads(invoke("checkpoints", str(run_dir), "--format", "json").stdout)


def test_full_disk_fails_the_run_with_exit_12_and_resume_completes_it(tmp_path):
    run = tmp_path / "run"
    every = ["--set", "checkpoint.every=1"]
    r = run_cli("start", *start_args(run, steps=3), *SMALL, *every, faults="enospc@2")
    assert r.returncode == ExitCode.STORAGE == 12, r.stderr
    assert "Traceback" not in r.stderr
    assert "the run is not complete: the snapshot of step 3 was not committed (no space left on device" in r.stderr
    assert f"the last committed snapshot is step 1. Resume with: rlctl resume {run}" in r.stderr
    failed = events_of(run, "snapshot_failed")
    assert [(e["step"], e["consecutive"], e["max_failures"]) for e in failed] == [(2, 1, 3), (3, 2, 3)]
    assert all("no space left on device" in e["error"] and str(run) in e["error"] for e in failed)
    assert [e["step"] for e in events_of(run, "snapshot_committed")] == [1]
    assert not events_of(run, "completed")
    assert [c["step"] for c in listed(run)] == [1]  # nothing half-written is left to be taken for whole

    r = run_cli("resume", str(run))  # the disk has room again
    assert r.returncode == 0, r.stderr
    assert "continuing from step 1" in r.stderr
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3]
    assert [e["step"] for e in events_of(run, "snapshot_committed")] == [1, 2, 3]
    assert events_of(run, "completed")[-1]["step"] == 3


def test_a_really_full_disk_is_exit_12_never_done(tmp_path):
    """Snapshots on a real 256 KiB filesystem (root only): the run used to print `done` and exit 0 with
    its final weights on no storage."""
    run = tmp_path / "run"
    with small_tmpfs(tmp_path / "disk", size="256k") as disk:
        args = ["--set", f"checkpoint.dir={disk}", "--set", "checkpoint.every=1", "--set", "trainer.total_steps=2"]
        r = run_cli("start", *start_args(run), *SMALL, *args)
        assert r.returncode == ExitCode.STORAGE == 12, r.stderr
        assert "Traceback" not in r.stderr and "done:" not in r.stderr
        assert "no space left on device" in r.stderr and "the run is not complete" in r.stderr
        assert [e["step"] for e in events_of(run, "snapshot_failed")] == [1, 2]
        assert not events_of(run, "completed") and not any(disk.glob("step-*"))  # nothing half-written left
        r = run_cli("resume", str(run))  # no snapshot ever committed: it starts over, on a disk still full
        assert r.returncode == ExitCode.STORAGE == 12, r.stderr  # never "nothing to do"
        assert "starting the run over from step 0 (it trained 2 step(s)" in r.stderr
        assert [row["step"] for row in metrics_of(run, "metrics.abandoned.jsonl")] == [1, 2]


def test_max_failures_in_a_row_stop_the_run_at_once(tmp_path):
    run = tmp_path / "run"
    r = run_cli(
        "start", *start_args(run, steps=6, every=1), *SMALL, "--set", "checkpoint.max_failures=2", faults="enospc@2"
    )
    assert r.returncode == ExitCode.STORAGE, r.stderr
    assert "2 snapshots in a row failed (checkpoint.max_failures: 2); the last, of step 3" in r.stderr
    assert "no space left on device" in r.stderr and "the last committed snapshot is step 1" in r.stderr
    assert "Traceback" not in r.stderr
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3]  # no step trained past the limit
    assert [e["step"] for e in events_of(run, "snapshot_failed")] == [2, 3]
    assert not events_of(run, "completed")


def test_a_stop_whose_snapshot_failed_says_so_and_exits_resume_me(tmp_path):
    run = tmp_path / "run"
    proc = spawn("start", *start_args(run, steps=6, every=1), *SMALL, faults="enospc@2,sleep@2=120")
    wait_for(lambda: events_of(run, "snapshot_failed") if (run / "events.jsonl").exists() else False, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.PREEMPTED, err
    assert "stopped by SIGTERM after step 2; the snapshot of step 2 was not committed (no space left on device" in err
    assert f"the last committed snapshot is step 1. Resume with: rlctl resume {run} --from latest" in err
    assert events_of(run, "preempted")[-1]["snapshot"] == 1


def test_garbage_manifest_is_quarantined_and_resume_falls_back_saying_why(tmp_path):
    run = tmp_path / "run"
    r = invoke("start", *start_args(run, steps=4, every=2), *SMALL, cwd=REPO)
    assert r.returncode == 0, r.stderr
    newest = run / "checkpoints" / "step-000004"
    files = sorted(p.relative_to(newest) for p in newest.rglob("*") if p.is_file())
    (newest / "manifest.json").write_bytes(b'{"format": 1, "step": 4, "files": {"state.pt": {"si')  # cut off

    rows = listed(run)  # a look changes nothing
    assert [(c["step"], c["usable"]) for c in rows] == [(2, True), (4, False)]
    assert rows[1]["problem"] == "manifest.json is not valid JSON (truncated or overwritten?)"
    assert newest.exists()

    r = invoke("resume", str(run), "--set", "trainer.total_steps=6", env={"COLUMNS": "1000"})  # notes unwrapped
    assert r.returncode == 0, r.stderr
    (moved,) = (run / "checkpoints" / "quarantine").iterdir()
    assert moved.name.startswith("step-000004.")
    assert (
        f"warning: skipping snapshot step-000004: manifest.json is not valid JSON (truncated or overwritten?); "
        f"moved to {moved}" in r.stderr
    )
    assert "continuing from step 2" in r.stderr
    assert sorted(p.relative_to(moved) for p in moved.rglob("*") if p.is_file()) == files  # nothing lost
    (event,) = events_of(run, "snapshot_quarantined")
    assert (event["step"], event["location"]) == (4, str(moved))
    assert [row["step"] for row in metrics_of(run)] == list(range(1, 7))
    assert [c["step"] for c in listed(run)] == [2, 4, 6]  # step 4 trained and committed again


def policy_history(snapshot_dir, rule):
    state = torch.load(snapshot_dir / "state.pt", weights_only=False)
    return state["policy"]["engine"]["rules"][rule]["history_steps"]


def test_resume_after_a_rollback_takes_the_policy_state_of_the_restored_step(tmp_path):
    """A rollback at step 3 (to step 2) writes policy_state.json as of step 2. A later resume from
    the snapshot of step 4 must carry on with step 4's policy state (its spike window holds steps 1-4),
    not the older file's (steps 1-2): the resumed run's step-6 snapshot holds the same window as the
    uninterrupted run's. A policy_state.json that cannot be read is a warning, not a traceback."""
    rules = [
        {"name": "kl", "when": "actor/ppo_kl > 1.0", "actions": [{"type": "rollback"}]},
        {
            "name": "watch",
            "trigger": {"kind": "spike", "metric": "actor/lr", "window": 8, "min_history": 2, "sigma": 6},
            "actions": [{"type": "warn"}],
        },
    ]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        json.dumps({"trainer": {"total_steps": 6}, "checkpoint": {"every": 2}, "policies": [{"rules": rules}]})
    )
    run = tmp_path / "run"
    r = run_cli("start", *start_args(run, config=cfg), *SMALL, faults="metric@3=actor/ppo_kl:5.0")
    assert r.returncode == 0, r.stderr
    assert events_of(run, "rollback")[0]["to_step"] == 2
    assert json.loads((run / "policy_state.json").read_text())["step"] == 2
    uninterrupted = policy_history(run / "checkpoints" / "step-000006", "watch")
    assert uninterrupted == [1, 2, 3, 4, 5, 6]

    r = invoke("resume", str(run), "--from", "step-4")
    assert r.returncode == 0, r.stderr
    assert policy_history(run / "checkpoints" / "step-000006", "watch") == uninterrupted

    (run / "policy_state.json").write_text(json.dumps({"step": 4, "version": 1, "engine": 5}))
    r = invoke("resume", str(run), "--from", "step-4", env={"COLUMNS": "1000"})
    assert r.returncode == 0, r.stderr
    assert f"warning: ignoring {run / 'policy_state.json'}: it does not fit this run's policies" in r.stderr
    assert "Traceback" not in r.stderr
    assert policy_history(run / "checkpoints" / "step-000006", "watch") == uninterrupted
    assert events_of(run, "policy_state_ignored")
