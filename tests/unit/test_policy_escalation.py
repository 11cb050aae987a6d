"""A rule that keeps firing escalates: its `escalate` stages take over from its actions, and `max_triggers`
counts its firings over the run or within a window of steps before its `then`. The ready-made default
escalates so, and a healthy run's heavy-tailed gradient norms do not fire it."""

import json
from pathlib import Path

import pytest

from rlctl.errors import ConfigError
from rlctl.policies import PolicyEngine, load_policy_file, validate_policy

REPO = Path(__file__).resolve().parents[2]
ROLLBACK = [{"type": "rollback"}]
HALVE = [{"type": "rollback"}, {"type": "adjust", "multiply": {"actor.lr": 0.5}, "min": {"actor.lr": 1e-7}}]


def engine(**rule) -> PolicyEngine:
    base = {"name": "kl", "when": "k > 1", "actions": ROLLBACK}
    return PolicyEngine(validate_policy({"rules": [{**base, **rule}]}).rules)


def fire(eng: PolicyEngine, *steps: int) -> list[tuple[int, int, int, bool, list[str]]]:
    """(step, count, stage, escalated, action types) of each firing at ``steps`` (each step a hit)."""
    out = []
    for step in steps:
        for f in eng.evaluate(step, {"k": 5.0}):
            out.append((f.step, f.count, f.stage, f.escalated, [a.type for a in f.actions]))
    return out


def test_a_window_counts_only_recent_firings():
    eng = engine(max_triggers={"count": 2, "within": 10})
    assert fire(eng, 1, 5, 8) == [
        (1, 1, 0, False, ["rollback"]),
        (5, 2, 0, False, ["rollback"]),
        (8, 3, 0, True, ["halt"]),  # three within 10 steps: 1, 5 and 8
    ]
    eng = engine(max_triggers={"count": 2, "within": 10})
    assert [c for _, c, _, esc, _ in fire(eng, 1, 20, 40, 45, 49) if not esc] == [1, 1, 1, 2]  # far apart: never 3


def test_a_number_counts_over_the_whole_run():
    eng = engine(max_triggers=2)
    assert [(c, esc) for _, c, _, esc, _ in fire(eng, 1, 100, 900)] == [(1, False), (2, False), (3, True)]


def test_escalate_stages_take_over_then_the_limit_halts():
    eng = engine(
        escalate=[{"after": 1, "actions": HALVE}, {"after": 2, "actions": [{"type": "warn"}]}],
        max_triggers={"count": 3, "within": 50},
    )
    assert fire(eng, 10, 12, 14, 16, 18) == [
        (10, 1, 0, False, ["rollback"]),
        (12, 2, 1, False, ["rollback", "adjust"]),
        (14, 3, 2, False, ["warn"]),
        (16, 4, 2, True, ["halt"]),
        (18, 5, 2, True, ["halt"]),
    ]
    [event] = [f.as_event() for f in engine(escalate=[{"after": 1, "actions": HALVE}]).evaluate(3, {"k": 2})]
    assert event["stage"] == 0 and event["count"] == 1


def test_a_quiet_window_brings_the_gentle_actions_back():
    eng = engine(escalate=[{"after": 1, "actions": HALVE}], max_triggers={"count": 4, "within": 100})
    assert [stage for _, _, stage, _, _ in fire(eng, 10, 20, 300)] == [0, 1, 0]


def test_firings_after_a_rollback_target_still_count_as_recent():
    eng = engine(max_triggers={"count": 2, "within": 20})
    fire(eng, 50, 55)
    eng.rewind(40)  # rolled back to step 40: the firings at 50 and 55 were not forgotten
    assert fire(eng, 45) == [(45, 3, 0, True, ["halt"])]


def test_the_window_survives_a_state_round_trip_and_an_old_state_loads():
    eng = engine(max_triggers={"count": 2, "within": 10})
    fire(eng, 1, 5)
    state = json.loads(json.dumps(eng.state_dict()))
    again = engine(max_triggers={"count": 2, "within": 10})
    again.load_state_dict(state)
    assert fire(again, 8)[0][1:4] == (3, 0, True)

    old = json.loads(json.dumps(state))
    del old["rules"]["kl"]["fired_steps"]  # a state written before the window existed: fired at 5 only
    older = engine(max_triggers={"count": 2, "within": 10})
    older.load_state_dict(old)
    assert fire(older, 8)[0][1:4] == (2, 0, False)


@pytest.mark.parametrize(
    "rule, words",
    [
        ({"escalate": [{"after": 2, "actions": ROLLBACK}, {"after": 1, "actions": ROLLBACK}]}, "increasing 'after'"),
        ({"escalate": [{"after": 3, "actions": ROLLBACK}], "max_triggers": 3}, "never runs: max_triggers allows 3"),
        ({"escalate": [{"after": 1, "actions": [{"type": "halt"}, {"type": "rollback"}]}]}, "cannot be combined"),
        ({"max_triggers": {"count": 0}}, "greater than or equal to 1"),
        ({"max_triggers": {"count": 2, "within": 0}}, "greater than or equal to 1"),
        ({"max_triggers": {"count": 2, "over": 5}}, "over"),
    ],
)
def test_bad_escalations_are_refused(rule, words):
    with pytest.raises(ConfigError, match=words):
        engine(**rule)


def test_a_rule_says_its_stages_and_window():
    [rule] = validate_policy(
        {
            "rules": [
                {
                    "name": "kl",
                    "when": "k > 1",
                    "actions": ROLLBACK,
                    "escalate": [{"after": 2, "actions": HALVE}],
                    "max_triggers": {"count": 5, "within": 200},
                }
            ]
        }
    ).rules
    assert rule.describe() == (
        "rule kl: when k > 1: roll back to the last good snapshot; after 2 firings: roll back to the last good "
        "snapshot, multiply actor.lr by 0.5 (at least 1e-07); at most 5 times within 200 steps, then halt."
    )


# --------------------------------------------------------------------------------------------------
# The ready-made default on a healthy run's gradient norms (recorded from a real built-in run)

HEALTHY = json.loads((REPO / "tests" / "data" / "healthy_grad_norms.json").read_text())


def grad_spike_firings(policy: str, values: list[float]) -> list[int]:
    rules = [r for r in load_policy_file(REPO / "policies" / f"{policy}.yaml").rules if r.name == "grad-spike"]
    eng = PolicyEngine(rules)
    return [f.step for step, v in enumerate(values, 1) for f in eng.evaluate(step, {"actor/grad_norm": v})]


def test_the_default_grad_spike_rule_lets_a_healthy_run_be_and_catches_a_drill():
    values = HEALTHY["actor/grad_norm"]
    assert len(values) >= 1400 and max(values) > 50 * sorted(values)[len(values) // 2]  # heavy-tailed
    assert grad_spike_firings("default", values) == []
    drilled = values[:700] + [1e6] + values[701:]  # the grad-spike drill: metric@701=actor/grad_norm:1e6
    assert grad_spike_firings("default", drilled)[:1] == [701]


def test_the_default_escalates_before_it_halts():
    default = {r.name: r for r in load_policy_file(REPO / "policies" / "default.yaml").rules}
    for name in ("nonfinite", "kl-drift", "grad-spike", "ratio-blowup"):
        rule = default[name]
        assert rule.limit is not None and rule.limit.within, name
        stages = [rule.actions, *(s.actions for s in rule.escalate)]
        assert any(a.type == "adjust" and "actor.lr" in a.multiply and "actor.lr" in a.min for a in stages[-1]), name
        assert all(any(a.type == "rollback" for a in actions) for actions in stages), name
