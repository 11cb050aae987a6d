"""The drop trigger (a metric falls from its best so far, or its recent median) and rollback to: best:
the evaluator on sparse validation rows, its state through resume and rewind, located schema errors,
the guard's merge, plain-words descriptions and the ready-made val-drop policy."""

import json
import math
import textwrap

import pytest

from rlctl.errors import ConfigError
from rlctl.policies import PolicyEngine, firing_event, load_policy_file, validate_policy
from rlctl.policies.guard import PolicyGuard, merge

VAL = "val/score/mean"


def drop_rule(name="drop", actions=None, **fields) -> dict:
    rule = {k: fields.pop(k) for k in ("sustained", "warmup", "cooldown", "max_triggers") if k in fields}
    trigger = {"kind": "drop", "metric": VAL, **fields}
    return {"name": name, "trigger": trigger, "actions": actions or [{"type": "warn"}], **rule}


def engine(*rules: dict) -> PolicyEngine:
    return PolicyEngine(validate_policy({"rules": list(rules)}).rules)


def run(eng: PolicyEngine, rows: dict[int, dict]) -> dict[int, tuple]:
    """Evaluate ``{step: row}`` in step order; {step: (value, limit)} of the steps that fired."""
    out = {}
    for step in sorted(rows):
        for f in eng.evaluate(step, rows[step]):
            out[step] = (f.value, f.limit)
    return out


def events(eng: PolicyEngine, rows: dict[int, dict]) -> list[dict]:
    """Evaluate ``{step: row}`` in step order; the firings as event-log entries."""
    return [firing_event(f) for step in sorted(rows) for f in eng.evaluate(step, rows[step])]


def sparse(values: dict[int, float], last: int | None = None) -> dict[int, dict]:
    """Every step's row from 1 to ``last``, with the validation metric only at the steps in ``values``."""
    last = last or max(values)
    return {s: {"actor/ppo_kl": 0.01, **({VAL: values[s]} if s in values else {})} for s in range(1, last + 1)}


def state_of(eng: PolicyEngine, name: str = "drop") -> dict:
    return eng.state_dict()["rules"][name]


# --------------------------------------------------------------------------------------------------
# Evaluator


def test_a_floor_disarms_a_median_drop_whose_baseline_has_nothing_left_to_fall_from():
    """default's entropy-collapse: a fall to under a quarter of the median fires from 2.0; a policy whose
    entropy came down step by step (each value within the band joins the median) and now swings by 4x
    around 0.05, as a converged one does, is not a collapse once the median is under the floor; mode min
    mirrors it (not armed while the median is above the floor)."""
    rule = drop_rule(baseline="median", window=4, min_history=4, fraction=0.75, floor=0.1)
    floorless = {**rule, "trigger": {k: v for k, v in rule["trigger"].items() if k != "floor"}}
    sudden = {1: 2.0, 2: 2.1, 3: 1.9, 4: 2.0, 5: 0.3}
    assert run(engine(rule), sparse(sudden)) == {5: (0.3, pytest.approx(0.5))}
    gradual = {1: 2.0, 2: 1.0, 3: 0.5, 4: 0.25, 5: 0.2, 6: 0.1, 7: 0.06, 8: 0.05, 9: 0.01}
    assert run(engine(floorless), sparse(gradual)) == {9: (0.01, pytest.approx(0.02))}
    assert run(engine(rule), sparse(gradual)) == {}  # the median at step 9 is 0.08

    mirrored = drop_rule(mode="min", baseline="median", window=4, min_history=4, fraction=1.0, floor=10.0)
    assert list(run(engine(mirrored), sparse({1: 1.0, 2: 1.1, 3: 0.9, 4: 1.0, 5: 2.5}))) == [5]
    assert run(engine(mirrored), sparse({1: 8.0, 2: 12.0, 3: 16.0, 4: 20.0, 5: 50.0})) == {}  # (median 14)
    assert "while that is at least 0.1" in validate_policy({"rules": [rule]}).rules[0].resolved_trigger.describe()


