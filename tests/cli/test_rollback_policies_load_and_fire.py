"""Rollback policies: the shipped files, one located sentence for every kind of bad file, the evaluator's
triggers and limits, its state round trip, and `rlctl policy check`."""

import ast
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from pydantic import BaseModel

from rlctl.errors import ConfigError
from rlctl.policies import PolicyEngine, firing_event, is_healthy, load_policies, load_policy_file, validate_policy
from rlctl.policies.schema import ALL_MODELS, PolicyFile

from helpers import run_cli

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "policies").glob("*.yaml"))


def write(tmp_path, text, name="bad.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def engine(*rules: dict) -> PolicyEngine:
    return PolicyEngine(validate_policy({"rules": list(rules)}).rules)


WARN = [{"type": "warn"}]


# --------------------------------------------------------------------------------------------------
# Schema and loading


def test_shipped_policies_load():
    assert {p.name for p in SHIPPED} >= {"default.yaml", "conservative.yaml", "warn-only.yaml"}
    for path in SHIPPED:
        policy = load_policy_file(path)
        assert policy.rules and policy.description
        assert all(r.description for r in policy.rules)
        assert path.read_text().startswith("#"), f"{path.name} needs a comment header"
    warn_only = load_policy_file(REPO / "policies" / "warn-only.yaml")
    assert all(r.warn_only for r in warn_only.rules)
    default = load_policy_file(REPO / "policies" / "default.yaml")
    assert {r.resolved_trigger.kind for r in default.rules} == {"nonfinite", "threshold", "spike", "expression", "drop"}


def test_the_agentic_policy_reads_only_the_metrics_multi_turn_runs_write():
    """agentic.yaml: a rule for each failure signature of tool runs, every metric it reads catalogued;
    only the outage and the invalid-call surge roll back (a rollback mends neither a broken tool nor a
    drifting template)."""
    from rlctl.policies.catalogue import unknown_metrics
    from rlctl.policies.schema import rule_metrics

    policy = load_policy_file("agentic")
    rules = {r.name: r for r in policy.rules}
    assert list(rules) == ["tool-outage", "tools-flaky", "tool-error-surge", "invalid-call-surge", "template-drift"]
    assert unknown_metrics(policy.rules) == []
    read = {m for r in policy.rules for m in rule_metrics(r)}
    assert read == {
        "multi_turn/infra_masked_frac",
        "tool/timeout_frac",
        "tool/unavailable_frac",
        "tool/error_frac",
        "tool/invalid_call_frac",
        "multi_turn/template_drift_frac",
    }
    assert {name for name, r in rules.items() if not r.warn_only} == {"tool-outage", "invalid-call-surge"}
    assert (rules["template-drift"].then, rules["tool-outage"].then) == ("halt", "warn")


def test_every_field_has_a_description():
    missing = [f"{m.__name__}.{name}" for m in ALL_MODELS for name, f in m.model_fields.items() if not f.description]
    assert missing == []


def test_every_nested_model_is_covered_by_the_description_check():
    def nested(model: type[BaseModel], seen: set) -> set:
        for f in model.model_fields.values():
            for tp in _types_in(f.annotation):
                if isinstance(tp, type) and issubclass(tp, BaseModel) and tp not in seen:
                    seen.add(tp)
                    nested(tp, seen)
        return seen

    assert nested(PolicyFile, set()) <= set(ALL_MODELS)


def _types_in(annotation):
    from typing import get_args

    yield annotation
    for arg in get_args(annotation):
        yield from _types_in(arg)


def test_when_is_sugar_for_a_threshold_trigger():
    rule = validate_policy({"rules": [{"name": "kl", "when": "actor/ppo_kl >= 5e-2", "actions": WARN}]}).rules[0]
    t = rule.resolved_trigger
    assert (t.kind, t.metric, t.op, t.value) == ("threshold", "actor/ppo_kl", ">=", 0.05)


def test_inline_policies_and_names_unique_across_files(tmp_path):
    inline = {"rules": [{"name": "nan", "trigger": {"kind": "nonfinite"}, "actions": [{"type": "halt"}]}]}
    rules = load_policies([REPO / "policies" / "default.yaml", inline])
    assert [r.name for r in rules][-1] == "nan"
    other = write(tmp_path, "rules:\n  - name: kl-drift\n    when: x > 1\n    actions: [{type: warn}]\n", "mine.yaml")
    with pytest.raises(ConfigError) as err:
        load_policies(["policies/default.yaml", other], base_dir=REPO)
    line = (REPO / "policies" / "default.yaml").read_text().splitlines().index("  - name: kl-drift") + 1
    assert err.value.message == (
        f"invalid policies: rule name 'kl-drift' is used twice: 'rules.1.name' (default.yaml line {line}) and "
        "'rules.0.name' (mine.yaml line 2); rule names must be unique."
    )
    with pytest.raises(ConfigError, match="used more than once: a"):
        PolicyEngine([*validate_policy({"rules": [{"name": "a", "when": "x > 1", "actions": WARN}]}).rules] * 2)


RULE = "rules:\n  - name: r\n"  # the head of a one-rule file; the cases below finish it

BAD_FILES = [
    (
        "unknown top-level key",
        "descriptoin: x\n" + RULE + "    when: x > 1\n    actions: [{type: warn}]\n",
        "unknown key 'descriptoin' (bad.yaml line 1); did you mean 'description'?",
    ),
    (
        "typo in a rule key",
        RULE + "    when: x > 1\n    actoins: [{type: warn}]\n",
        "unknown key 'rules.0.actoins' (bad.yaml line 4); did you mean 'rules.0.actions'?",
    ),
    (
        "unknown trigger kind",
        RULE + "    trigger: {kind: treshold, metric: x}\n    actions: [{type: warn}]\n",
        "'rules.0.trigger.kind' (bad.yaml line 3): unknown kind 'treshold' (one of threshold, nonfinite, spike, drop, "
        "expression); did you mean 'threshold'?",
    ),
    (
        "missing trigger kind",
        RULE + "    trigger: {metric: x}\n    actions: [{type: warn}]\n",
        "'rules.0.trigger' (bad.yaml line 3): needs 'kind' (one of threshold, nonfinite, spike, drop, expression)",
    ),
    (
        "unknown action type",
        RULE + "    when: x > 1\n    actions:\n      - type: rollbak\n",
        "'rules.0.actions.0.type' (bad.yaml line 5): unknown type 'rollbak' (one of rollback, adjust, skip, halt, "
        "warn); did you mean 'rollback'?",
    ),
    (
        "unknown key in an action",
        RULE + "    when: x > 1\n    actions:\n      - type: rollback\n        too: last-good\n",
        "unknown key 'rules.0.actions.0.too' (bad.yaml line 6); did you mean 'rules.0.actions.0.to'?",
    ),
    (
        "misspelt choice",
        RULE + "    when: x > 1\n    actions:\n      - type: rollback\n        to: last_good\n",
        "'rules.0.actions.0.to' (bad.yaml line 6): input should be 'last-good', 'steps_back' or 'best' (got 'last_good'); "
        "did you mean 'last-good'?",
    ),
    (
        "unknown adjust key",
        RULE + "    when: x > 1\n    actions:\n      - type: adjust\n        multiply:\n          actor.lrr: 0.5\n",
        "'rules.0.actions.0.multiply' (bad.yaml line 7): unknown setting 'actor.lrr' (one of actor.lr, "
        "actor.grad_clip, actor.weight_decay, critic.lr, critic.grad_clip, critic.cliprange_value, algorithm.kl_coef, "
        "algorithm.kl_ctrl.target_kl, algorithm.clip_ratio, algorithm.clip_ratio_low, algorithm.clip_ratio_high, "
        "algorithm.clip_ratio_c, algorithm.entropy_coef, rollout.temperature); did you mean 'actor.lr'?",
    ),
    (
        "adjust set to a negative value",
        RULE + "    when: x > 1\n    actions:\n      - type: adjust\n        set: {actor.lr: -1}\n",
        "'rules.0.actions.0.set.actor.lr' (bad.yaml line 6): input should be greater than or equal to 0 (got -1)",
    ),
    (
        "adjust by a zero factor",
        RULE + "    when: x > 1\n    actions:\n      - type: adjust\n        multiply: {actor.lr: 0}\n",
        "'rules.0.actions.0.multiply.actor.lr' (bad.yaml line 6): input should be greater than 0 (got 0)",
    ),
    (
        "adjust adds a non-finite amount",
        RULE + "    when: x > 1\n    actions:\n      - type: adjust\n        add: {actor.lr: .inf}\n",
        "'rules.0.actions.0.add.actor.lr' (bad.yaml line 6): input should be a finite number (got inf)",
    ),
    (
        "adjust bounds a knob it does not change",
        RULE + "    when: x > 1\n    actions:\n      - type: adjust\n        add: {algorithm.kl_coef: 0.01}\n"
        "        max: {actor.lr: 1}\n",
        "'rules.0.actions.0' (bad.yaml line 5): 'max' names actor.lr, which this action does not change; bound only "
        "knobs it changes.",
    ),
    (
        "adjust with an empty range",
        RULE + "    when: x > 1\n    actions:\n      - type: adjust\n        add: {algorithm.kl_coef: 0.01}\n"
        "        min: {algorithm.kl_coef: 0.2}\n        max: {algorithm.kl_coef: 0.1}\n",
        "'rules.0.actions.0' (bad.yaml line 5): the bounds of algorithm.kl_coef are empty: min 0.2 is above max 0.1.",
    ),
    (
        "adjust changes one knob twice",
        RULE + "    when: x > 1\n    actions:\n      - type: adjust\n        set: {actor.lr: 1e-6}\n"
        "        add: {actor.lr: 1e-7}\n",
        "'rules.0.actions.0' (bad.yaml line 5): actor.lr is in both 'set' and 'add'; give each knob one change.",
    ),
    (
        "adjust sets a knob outside its own bounds",
        RULE + "    when: x > 1\n    actions:\n      - type: adjust\n        set: {algorithm.kl_coef: 0.5}\n"
        "        max: {algorithm.kl_coef: 0.1}\n",
        "'rules.0.actions.0' (bad.yaml line 5): set algorithm.kl_coef to 0.5 lies outside its own bounds.",
    ),
    (
        "malformed when expression",
        RULE + "    when: actor/kl / abs(actor/pg_loss) > (0.2 +)\n    actions: [{type: warn}]\n",
        "'rules.0.when' (bad.yaml line 3): at column 39: expected a number, a metric or '(' but found ')'\n"
        "    actor/kl / abs(actor/pg_loss) > (0.2 +)\n" + " " * (4 + 38) + "^ here.",
    ),
    (
        "expression trigger that does not compare",
        RULE + "    trigger: {kind: expression, expr: a + b}\n    actions: [{type: warn}]\n",
        "'rules.0.trigger.expr' (bad.yaml line 3): at column 1: a 'when' expression must compare",
    ),
    (
        "spike with sigma and factor",
        RULE + "    trigger: {kind: spike, metric: g, sigma: 6, factor: 10}\n    actions: [{type: warn}]\n",
        "'rules.0.trigger' (bad.yaml line 3): give exactly one of 'sigma' (mean + k x std) or 'factor'",
    ),
    (
        "spike with neither sigma nor factor",
        RULE + "    trigger:\n      kind: spike\n      metric: g\n    actions: [{type: warn}]\n",
        "'rules.0.trigger' (bad.yaml line 3): give exactly one of 'sigma'",
    ),
    (
        "negative window",
        RULE + "    trigger:\n      kind: spike\n      metric: g\n      sigma: 6\n      window: -4\n"
        "    actions: [{type: warn}]\n",
        "'rules.0.trigger.window' (bad.yaml line 7): input should be greater than or equal to 2 (got -4)",
    ),
    (
        "halt combined with rollback",
        RULE + "    when: x > 1\n    actions: [{type: rollback}, {type: halt}]\n",
        "'rules.0.actions' (bad.yaml line 4): halt ends the run, so it cannot be combined with rollback",
    ),
    (
        "steps_back without its K",
        RULE + "    when: x > 1\n    actions: [{type: rollback, to: steps_back}]\n",
        "'rules.0.actions.0' (bad.yaml line 4): to: steps_back needs 'min_steps_back'",
    ),
    (
        "empty actions",
        RULE + "    when: x > 1\n    actions: []\n",
        "'rules.0.actions' (bad.yaml line 4): list should have at least 1 item after validation, not 0",
    ),
    (
        "empty rules",
        "description: nothing\nrules: []\n",
        "'rules' (bad.yaml line 2): list should have at least 1 item after validation, not 0",
    ),
    ("no rules at all", "description: nothing\n", "'rules': field required"),
    (
        "duplicate rule names",
        RULE
        + "    when: x > 1\n    actions: [{type: warn}]\n  - name: r\n    when: y > 1\n    actions: [{type: warn}]\n",
        "rule name 'r' is used twice: 'rules.0.name' (bad.yaml line 2) and 'rules.1.name' (bad.yaml line 5)",
    ),
    (
        "bad when expression",
        RULE + "    when: actor/ppo_kl >> 0.1\n    actions: [{type: warn}]\n",
        "'rules.0.when' (bad.yaml line 3): at column 15: expected a number, a metric or '(' but found '>'",
    ),
    (
        "when and trigger both",
        RULE + "    when: x > 1\n    trigger: {kind: nonfinite}\n    actions: [{type: warn}]\n",
        "'rules.0' (bad.yaml line 2): give either 'trigger' or 'when', not both",
    ),
    (
        "neither when nor trigger",
        RULE + "    actions: [{type: warn}]\n",
        "'rules.0' (bad.yaml line 2): needs a 'trigger'",
    ),
    (
        "wrong type for value",
        RULE + "    trigger:\n      kind: threshold\n      metric: actor/ppo_kl\n      op: '>'\n      value: high\n"
        "    actions: [{type: warn}]\n",
        "'rules.0.trigger.value' (bad.yaml line 7): input should be a valid number, unable to parse string as a "
        "number (got 'high')",
    ),
    (
        "unknown comparison",
        RULE + "    trigger: {kind: threshold, metric: x, op: '=', value: 1}\n    actions: [{type: warn}]\n",
        "'rules.0.trigger.op' (bad.yaml line 3): input should be '>', '>=', '<' or '<=' (got '=')",
    ),
    (
        "misspelt spike baseline",
        RULE + "    trigger: {kind: spike, metric: g, factor: 10, baseline: medain}\n    actions: [{type: warn}]\n",
        "'rules.0.trigger.baseline' (bad.yaml line 3): input should be 'median' or 'max' (got 'medain'); "
        "did you mean 'median'?",
    ),
    (
        "max_triggers zero",
        RULE + "    when: x > 1\n    actions: [{type: warn}]\n    max_triggers: 0\n",
        "'rules.0.max_triggers' (bad.yaml line 5): input should be greater than or equal to 1 (got 0)",
    ),
    (
        "rule that is not a mapping",
        "rules:\n  - just a string\n",
        "'rules.0' (bad.yaml line 2): input should be a valid dictionary or instance of Rule",
    ),
    (
        "two when lines",  # (PyYAML kept the second: a rule that fired at 5, "valid, 1 rule")
        RULE + "    when: actor/ppo_kl > 0.1\n    actions: [{type: warn}]\n    when: actor/ppo_kl > 5\n",
        "bad.yaml: 'rules.0.when' is given twice: line 3 and line 5; a key is written once in a mapping: keep one",
    ),
    ("file that is not a mapping", "- name: r\n", "bad.yaml must be a mapping of keys to values, got list"),
    ("invalid YAML syntax", RULE + "    actions: [{type: warn\n", "bad.yaml line 4 is not valid YAML"),
]


@pytest.mark.parametrize("text,message", [case[1:] for case in BAD_FILES], ids=[case[0] for case in BAD_FILES])
def test_bad_policy_file_is_one_located_sentence(tmp_path, text, message):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_policy_file(p)
    assert type(err.value) is ConfigError
    assert message in err.value.message
    assert "bad.yaml" in err.value.message
    assert "Traceback" not in err.value.message


def test_bad_policy_names_the_file_and_ends_in_a_sentence(tmp_path):
    p = write(tmp_path, RULE + "    when: x > 1\n    actoins: [{type: warn}]\n")
    with pytest.raises(ConfigError) as err:
        load_policy_file(p)
    # the typo's did-you-mean already names 'actions': no second sentence saying it is missing
    assert err.value.message == (
        f"invalid policy file {p}: unknown key 'rules.0.actoins' (bad.yaml line 4); did you mean 'rules.0.actions'?"
    )


def test_a_policy_file_that_is_not_utf8_names_the_byte(tmp_path):
    from rlctl.commands.policy import policy
    from rlctl.config import load_config

    p = tmp_path / "p.yaml"
    p.write_bytes(b"rules:\n  - name: r\n    description: \xff\xfe\n")
    message = f"policy file {p} is not UTF-8 text: byte 0xff at offset 36 (line 3) cannot be decoded; save it as UTF-8"
    with pytest.raises(ConfigError) as err:
        load_policy_file(p)
    assert err.value.message == message
    cfg = tmp_path / "run.yaml"
    cfg.write_text("policies: [p.yaml]\n")
    with pytest.raises(ConfigError, match="policy file .*p.yaml is not UTF-8 text: byte 0xff at offset 36"):
        load_config(cfg)
    result = CliRunner().invoke(policy, ["check", str(p)])
    assert type(result.exception) is ConfigError and result.exception.message == message


def test_policy_check_refuses_a_key_given_twice_with_exit_3(tmp_path):
    p = write(
        tmp_path, RULE + "    when: actor/ppo_kl > 0.1\n    when: actor/ppo_kl > 5\n    actions: [{type: warn}]\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "rlctl", "policy", "check", str(p)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3 and result.stdout == ""
    assert result.stderr == (
        "Error: bad.yaml: 'rules.0.when' is given twice: line 3 and line 4; a key is written once in a mapping: "
        "keep one\n"
    )


def test_missing_policy_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_policy_file(tmp_path / "nope.yaml")
    assert type(err.value) is ConfigError
    assert err.value.message == f"policy file not found: {tmp_path / 'nope.yaml'}"


def test_inline_policy_errors_name_the_source():
    with pytest.raises(ConfigError) as err:
        validate_policy(
            {"rules": [{"name": "r", "when": "x > 1", "actions": [{"type": "adjust"}]}]}, source="run.yaml policies.0"
        )
    assert err.value.message == (
        "invalid policy run.yaml policies.0: 'rules.0.actions.0': adjust needs 'set', 'multiply' or 'add' with at "
        "least one knob."
    )
    with pytest.raises(ConfigError, match="must be a mapping of keys to values, got str"):
        validate_policy("policies/default.yaml")


# --------------------------------------------------------------------------------------------------
# Evaluator: triggers


def fired(eng: PolicyEngine, rows) -> list[int]:
    """Steps (1-based) on which anything fired."""
    return [step for step, row in enumerate(rows, 1) if eng.evaluate(step, row)]


def test_threshold_fires_above_and_not_below():
    eng = engine({"name": "kl", "when": "actor/ppo_kl > 0.1", "actions": WARN})
    assert fired(eng, [{"actor/ppo_kl": 0.05}, {"actor/ppo_kl": 0.2}, {"actor/ppo_kl": 0.1}, {}]) == [2]
    [f] = engine({"name": "kl", "when": "actor/ppo_kl > 0.1", "actions": WARN}).evaluate(7, {"actor/ppo_kl": 0.3})
    assert (f.rule, f.step, f.metric, f.value, f.limit, f.escalated) == ("kl", 7, "actor/ppo_kl", 0.3, 0.1, False)
    assert f.trigger == "actor/ppo_kl > 0.1"


@pytest.mark.parametrize("op,expected", [(">", [3]), (">=", [2, 3]), ("<", [1]), ("<=", [1, 2])])
def test_threshold_comparisons(op, expected):
    eng = engine(
        {"name": "t", "trigger": {"kind": "threshold", "metric": "m", "op": op, "value": 1.0}, "actions": WARN}
    )
    assert fired(eng, [{"m": 0.5}, {"m": 1}, {"m": 1.5}]) == expected


@pytest.mark.parametrize(
    "row,fires",
    [
        ({"actor/ppo_kl": 0.01, "actor/grad_norm": 1.0, "actor/nonfinite/loss": 0, "actor/skipped_updates": 0}, False),
        ({"actor/pg_loss": math.nan}, True),
        ({"actor/pg_loss": "NaN"}, True),
        ({"actor/grad_norm": "Infinity"}, True),
        ({"actor/grad_norm": -math.inf}, True),
        ({"actor/nonfinite/log_prob": 3}, True),
        ({"actor/skipped_updates": 1}, True),
        ({"note": "a string", "flag": True, "actor/entropy": 1.2}, False),
    ],
)
def test_nonfinite(row, fires):
    eng = engine({"name": "nan", "trigger": {"kind": "nonfinite"}, "actions": [{"type": "rollback"}]})
    assert bool(eng.evaluate(1, row)) is fires


def test_nonfinite_patterns_and_counters_switch():
    eng = engine(
        {"name": "nan", "trigger": {"kind": "nonfinite", "metrics": ["actor/*"], "counters": False}, "actions": WARN}
    )
    assert fired(eng, [{"critic/score/mean": math.nan}, {"actor/nonfinite/loss": 2}, {"actor/pg_loss": "NaN"}]) == [3]
    [f] = engine({"name": "nan", "trigger": {"kind": "nonfinite"}, "actions": WARN}).evaluate(1, {"a": 1, "b": "NaN"})
    assert f.metric == "b" and math.isnan(f.value) and f.limit is None


def spike_rule(**trigger) -> dict:
    return {"name": "spike", "trigger": {"kind": "spike", "metric": "g", **trigger}, "actions": [{"type": "rollback"}]}


def test_spike_sigma_fires_after_min_history_and_outlier_stays_out():
    eng = engine(spike_rule(sigma=3, window=8, min_history=4))
    history = [1.0, 1.1, 0.9, 1.0]
    assert eng.evaluate(1, {"g": 100.0}) == []  # no history yet: not armed
    for step, v in enumerate(history, 2):
        assert eng.evaluate(step, {"g": v}) == []
    state = eng.state_dict()["rules"]["spike"]
    assert state["history"] == [100.0, *history]  # the early big value entered: it was not an outlier then
    eng = engine(spike_rule(sigma=3, window=8, min_history=4))
    for step, v in enumerate(history, 1):
        eng.evaluate(step, {"g": v})
    [f] = eng.evaluate(5, {"g": 5.0})
    assert f.value == 5.0 and 1.0 < f.limit < 1.3 and f.metric == "g"
    assert eng.state_dict()["rules"]["spike"]["history"] == history  # the outlier did not enter
    assert eng.evaluate(6, {"g": 1.05}) == []
    assert eng.state_dict()["rules"]["spike"]["history"] == [*history, 1.05]


def test_spike_ignores_nan_and_windows_slide():
    eng = engine(spike_rule(sigma=3, window=4, min_history=2))
    for step, v in enumerate([1.0, "NaN", 2.0, 3.0, 4.0, 5.0], 1):
        eng.evaluate(step, {"g": v})
    state = eng.state_dict()["rules"]["spike"]
    assert state["history"] == [2.0, 3.0, 4.0, 5.0] and state["history_steps"] == [3, 4, 5, 6]


def test_spike_factor_times_median_and_max():
    median = engine(spike_rule(factor=10, window=16, min_history=3))
    assert fired(median, [{"g": 1.0}, {"g": 2.0}, {"g": 30.0}, {"g": 25.0}, {"g": 9.9}]) == [4]
    # history [1, 2, 30] at step 4: median 2 -> limit 20; 25 fires; step 5: 9.9 < 20
    biggest = engine(spike_rule(factor=1, baseline="max", window=16, min_history=2))
    assert fired(biggest, [{"g": 1.0}, {"g": 2.0}, {"g": 2.0}, {"g": 2.5}]) == [4]


def test_sustained_needs_consecutive_hits_and_resets_on_a_miss():
    eng = engine({"name": "kl", "when": "k > 1", "sustained": 3, "actions": WARN})
    rows = [{"k": 2}, {"k": 2}, {"k": 0}, {"k": 2}, {"k": 2}, {"k": 2}, {"k": 2}, {"k": 2}, {"k": 2}]
    assert fired(eng, rows) == [6, 9]
    assert engine({"name": "kl", "when": "k > 1", "sustained": 2, "actions": WARN}).evaluate(1, {"k": 2}) == []


def test_sustained_counts_consecutive_steps_not_calls():
    eng = engine({"name": "kl", "when": "k > 1", "sustained": 2, "actions": WARN})
    assert eng.evaluate(1, {"k": 2}) == [] and eng.evaluate(3, {"k": 2}) == []  # step 2 never seen
    assert eng.evaluate(4, {"k": 2}) != []


def test_warmup():
    eng = engine({"name": "kl", "when": "k > 1", "warmup": 3, "actions": WARN})
    assert fired(eng, [{"k": 2}] * 5) == [4, 5]
    spike = engine({**spike_rule(sigma=3, window=8, min_history=2), "warmup": 4})
    assert fired(spike, [{"g": 1.0}, {"g": 1.0}, {"g": 50.0}, {"g": 1.0}, {"g": 50.0}]) == [5]
    assert spike.state_dict()["rules"]["spike"]["history"] == [1.0, 1.0, 1.0]  # collected during warm-up


def test_cooldown_skips_the_rule():
    eng = engine({"name": "kl", "when": "k > 1", "cooldown": 2, "actions": WARN})
    assert fired(eng, [{"k": 2}] * 7) == [1, 4, 7]
    assert eng.state_dict()["rules"]["kl"]["cooldown_until"] == 9


def test_max_triggers_escalates_to_halt_or_warn():
    eng = engine(
        {
            "name": "kl",
            "when": "k > 1",
            "max_triggers": 2,
            "actions": [{"type": "rollback"}, {"type": "adjust", "multiply": {"actor.lr": 0.5}}],
        }
    )
    firings = [eng.evaluate(step, {"k": 2})[0] for step in (1, 2, 3)]
    assert [[a.type for a in f.actions] for f in firings] == [["rollback", "adjust"], ["rollback", "adjust"], ["halt"]]
    assert [f.escalated for f in firings] == [False, False, True]
    assert [f.count for f in firings] == [1, 2, 3]
    assert eng.triggers("kl") == 3
    soft = engine({"name": "kl", "when": "k > 1", "max_triggers": 1, "then": "warn", "actions": [{"type": "skip"}]})
    assert [[a.type for a in soft.evaluate(s, {"k": 2})[0].actions] for s in (1, 2, 3)] == [
        ["skip"],
        ["warn"],
        ["warn"],
    ]


def test_rules_fire_in_order_and_healthy_means_no_non_warn_firing():
    eng = engine(
        {"name": "a", "when": "k > 1", "actions": WARN},
        {"name": "b", "when": "k > 5", "actions": [{"type": "rollback"}]},
    )
    assert [f.rule for f in eng.evaluate(1, {"k": 9})] == ["a", "b"]
    assert eng.healthy(1) is False
    assert [f.rule for f in eng.evaluate(2, {"k": 2})] == ["a"]
    assert eng.healthy(2) is True  # a warning does not make a step bad
    assert eng.healthy(3, {"k": 0}) is True  # not evaluated yet: evaluates it
    assert is_healthy([]) is True
    with pytest.raises(ValueError, match="step 9 has not been evaluated"):
        eng.healthy(9)


def test_firing_event_is_json_serialisable_with_nonfinite_as_strings():
    import json

    eng = engine(
        {
            "name": "nan",
            "trigger": {"kind": "nonfinite"},
            "actions": [{"type": "rollback"}, {"type": "skip", "batches": 2}],
        }
    )
    [f] = eng.evaluate(12, {"actor/grad_norm": "Infinity"})
    event = firing_event(f)
    assert json.loads(json.dumps(event, allow_nan=False)) == event
    assert event == {
        "event": "policy",
        "rule": "nan",
        "step": 12,
        "count": 1,
        "stage": 0,
        "escalated": False,
        "trigger": "any metric is NaN or Inf, or a NaN/Inf counter (actor/nonfinite/*, actor/skipped_updates) "
        "is above 0",
        "metric": "actor/grad_norm",
        "value": "Infinity",
        "limit": None,
        "actions": [
            {"type": "rollback", "to": "last-good", "min_steps_back": None},
            {"type": "skip", "batches": 2, "offending": True},
        ],
    }


# --------------------------------------------------------------------------------------------------
# Evaluator: state


def _rows(n: int) -> list[dict]:
    """A run with a KL drift, a NaN and a grad-norm spike, deterministic."""
    rows = []
    for step in range(1, n + 1):
        row = {"actor/ppo_kl": 0.02 + 0.001 * (step % 5), "actor/grad_norm": 1.0 + 0.05 * (step % 7)}
        if step in (30, 31, 60, 61, 62):
            row["actor/ppo_kl"] = 0.3
        if step in (45, 90):
            row["actor/grad_norm"] = 400.0
        if step == 70:
            row["actor/pg_loss"] = "NaN"
        rows.append(row)
    return rows


def test_state_dict_round_trip_continues_identically():
    rules = load_policy_file(REPO / "policies" / "default.yaml").rules
    rows = _rows(120)
    whole = PolicyEngine(rules)
    expected = [firing_event(f) for step, row in enumerate(rows, 1) for f in whole.evaluate(step, row)]
    assert {e["rule"] for e in expected} == {"kl-drift", "grad-spike", "nonfinite"}

    first = PolicyEngine(rules)
    got = [firing_event(f) for step, row in enumerate(rows[:60], 1) for f in first.evaluate(step, row)]
    state = first.state_dict()
    assert state["version"] == 1
    assert set(state["rules"]["grad-spike"]) >= {"triggers", "streak", "cooldown_until", "history", "last_fired"}
    resumed = PolicyEngine(rules)
    resumed.load_state_dict(_via_json(state))
    got += [firing_event(f) for step, row in enumerate(rows[60:], 61) for f in resumed.evaluate(step, row)]
    assert got == expected
    assert resumed.state_dict() == whole.state_dict()


def _via_json(state: dict) -> dict:
    import json

    return json.loads(json.dumps(state))


def test_load_state_dict_checks_the_version_and_tolerates_changed_rules():
    from rlctl.stateful import StateMismatchError

    eng = engine({"name": "a", "when": "k > 1", "actions": WARN})
    with pytest.raises(StateMismatchError, match="policy engine state has version 2"):
        eng.load_state_dict({"version": 2, "rules": {}})
    old = engine({"name": "a", "when": "k > 1", "actions": WARN}, {"name": "gone", "when": "k > 1", "actions": WARN})
    old.evaluate(1, {"k": 2})
    new = engine({"name": "a", "when": "k > 1", "actions": WARN}, {"name": "new", "when": "k > 1", "actions": WARN})
    new.load_state_dict(old.state_dict())
    assert new.triggers("a") == 1 and new.triggers("new") == 0


def guard_with_history():
    from rlctl.policies.guard import PolicyGuard

    guard = PolicyGuard(validate_policy({"rules": [spike_rule(sigma=3, window=8, min_history=2)]}).rules)
    for step, v in enumerate([1.0, 1.2, 1.1], 1):
        guard.check(step, {"g": v})
    guard.skipped_prompts = {3, 5}
    guard.adjustments = [{"step": 2, "changes": {"actor.lr": 1e-5}}]
    return guard


@pytest.mark.parametrize(
    "mangle",
    [
        lambda s: [],  # not a mapping at all
        lambda s: {**s, "version": 7},
        lambda s: {k: v for k, v in s.items() if k != "engine"},
        lambda s: {**s, "engine": "oops"},
        lambda s: {**s, "engine": {"version": 1, "rules": {"spike": {"triggers": "many"}}}},
        lambda s: {**s, "engine": {"version": 1, "rules": {"spike": {**s["engine"]["rules"]["spike"], "history": 3}}}},
        lambda s: {**s, "skipped_prompts": ["x"]},
        lambda s: {**s, "adjustments": 5},
    ],
)
def test_a_policy_state_of_the_wrong_shape_is_a_policy_state_error_and_changes_nothing(mangle):
    from rlctl.policies.guard import PolicyStateError
    from rlctl.stateful import StateMismatchError

    guard = guard_with_history()
    before = _via_json(guard.state_dict())
    with pytest.raises(PolicyStateError) as err:
        guard.load_state_dict(mangle(_via_json(before)))
    assert isinstance(err.value, StateMismatchError) and isinstance(err.value, ValueError)
    assert str(err.value).startswith(("policy state is not readable (", "policy guard state has version"))
    assert _via_json(guard.state_dict()) == before
    fresh = guard_with_history()
    fresh.load_state_dict(before)  # a good one still loads
    assert _via_json(fresh.state_dict()) == before


def test_rewind_forgets_the_future_but_keeps_counts():
    eng = engine({**spike_rule(sigma=3, window=16, min_history=2), "max_triggers": 1})
    for step, v in enumerate([1.0, 1.2, 1.1, 50.0], 1):
        eng.evaluate(step, {"g": v})
    eng.rewind(2)
    state = eng.state_dict()["rules"]["spike"]
    assert state["history_steps"] == [1, 2] and state["triggers"] == 1
    [f] = eng.evaluate(3, {"g": 60.0})
    assert f.escalated and [a.type for a in f.actions] == ["halt"]


# --------------------------------------------------------------------------------------------------
# rlctl policy check


def test_policy_check_explains_in_plain_words():
    from rlctl.commands.policy import policy

    result = CliRunner().invoke(policy, ["check", "policies/default.yaml"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    default = load_policy_file("policies/default.yaml")
    assert lines[0] == f"policies/default.yaml: valid, {len(default.rules)} rules. {default.description}"
    assert (
        "  rule kl-drift: when actor/ppo_kl > 0.05 for 2 consecutive steps (armed after step 10): roll back to a "
        "snapshot at least 10 steps before the event, multiply actor.lr by 0.5 (at least 1e-07); at most 3 times "
        "within 200 steps, then halt; cooldown 10 steps." in lines
    )
    assert [line for line in lines if line.startswith("  rule ")] == [f"  {r.describe()}" for r in default.rules]


def test_policy_check_several_files_and_json():
    import json

    from rlctl.commands.policy import policy

    paths = [str(p) for p in SHIPPED]
    result = CliRunner().invoke(policy, ["check", *paths])
    assert result.exit_code == 0, result.output
    assert result.output.count(": valid, ") == len(paths)
    together = CliRunner().invoke(policy, ["check", "--together", *paths])
    assert isinstance(together.exception, ConfigError) and "is used twice" in together.exception.message
    as_json = CliRunner().invoke(policy, ["check", "--format", "json", "policies/warn-only.yaml"])
    [doc] = json.loads(as_json.output)
    assert doc["file"] == "policies/warn-only.yaml"
    assert doc["rules"][1]["trigger"] == {"kind": "threshold", "metric": "actor/ppo_kl", "op": ">", "value": 0.05}
    for fmt in ("jsonl", "csv"):  # offered once, and the table printed for them
        refused = CliRunner().invoke(policy, ["check", "--format", fmt, "policies/warn-only.yaml"])
        assert refused.exit_code == 2 and f"'{fmt}' is not one of 'table', 'json'" in refused.output, refused.output


def test_policy_check_bad_file_raises_the_config_error(tmp_path):
    from rlctl.commands.policy import policy

    p = write(tmp_path, RULE + "    when: x > 1\n    actions:\n      - type: adjust\n        set: {actor.lrr: 1}\n")
    result = CliRunner().invoke(policy, ["check", str(p)])
    assert result.exit_code != 0
    assert type(result.exception) is ConfigError
    assert "'rules.0.actions.0.set' (bad.yaml line 6): unknown setting 'actor.lrr'" in result.exception.message
    assert "did you mean 'actor.lr'?" in result.exception.message
    assert result.output == ""


@pytest.mark.slow
def test_policy_check_cli_on_expressions_and_bounded_adjust(tmp_path):
    """The real entry point: a malformed expression is exit 3 with the file, line, key and column (no
    traceback); a good one is read back in plain words."""
    bad = write(tmp_path, RULE + '    when: "actor/kl / abs(actor/pg_loss) > (0.2 +)"\n    actions: [{type: warn}]\n')
    result = run_cli("policy", "check", str(bad))
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert (
        f"invalid policy file {bad}: 'rules.0.when' (bad.yaml line 3): at column 39: expected a number, a metric or "
        "'(' but found ')'\n    actor/kl / abs(actor/pg_loss) > (0.2 +)\n" + " " * 42 + "^ here." in result.stderr
    )
    good = write(
        tmp_path,
        RULE + '    when: "actor/kl / abs(actor/pg_loss) > 0.2"\n    sustained: 2\n    actions:\n'
        "      - type: adjust\n        add: {algorithm.kl_coef: 0.01}\n        max: {algorithm.kl_coef: 0.1}\n",
        name="good.yaml",
    )
    result = run_cli("policy", "check", str(good))
    assert result.returncode == 0, result.stderr
    assert (
        "  rule r: when actor/kl / abs(actor/pg_loss) > 0.2 for 2 consecutive steps: add 0.01 to algorithm.kl_coef "
        "(at most 0.1)." in result.stdout.splitlines()
    )


def test_a_bare_name_picks_a_ready_made_policy_from_anywhere(tmp_path, monkeypatch):
    """`policies: [default]` in a run config outside the repository (and `rlctl policy check default`)
    find policies/default.yaml; a file of that name next to the config still wins; a typo is a
    ConfigError with the ready-made names and a did-you-mean."""
    from rlctl.commands.policy import policy
    from rlctl.config import load_config

    monkeypatch.chdir(tmp_path)
    shipped = {p.stem: yaml.safe_load(p.read_text()) for p in SHIPPED}
    for name, stem in (("default", "default"), ("warn-only.yaml", "warn-only")):
        (tmp_path / "run.yaml").write_text(f"policies: [{name}]\ncheckpoint: {{every: 2}}\n")
        assert load_config(str(tmp_path / "run.yaml"), []).policies == [shipped[stem]]
    (tmp_path / "run.yaml").write_text("policies: [default]\n")
    result = CliRunner().invoke(policy, ["check", "default"])
    rules = len(shipped["default"]["rules"])
    assert result.exit_code == 0 and result.output.startswith(f"default: valid, {rules} rules."), result.output

    (tmp_path / "default.yaml").write_text(RULE + "    when: x > 1\n    actions: [{type: warn}]\n")
    (tmp_path / "run.yaml").write_text("policies: [default.yaml]\n")  # a file by that name: the file
    assert load_config(str(tmp_path / "run.yaml"), []).policies[0]["rules"][0]["name"] == "r"

    (tmp_path / "run.yaml").write_text("policies: [defualt]\n")
    with pytest.raises(
        ConfigError,
        match=r"policy file not found: defualt; a bare name picks a ready-made policy: "
        r"agentic, conservative, default, degeneration, val-drop, warn-only \(did you mean 'default'\?\)",
    ):
        load_config(str(tmp_path / "run.yaml"), [])


# --------------------------------------------------------------------------------------------------
# House rules


def test_policies_stay_pure_python():
    pkg = REPO / "rlctl"
    files = [*(pkg / "policies").glob("*.py"), pkg / "commands" / "policy.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            )
            for name in names:
                assert not name.startswith(("torch", "numpy", "deepspeed", "transformers", "rlctl.engine")), (
                    f"{path.name} imports {name}"
                )
    code = (
        "import sys, rlctl.policies, rlctl.commands.policy\n"
        "from click.testing import CliRunner\n"
        "CliRunner().invoke(rlctl.commands.policy.policy, ['check', 'policies/default.yaml'])\n"
        "heavy = [m for m in ('torch', 'numpy', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
