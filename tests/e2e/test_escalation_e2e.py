"""A rule that keeps firing escalates in a real run: its `escalate` stage's actions (roll back and halve
the lr) take over from its own (roll back), `max_triggers: {count, within}` counts only the firings of
its window (so after a quiet stretch the rule is gentle again, and the lowered lr stays), and the run
halts when the window holds more firings than the count."""

import json

import yaml

from rlctl.errors import ExitCode

from helpers import REPO, SMALL, drills, events_of, invoke, metrics_of, start_args

LR = 2e-3
RULE = {
    "name": "kl",
    "when": "actor/ppo_kl > 1.0",
    "actions": [{"type": "rollback"}],
    "escalate": [
        {"after": 1, "actions": [{"type": "rollback"}, {"type": "adjust", "multiply": {"actor.lr": 0.5}}]},
    ],
    "max_triggers": {"count": 2, "within": 4},
}
# KL blow-ups at steps 3 and 5 (two within 4 steps), 10 (alone in its window), 11, and 12 (a third)
DRILLS = ",".join(f"metric@{s}=actor/ppo_kl:5.0" for s in (3, 5, 10, 11, 12))


def test_a_rule_escalates_within_its_window_and_halts_when_it_keeps_firing(tmp_path):
    cfg = {
        "trainer": {"total_steps": 14},
        "checkpoint": {"every": 2},
        "actor": {"lr": LR},
        "policies": [{"rules": [RULE]}],
    }
    run = tmp_path / "run"
    r = invoke("start", *start_args(run, config=cfg), *SMALL, *drills(DRILLS), cwd=REPO)
    assert r.returncode == ExitCode.HALTED, r.stderr

    fired = [
        (e["step"], e["count"], e["stage"], e["escalated"], [a["type"] for a in e["actions"]])
        for e in events_of(run, "policy")
    ]
    assert fired == [
        (3, 1, 0, False, ["rollback"]),
        (5, 2, 1, False, ["rollback", "adjust"]),
        (10, 1, 0, False, ["rollback"]),  # 3 and 5 are out of the window: gentle again
        (11, 2, 1, False, ["rollback", "adjust"]),
        (12, 3, 1, True, ["halt"]),
    ]
    assert [(e["from_step"], e["to_step"]) for e in events_of(run, "rollback")] == [(3, 2), (5, 4), (10, 8), (11, 10)]
    lrs = [(e["step"], e["changes"]["actor.lr"]["to"]) for e in events_of(run, "adjust")]
    assert lrs == [(5, LR / 2), (11, LR / 4)]  # the lowered lr stays through the quiet stretch
    assert yaml.safe_load((run / "config.yaml").read_text())["actor"]["lr"] == LR / 4
    assert events_of(run, "halted")[-1]["step"] == 12
    last = metrics_of(run)[-1]
    assert (last["step"], last["actor/ppo_kl"]) == (12, 5.0)  # the step that halted it is on record
    assert json.loads((run / "policy_state.json").read_text())["step"] == 12