def test_best_amount_fires_below_best_minus_amount_with_the_threshold_as_limit():
    eng = engine(drop_rule(amount=0.05))
    fired = run(eng, sparse({2: 0.40, 4: 0.50, 6: 0.46, 8: 0.44, 10: 0.52, 12: 0.46}))
    assert list(fired) == [8, 12]  # 0.46 is only 0.04 below 0.50; 0.44 is 0.06 below
    assert fired[8] == (0.44, pytest.approx(0.45)) and fired[12] == (0.46, pytest.approx(0.47))
    assert state_of(eng)["history"] == [0.40, 0.50, 0.52]  # the improvements, in order
    assert state_of(eng)["history_steps"] == [2, 4, 10]


def test_the_first_value_never_fires_and_min_history_arms_later():
    assert run(engine(drop_rule(amount=0.05)), {1: {VAL: 0.9}}) == {}
    eng = engine(drop_rule(amount=0.05, min_history=3))
    assert run(eng, sparse({2: 0.9, 4: 0.1, 6: 0.1, 8: 0.1})) == {8: (0.1, pytest.approx(0.85))}
    assert state_of(eng)["seen_steps"] == [2, 4, 6]


def test_fraction_is_of_the_baseline_magnitude():
    eng = engine(drop_rule(fraction=0.1))
    assert run(eng, sparse({1: 0.5, 2: 0.46, 3: 0.44})) == {3: (0.44, pytest.approx(0.45))}
    negative = engine(drop_rule(fraction=0.5))  # a reward that lives below zero: |baseline|
    assert run(negative, sparse({1: -2.0, 2: -2.9, 3: -3.1})) == {3: (-3.1, pytest.approx(-3.0))}


def test_mode_min_fires_on_a_rise_above_the_lowest():
    eng = engine(drop_rule(mode="min", amount=10))
    rows = {s: {VAL: v} for s, v in enumerate([100.0, 90.0, 99.0, 101.0, 80.0, 95.0], 1)}
    assert run(eng, rows) == {4: (101.0, 100.0), 6: (95.0, 90.0)}


def test_median_baseline_and_a_firing_value_stays_out_of_the_window():
    eng = engine(drop_rule(baseline="median", window=3, amount=0.1))
    rows = {s: {VAL: v} for s, v in enumerate([0.5, 0.6, 0.7, 0.45, 0.65, 0.8, 0.5], 1)}
    # step 4: median(0.5, 0.6, 0.7) = 0.6, limit 0.5: 0.45 fires and does not enter the window;
    # step 7: window (0.7, 0.65, 0.8), median 0.7, limit 0.6: 0.5 fires
    assert run(eng, rows) == {4: (0.45, pytest.approx(0.5)), 7: (0.5, pytest.approx(0.6))}
    assert state_of(eng)["history"] == [0.7, 0.65, 0.8] and state_of(eng)["history_steps"] == [3, 5, 6]


def test_rows_without_the_metric_and_nonfinite_values_are_not_observations():
    eng = engine(drop_rule(baseline="median", window=2, amount=0.1))
    rows = sparse({3: 0.5, 6: "NaN", 9: 0.5, 12: math.inf, 15: 0.3})
    assert run(eng, rows) == {15: (0.3, pytest.approx(0.4))}
    assert state_of(eng)["history_steps"] == [3, 9]
    best = engine(drop_rule(amount=0.1))
    assert run(best, {1: {VAL: 0.5}, 2: {VAL: -math.inf}, 3: {VAL: "Infinity"}, 4: {VAL: 0.45}}) == {}
    assert state_of(best)["history"] == [0.5] and state_of(best)["seen_steps"] == [1]


def test_sustained_counts_observations_across_rows_without_the_metric():
    eng = engine(drop_rule(amount=0.05, sustained=2))
    # validations every 5 steps: 0.3 at 10 and 15 are two observations in a row, the steps between are none
    assert list(run(eng, sparse({5: 0.5, 10: 0.3, 15: 0.3, 20: 0.3, 25: 0.5, 30: 0.3, 35: 0.3}))) == [15, 35]
    broken = engine(drop_rule(amount=0.05, sustained=2))
    # a value back above the limit (step 15) breaks the streak; a missing step (never evaluated) does too
    rows = {**sparse({5: 0.5, 10: 0.3, 15: 0.48, 20: 0.3}), 22: {VAL: 0.3}, 23: {VAL: 0.3}}
    assert list(run(broken, rows)) == [23]


