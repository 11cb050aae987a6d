"""A fault drill fires once per run, whatever its step's verdict: the drills of a run config's `faults`
on real runs (a drill that fired is recorded in events.jsonl; a resume or a rollback that replays its
step does not fire it again)."""

import signal

from helpers import (
    REPO,
    SMALL,
    events_of,
    has_step,
    invoke,
    metrics_of,
    run_cli,
    settled_before,
    spawn,
    start_args,
    wait_for,
)

KL_ROLLBACK = {"rules": [{"name": "kl", "when": "actor/ppo_kl > 1.0", "actions": [{"type": "rollback"}]}]}


def drills_fired(run) -> list[tuple[str, int]]:
    """(drill, step) of each drill_fired event (but the damaged ones a test writes)."""
    return [(e["drill"], e["step"]) for e in events_of(run, "drill_fired") if "step" in e]


def test_a_crash_drill_fires_after_a_step_that_failed_a_policy_and_the_resume_does_not_fire_it_again(tmp_path):
    run = tmp_path / "run"
    cfg = {"faults": "metric@3=actor/ppo_kl:5.0,crash@3", "policies": [KL_ROLLBACK]}
    r = run_cli("start", *start_args(run, config=cfg, steps=4, every=2), *SMALL)
    assert r.returncode == 1 and "fault drill: rank 0 crashed after step 3" in r.stderr, r.stderr
    assert [row["step"] for row in metrics_of(run)] == [1, 2]  # crashed after the failed step 3, not its replay
    assert [a["step"] for a in metrics_of(run, "metrics.abandoned.jsonl")] == [3]
    assert drills_fired(run) == [("metric@3=actor/ppo_kl:5.0", 3), ("crash@3", 3)]
    assert events_of(run, "crashed")[0]["step"] == 2  # (rolled back to step 2 before it crashed)
    with (run / "events.jsonl").open("a") as f:  # what is read back may be damaged: skipped
        f.write('{"event": "drill_fired", "drill": 7}\n{"event": "drill_fired", "drill": "nope@3"}\n{not json\n')

    r = run_cli("resume", str(run))  # replays step 3 from the snapshot of step 2: neither drill fires
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3, 4]
    assert metrics_of(run)[2]["actor/ppo_kl"] < 1.0
    assert [e["step"] for e in events_of(run, "policy")] == [3]
    assert drills_fired(run) == [("metric@3=actor/ppo_kl:5.0", 3), ("crash@3", 3)]
    assert events_of(run, "completed")


def test_a_sleep_drill_killed_before_any_snapshot_of_its_step_does_not_sleep_again_on_resume(tmp_path):
    run = tmp_path / "run"
    proc = spawn("start", *start_args(run, config={"faults": "sleep@3=120"}, steps=4, every=2), *SMALL)

    def sleeping() -> bool:  # (the drill is recorded, then waits for the snapshot of step 2, then sleeps)
        return has_step(run, 3)() and ("sleep@3=120", 3) in drills_fired(run) and settled_before(run, 3)

    wait_for(sleeping, proc)
    proc.send_signal(signal.SIGKILL)  # in the drill's sleep: the event log is the only record that it fired
    proc.wait()
    r = run_cli("resume", str(run), timeout=90)  # (were the drill armed again, it would sleep 120 s)
    assert r.returncode == 0, r.stderr
    assert "continuing from step 2" in r.stderr
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3, 4]
    assert drills_fired(run) == [("sleep@3=120", 3)]


def test_a_rollback_that_replays_a_sleep_drill_step_does_not_sleep_again(tmp_path):
    run = tmp_path / "run"
    cfg = {"faults": "sleep@3=12,metric@4=actor/ppo_kl:5.0", "policies": [KL_ROLLBACK]}
    r = invoke("start", *start_args(run, config=cfg, steps=5, every=2), *SMALL, cwd=REPO)
    assert r.returncode == 0, r.stderr
    (rollback,) = events_of(run, "rollback")
    assert (rollback["from_step"], rollback["to_step"]) == (4, 2)
    first = {a["step"]: a["timestamp"] for a in metrics_of(run, "metrics.abandoned.jsonl")}
    assert first[4] - first[3] >= 12  # step 4 began after the drill's 12 s
    rows = {row["step"]: row["timestamp"] for row in metrics_of(run)}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert rows[4] - rows[3] < first[4] - first[3]  # the replay of step 3 did not sleep (a step: 1-2 s, loaded more)
    assert drills_fired(run) == [("sleep@3=12", 3), ("metric@4=actor/ppo_kl:5.0", 4)]