def test_threshold_streaks_also_bridge_rows_without_the_metric():
    eng = engine({"name": "low", "when": f"{VAL} < 0.2", "sustained": 2, "actions": [{"type": "warn"}]})
    assert list(run(eng, sparse({4: 0.1, 8: 0.1, 12: 0.5, 16: 0.1}))) == [8]


def test_warmup_and_cooldown_still_track_the_best():
    eng = engine(drop_rule(amount=0.05, warmup=2, cooldown=3))
    # step 2 is in the warm-up: its drop does not fire; step 4 fires; 5-7 cool down, but 0.95 at step 7 is
    # a new best, so 0.89 at step 9 fires (limit 0.9)
    fired = run(eng, {s: {VAL: v} for s, v in enumerate([0.9, 0.5, 0.88, 0.5, 0.5, 0.6, 0.95, 0.9, 0.89], 1)})
    assert list(fired) == [4, 9] and fired[9] == (0.89, pytest.approx(0.9))
    assert state_of(eng)["history"] == [0.9, 0.95]


def test_a_firing_carries_the_drop_metric_and_words():
    eng = engine(drop_rule(mode="min", amount=1, sustained=2))
    [f] = [f for s in (1, 2, 3) for f in eng.evaluate(s, {VAL: [1.0, 3.0, 3.0][s - 1]})]
    assert (f.step, f.metric, f.value, f.limit, f.drop_metric) == (3, VAL, 3.0, 2.0, (VAL, "min"))
    assert f.trigger == f"{VAL} rises more than 1 above its best (lowest) so far, on 2 values in a row"
    assert "drop_metric" not in f.as_event()


# --------------------------------------------------------------------------------------------------
# State: rewind, round trip, version 1


def test_rewind_restores_the_best_of_the_values_up_to_the_step():
    eng = engine(drop_rule(amount=0.05, min_history=2, max_triggers=5))
    run(eng, sparse({2: 0.4, 4: 0.5, 6: 0.7, 8: 0.6}))
    assert state_of(eng)["history"] == [0.4, 0.5, 0.7]
    eng.rewind(5)
    assert state_of(eng)["history"] == [0.4, 0.5] and state_of(eng)["seen_steps"] == [2, 4]
    assert run(eng, {6: {VAL: 0.46}, 8: {VAL: 0.44}}) == {8: (0.44, pytest.approx(0.45))}  # best 0.5, not 0.7
    eng.rewind(3)  # one value left: not armed (min_history 2); the count of firings stays
    assert state_of(eng)["seen_steps"] == [2] and eng.triggers("drop") == 2
    assert run(eng, {4: {VAL: 0.1}}) == {}


def test_state_dict_round_trip_continues_identically():
    rules = [drop_rule(amount=0.05), drop_rule("median", baseline="median", window=3, fraction=0.1, sustained=2)]
    rows = sparse({s: 0.5 + 0.1 * math.sin(s / 3) for s in range(2, 60, 2)}, 60)
    whole = engine(*rules)
    expected = events(whole, rows)
    assert {e["rule"] for e in expected} == {"drop", "median"}  # the sine falls from its best and its median
    first = engine(*rules)
    got = events(first, {s: r for s, r in rows.items() if s <= 30})
    resumed = engine(*rules)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += events(resumed, {s: r for s, r in rows.items() if s > 30})
    assert got == expected
    assert resumed.state_dict() == whole.state_dict()


def test_a_version_1_state_without_seen_steps_still_loads():
    old = {  # as written before seen_steps existed
        "version": 1,
        "rules": {
            "drop": {
                "triggers": 1,
                "streak": 0,
                "streak_step": 8,
                "cooldown_until": None,
                "last_fired": 8,
                "history": [0.4, 0.5],
                "history_steps": [2, 4],
            },
            "kl": {"triggers": 0, "streak": 1, "streak_step": 8, "cooldown_until": None, "last_fired": None},
        },
    }
    kl = {"name": "kl", "when": "k > 1", "sustained": 2, "actions": [{"type": "warn"}]}
    eng = engine(drop_rule(amount=0.05, min_history=2), kl)
    eng.load_state_dict(old)
    assert state_of(eng)["seen_steps"] == [2, 4] and eng.triggers("drop") == 1  # armed by its history
    fired = events(eng, {9: {VAL: 0.44, "k": 2}})  # drop's best (0.5) and kl's streak carried on
    assert [(e["rule"], e["value"], e["limit"], e["count"]) for e in fired] == [
        ("drop", 0.44, 0.45, 2),
        ("kl", 2, 1, 1),
    ]


# --------------------------------------------------------------------------------------------------
# Schema errors, located


RULE = "rules:\n  - name: r\n"


@pytest.mark.parametrize(
    "text,message",
    [
        (
            RULE + "    trigger: {kind: drop, metric: m, amount: 0.1, fraction: 0.1}\n    actions: [{type: warn}]\n",
            "'rules.0.trigger' (bad.yaml line 3): give exactly one of 'amount' (an absolute margin) or 'fraction' "
            "(of the baseline).",
        ),
        (
            RULE + "    trigger:\n      kind: drop\n      metric: m\n    actions: [{type: warn}]\n",
            "'rules.0.trigger' (bad.yaml line 3): give exactly one of 'amount'",
        ),
        (
            RULE + "    trigger: {kind: drop, metric: m, fraction: 1.5}\n    actions: [{type: warn}]\n",
            "'rules.0.trigger.fraction' (bad.yaml line 3): input should be less than or equal to 1 (got 1.5)",
        ),
        (
            RULE + "    trigger: {kind: drop, metric: m, amount: 0}\n    actions: [{type: warn}]\n",
            "'rules.0.trigger.amount' (bad.yaml line 3): input should be greater than 0 (got 0)",
        ),
        (
            RULE + "    trigger: {kind: drop, metric: m, amount: 1, window: 3}\n    actions: [{type: warn}]\n",
            "'rules.0.trigger' (bad.yaml line 3): 'window' goes with baseline: median, not with baseline: best",
        ),
        (
            RULE + "    trigger: {kind: drop, metric: m, amount: 1, mode: maximum}\n    actions: [{type: warn}]\n",
            "'rules.0.trigger.mode' (bad.yaml line 3): input should be 'max' or 'min' (got 'maximum'); "
            "did you mean 'max'?",
        ),
        (
            RULE + "    when: x > 1\n    actions:\n      - type: rollback\n        to: best\n",
            "'rules.0' (bad.yaml line 2): rollback to: best needs a drop trigger (kind: drop), whose metric and "
            "mode say which snapshot is best; this rule's trigger is threshold.",
        ),
        (
            RULE + "    trigger: {kind: drop, metric: m, amount: 1}\n    actions:\n      - type: rollback\n"
            "        to: best\n        min_steps_back: 5\n",
            "'rules.0.actions.0' (bad.yaml line 5): 'min_steps_back' goes with to: steps_back",
        ),
    ],
    ids=[
        "both margins",
        "no margin",
        "fraction over 1",
        "amount 0",
        "window with best",
        "bad mode",
        "best no drop",
        "K",
    ],
)
def test_bad_drop_rule_is_one_located_sentence(tmp_path, text, message):
    p = tmp_path / "bad.yaml"
    p.write_text(textwrap.dedent(text))
    with pytest.raises(ConfigError) as err:
        load_policy_file(p)
    assert type(err.value) is ConfigError
    assert err.value.message.startswith(f"invalid policy file {p}: ")
    assert message in err.value.message


# --------------------------------------------------------------------------------------------------
# Guard and merge


def firings_at(step: int, *rules: dict, row: dict):
    return engine(*rules).evaluate(step, row)


def test_merge_ranks_best_between_last_good_and_steps_back():
    best = drop_rule("best", actions=[{"type": "rollback", "to": "best"}], amount=0.05)
    last_good = {"name": "kl", "when": "k > 1", "actions": [{"type": "rollback"}]}
    back = {"name": "far", "when": "k > 1", "actions": [{"type": "rollback", "to": "steps_back", "min_steps_back": 1}]}
    eng = engine(last_good, best, back)
    eng.evaluate(1, {VAL: 0.9})
    firings = eng.evaluate(2, {VAL: 0.5, "k": 2})
    assert [f.rule for f in firings] == ["kl", "best", "far"]
    v = merge(2, firings[:2])
    assert (v.rollback.to, v.rollback_rule, v.rollback_best) == ("best", "best", (VAL, "max"))
    v = merge(2, firings[1::-1])  # order does not matter: best still wins over last-good
    assert (v.rollback_rule, v.rollback_best) == ("best", (VAL, "max"))
    v = merge(2, firings)
    assert (v.rollback.to, v.rollback_rule, v.rollback_best) == ("steps_back", "far", None)
    assert merge(2, firings[:1]).rollback_best is None


def test_guard_check_and_best_metrics():
    rules = validate_policy(
        {
            "rules": [
                drop_rule("acc", actions=[{"type": "rollback", "to": "best"}], amount=0.05, max_triggers=1),
                drop_rule("len", mode="min", fraction=0.5, actions=[{"type": "warn"}]),
            ]
        }
    ).rules
    guard = PolicyGuard(rules)
    assert guard.best_metrics == [(VAL, "max")] and guard.rolls_back and guard.max_steps_back == 0
    assert guard.check(1, {VAL: 0.6}).rollback is None
    verdict = guard.check(2, {VAL: 0.5})
    assert verdict.rollback_best == (VAL, "max") and not verdict.good and verdict.recovers
    guard.rewind(1)
    escalated = guard.check(2, {VAL: 0.5})  # best 0.6 survived the rewind; the 2nd firing halts
    assert escalated.halt is not None and escalated.rollback is None and escalated.rollback_best is None


# --------------------------------------------------------------------------------------------------
# Words and the ready-made policy


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"amount": 0.05}, f"{VAL} falls more than 0.05 below its best so far"),
        ({"fraction": 0.05, "mode": "min"}, f"{VAL} rises more than 5% above its best (lowest) so far"),
        (
            {"baseline": "median", "window": 4, "fraction": 0.1, "min_history": 3},
            f"{VAL} falls more than 10% below the median of its last 4 values, once 3 values are known",
        ),
        ({"baseline": "median", "window": 1, "amount": 2}, f"{VAL} falls more than 2 below its last value"),
    ],
)
def test_drop_describes_itself(fields, words):
    assert validate_policy({"rules": [drop_rule(**fields)]}).rules[0].resolved_trigger.describe() == words


def test_rule_with_to_best_describes_itself():
    rule = validate_policy(
        {"rules": [drop_rule("v", actions=[{"type": "rollback", "to": "best"}], amount=0.05, sustained=2)]}
    ).rules[0]
    assert rule.describe() == (
        f"rule v: when {VAL} falls more than 0.05 below its best so far, on 2 values in a row: roll back to the "
        f"snapshot with the highest {VAL} (else the last good snapshot)."
    )


def test_ready_made_val_drop_loads_and_is_what_it_says():
    from click.testing import CliRunner

    from rlctl.commands.policy import policy

    [rule] = load_policy_file("val-drop").rules
    t = rule.resolved_trigger
    assert (rule.name, t.kind, t.metric, t.mode, t.baseline, t.amount) == ("val-drop", "drop", VAL, "max", "best", 0.05)
    assert [a.type for a in rule.actions] == ["rollback", "adjust"] and rule.actions[0].to == "best"
    assert rule.actions[1].multiply == {"actor.lr": 0.5} and (rule.max_triggers, rule.then) == (3, "halt")
    result = CliRunner().invoke(policy, ["check", "val-drop"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1] == (
        f"  rule val-drop: when {VAL} falls more than 0.05 below its best so far: roll back to the snapshot with "
        f"the highest {VAL} (else the last good snapshot), multiply actor.lr by 0.5; at most 3 times, then halt."
    )
