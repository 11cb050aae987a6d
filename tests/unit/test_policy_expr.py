"""The policy expression language (rlctl.policies.expr) and the adjust action's add/min/max: values
computed by hand, a row without a metric as no observation, NaN and division by zero, the canonical text,
and a located message for every kind of mistake."""

import json
import math

import pytest

from rlctl.errors import ConfigError
from rlctl.policies import PolicyEngine, parse_expression, rule_metrics, validate_policy
from rlctl.policies.guard import Adjustment, PolicyGuard
from rlctl.policies.triggers import ExpressionTrigger, ThresholdTrigger

KL_SHARE = "actor/reward_kl_penalty / abs(actor/pg_loss) > 0.2"  # the issue's example


def reading(text, **row):
    """The expression's reading on a row written with '__' for '/' in metric names."""
    return parse_expression(text).evaluate({k.replace("__", "/"): v for k, v in row.items()})


def holds(text, **row) -> bool:
    return reading(text, **row).held


def rules(*specs):
    return validate_policy({"rules": list(specs)}).rules


# --------------------------------------------------------------------------------------------------
# Arithmetic, by hand


@pytest.mark.parametrize(
    "text,x,expected",
    [
        ("1 + 2 * 3 < x", 7, False),  # 7 < 7: * binds tighter than +
        ("1 + 2 * 3 < x", 7.5, True),
        ("(1 + 2) * 3 <= x", 9, True),
        ("x - 2 - 3 == 5", 10, True),  # left to right: (10 - 2) - 3
        ("x - (2 - 3) == 11", 10, True),
        ("x / 2 / 5 == 1", 10, True),
        ("-x * 2 == -6", 3, True),
        ("- -x == 3", 3, True),
        ("-(x - 5) > 0", 3, True),
        ("abs(x) == 4.5", -4.5, True),
        ("min(x, 2, 3) == 2", 7, True),
        ("max(x, 2, 3) == 7", 7, True),
        ("min(x, 1e-3) == .001", 7, True),
        ("x != 2", 2, False),
        ("x >= 2", 2, True),
    ],
)
def test_arithmetic_and_precedence(text, x, expected):
    assert holds(text, x=x) is expected


def test_the_issues_example_on_a_row_reads_both_sides():
    got = reading(KL_SHARE, actor__reward_kl_penalty=0.5, actor__pg_loss=-2.0)
    assert got.held and got.value == 0.25 and got.limit == 0.2
    assert not holds(KL_SHARE, actor__reward_kl_penalty=0.3, actor__pg_loss=-2.0)  # 0.15
    assert parse_expression(KL_SHARE).metrics() == ["actor/reward_kl_penalty", "actor/pg_loss"]
    assert parse_expression(KL_SHARE).subject == "actor/reward_kl_penalty / abs(actor/pg_loss)"


def test_division_by_zero_is_a_signed_infinity_and_zero_over_zero_never_holds():
    assert reading("x / y > 1", x=2, y=0).value == math.inf
    assert reading("x / y < -1", x=2, y=-0.0).value == -math.inf
    assert reading("x / y < -1", x=-2, y=0).held
    zero_over_zero = reading("x / y > 1", x=0, y=0)
    assert math.isnan(zero_over_zero.value) and not zero_over_zero.held
    assert not holds("x / y != 1", x=0, y=0)  # a comparison that meets NaN does not hold, != included


def test_nan_anywhere_makes_the_expression_not_hold():
    assert not holds("x > 1", x="NaN")
    assert not holds("x != 1", x=math.nan)
    assert not holds("not x > 1", x="NaN")  # not of an undecided comparison is still undecided
    assert not holds("x > 1 or y > 1", x="NaN", y=5)
    assert not holds("max(x, y) > 1", x="NaN", y=5)  # min/max propagate NaN whatever the order
    assert not holds("min(y, x) < 100", x="NaN", y=5)
    assert holds("x > 1", x="Infinity")  # infinities are numbers; NaN is the nonfinite trigger's job


def test_a_row_without_a_metric_or_with_a_non_number_is_no_reading():
    assert reading("x > 1 or y > 1", x=5) is None  # y missing: absent even though x alone would decide
    assert reading("x > 1", x="high") is None
    assert reading("x > 1", x=True) is None
    assert reading("x > 1", x=[1]) is None


@pytest.mark.parametrize(
    "x,y,expected",
    [(0.01, 0.9, True), (0.01, 0.1, False), (0.5, 0.9, False)],
)
def test_and_or_not(x, y, expected):
    text = "actor/entropy < 0.05 and response/degenerate_frac > 0.5"
    assert holds(text, actor__entropy=x, response__degenerate_frac=y) is expected
    assert reading(text, actor__entropy=x, response__degenerate_frac=y).value is None  # no single side to show
    assert holds(f"not ({text})", actor__entropy=x, response__degenerate_frac=y) is not expected
    assert holds("x > 1 or y > 1 and z > 1", x=0, y=2, z=0) is False  # and binds tighter than or
    assert holds("(x > 1 or y > 1) and z > 1", x=2, y=0, z=2) is True


def test_metric_names_keep_slashes_dashes_and_at_signs():
    e = parse_expression("val/score@8 - train/a-b:c > x.y_z")
    assert e.metrics() == ["val/score@8", "train/a-b:c", "x.y_z"]
    assert parse_expression("a/b > 1").metrics() == ["a/b"]  # one name: division needs spaces


@pytest.mark.parametrize(
    "text,canonical",
    [
        (KL_SHARE, KL_SHARE),
        ("a>.5", "a > 0.5"),
        ("((a)) + (b * c) > 1e-3", "a + b * c > 0.001"),
        ("(a + b) * c > 1", "(a + b) * c > 1"),
        ("a - (b - c) > 0", "a - (b - c) > 0"),
        ("a / (b * c) > 0", "a / (b * c) > 0"),
        ("-(a + b) > 0", "-(a + b) > 0"),
        ("min(a,b ,3)>=max( a,2 )", "min(a, b, 3) >= max(a, 2)"),
        ("not (a > 1 and b > 1) or c > 1", "not (a > 1 and b > 1) or c > 1"),
        ("(a > 1 or b > 1) and c > 1", "(a > 1 or b > 1) and c > 1"),
        ("a > 1 or (b > 1 and c > 1)", "a > 1 or b > 1 and c > 1"),
        ("not not a > 1", "not not a > 1"),
        ("a > 0.1 + 0.2", "a > 0.1 + 0.2"),
        ("a > 1.0000000001", "a > 1.0000000001"),  # exact, not %g's 1
    ],
)
def test_describe_is_canonical_and_round_trips(text, canonical):
    assert parse_expression(text).describe() == canonical
    again = parse_expression(canonical)
    assert again.describe() == canonical
    for row in ({"a": 0.7, "b": 2.0, "c": 3.0}, {"a": 5.0, "b": -1.0, "c": 0.5}):
        assert parse_expression(text).evaluate(row) == again.evaluate(row)


# --------------------------------------------------------------------------------------------------
# Mistakes, each located


@pytest.mark.parametrize(
    "text,col,message",
    [
        ("a > (b +)", 9, "expected a number, a metric or '(' but found ')'"),
        ("a >", 4, "expected a number, a metric or '(' but found the end"),
        ("", 1, "expected a number, a metric or '(' but found the end"),
        ("(a > 1", 7, "expected ')' but found the end"),
        ("a > 1 b", 7, "expected an operator, 'and', 'or' or the end but found 'b'"),
        (
            "a > 1 AND b > 1",
            7,
            "expected an operator, 'and', 'or' or the end but found 'AND'; operators are lowercase: 'and'",
        ),
        ("a < b < c", 7, "comparisons do not chain; write 'a < b and b < c'"),
        ("a + 1", 1, "a 'when' expression must compare, e.g. 'actor/ppo_kl > 0.2', but this one is a number"),
        ("1 > 0", 1, "the expression reads no metric, so it would always or never hold"),
        ("a = 1", 3, "unexpected character '='; did you mean '=='?"),
        ("a > 1 && b > 1", 7, "unexpected character '&'; did you mean 'and'?"),
        ("a ^ 2 > 1", 3, "unexpected character '^'; there is no power operator: multiply"),
        ("a > 1e", 5, "'1e' is not a number"),
        ("a > 1.2.3", 5, "'1.2.3' is not a number"),
        ("a > 1e999", 5, "1e999 is too large a number"),
        ("a > 1 and 2", 11, "'and' joins comparisons, but '2' is a number (compare it, e.g. '2 > 0')"),
        ("not a", 5, "'not' takes a comparison, but 'a' is a number (compare it, e.g. 'a > 0')"),
        ("(a > 1) + 1 > 0", 2, "'+' works on numbers, but 'a > 1' is a condition"),
        ("-(a > 1) > 0", 3, "'-' works on numbers, but 'a > 1' is a condition"),
        ("(a > 1) > 0", 2, "'>' compares numbers, but 'a > 1' is a condition"),
        ("lg(a) > 1", 1, "unknown function 'lg' (one of abs, min, max)"),
        ("mx(a, b) > 1", 1, "unknown function 'mx' (one of abs, min, max); did you mean 'max'?"),
        ("abs(a, b) > 1", 8, "abs() takes one argument"),
        ("min(a) > 1", 1, "min() takes at least two arguments"),
        ("max(a b) > 1", 7, "expected ')' but found 'b'"),
    ],
)
def test_every_mistake_names_its_column_with_a_caret(text, col, message):
    with pytest.raises(ValueError) as err:
        parse_expression(text)
    first, shown, caret = str(err.value).split("\n")
    assert first == f"at column {col}: {message}"
    assert shown == f"    {text}"
    assert caret == " " * (4 + col - 1) + "^ here"


# --------------------------------------------------------------------------------------------------
# In rules


def test_when_stays_a_threshold_when_it_is_metric_op_number():
    for text, (metric, op, value) in [
        ("actor/ppo_kl > 0.05", ("actor/ppo_kl", ">", 0.05)),
        ("x<=-1", ("x", "<=", -1.0)),
        ("  val/score/mean >= 1e-3 ", ("val/score/mean", ">=", 0.001)),
    ]:
        (rule,) = rules({"name": "r", "when": text, "actions": [{"type": "warn"}]})
        assert rule.resolved_trigger == ThresholdTrigger(kind="threshold", metric=metric, op=op, value=value)
    for text in ("x == 1", "abs(x) > 1", "x > y", "1 < x", "x > 1 + 1"):
        (rule,) = rules({"name": "r", "when": text, "actions": [{"type": "warn"}]})
        assert rule.resolved_trigger == ExpressionTrigger(kind="expression", expr=text)


def test_rule_metrics_of_every_trigger_kind():
    found = rules(
        {"name": "a", "when": "x > 1", "actions": [{"type": "warn"}]},
        {"name": "b", "when": KL_SHARE + " or actor/pg_loss < -5", "actions": [{"type": "warn"}]},
        {"name": "c", "trigger": {"kind": "nonfinite", "metrics": ["actor/*", "x"]}, "actions": [{"type": "warn"}]},
        {"name": "d", "trigger": {"kind": "spike", "metric": "g", "sigma": 6}, "actions": [{"type": "warn"}]},
        {"name": "e", "trigger": {"kind": "drop", "metric": "val/s", "amount": 1}, "actions": [{"type": "warn"}]},
    )
    assert [rule_metrics(r) for r in found] == [
        ["x"],
        ["actor/reward_kl_penalty", "actor/pg_loss"],
        ["actor/*", "x"],
        ["g"],
        ["val/s"],
    ]


def test_an_expression_rule_fires_with_both_sides_and_a_missing_metric_neither_grows_nor_breaks_the_streak():
    rule = {"name": "kl-share", "when": KL_SHARE, "sustained": 3, "actions": [{"type": "warn"}]}
    engine = PolicyEngine(rules(rule))
    hot = {"actor/reward_kl_penalty": 0.5, "actor/pg_loss": -2.0}
    assert engine.evaluate(1, hot) == []
    assert engine.evaluate(2, {"actor/reward_kl_penalty": 0.5}) == []  # absent: the streak waits
    assert engine.evaluate(3, hot) == []
    (firing,) = engine.evaluate(4, hot)  # the third observation that held
    assert (firing.metric, firing.value, firing.limit) == ("actor/reward_kl_penalty / abs(actor/pg_loss)", 0.25, 0.2)
    assert firing.trigger == KL_SHARE + " for 3 consecutive steps"
    json.dumps(firing.as_event())
    engine.evaluate(5, hot)
    engine.evaluate(6, {**hot, "actor/pg_loss": "NaN"})  # NaN: not held, so the streak breaks
    assert engine.evaluate(7, hot) == [] and engine.evaluate(8, hot) == []
    assert engine.state_dict()["rules"]["kl-share"]["streak"] == 2


def test_a_firing_of_a_combination_names_the_whole_expression():
    text = "actor/entropy < 0.05 and response/degenerate_frac > 0.5"
    engine = PolicyEngine(rules({"name": "collapse", "when": text, "actions": [{"type": "warn"}]}))
    (firing,) = engine.evaluate(1, {"actor/entropy": 0.01, "response/degenerate_frac": 1})
    assert (firing.metric, firing.value, firing.limit) == (text, None, None)
    assert json.loads(json.dumps(firing.as_event()))["metric"] == text


def test_an_expression_trigger_written_out():
    (rule,) = rules(
        {"name": "r", "trigger": {"kind": "expression", "expr": "a/b - 1>0"}, "actions": [{"type": "warn"}]}
    )
    assert rule.describe() == "rule r: when a/b - 1 > 0: log a warning."
    assert rule_metrics(rule) == ["a/b"]


def test_a_bad_when_is_one_located_config_error():
    with pytest.raises(ConfigError) as err:
        validate_policy({"rules": [{"name": "r", "when": "a < b < c", "actions": [{"type": "warn"}]}]}, source="x")
    assert err.value.message.startswith(
        "invalid policy x: 'rules.0.when': at column 7: comparisons do not chain; write 'a < b and b < c'\n"
    )


@pytest.mark.parametrize(
    ("text", "col"),
    [
        ("(" * 120 + "a > 1" + ")" * 120, 65),  # the 65th '('
        ("not " * 100 + "a > 1", 257),  # the 65th 'not'
        ("-" * 200 + "a > 1", 65),
        ("abs(" * 70 + "a" + ")" * 70 + " > 1", 257),
        ("a" + " + a" * 300 + " > 1", 255),  # a flat sum is a tree too: the 64th '+' makes it 65 deep
        ("a > 1" + " and a > 1" * 200, 627),
    ],
)
def test_an_expression_nested_too_deeply_is_a_located_error_not_a_recursion_error(text, col):
    with pytest.raises(ValueError) as err:
        parse_expression(text)
    first = str(err.value).split("\n")[0]
    assert first.startswith(f"at column {col}: expression nested too deeply (more than 64 levels")
    with pytest.raises(ConfigError) as err:
        validate_policy({"rules": [{"name": "r", "when": text, "actions": [{"type": "warn"}]}]}, source="deep.yaml")
    assert "'rules.0.when': at column" in err.value.message and "nested too deeply" in err.value.message


def test_nesting_up_to_the_limit_parses_and_evaluates():
    deep = parse_expression("(" * 63 + "a > 1" + ")" * 63)
    assert deep.evaluate({"a": 2}).held and deep.describe() == "a > 1"
    long = parse_expression("a" + " + a" * 62 + " > 1")  # 63 additions and the comparison: 64 levels
    assert long.root.height == 64 and long.evaluate({"a": 1}).value == 63
    assert parse_expression("-" * 62 + "a > 1").evaluate({"a": 2}).held  # an even number of '-'


# --------------------------------------------------------------------------------------------------
# Adjust: set, multiply, add, with bounds


def test_adjust_merges_in_rule_order_with_bounds():
    guard = PolicyGuard(
        rules(
            {
                "name": "kl",
                "when": "k > 1",
                "actions": [
                    {
                        "type": "adjust",
                        "add": {"algorithm.kl_ctrl.target_kl": -0.005},
                        "multiply": {"algorithm.kl_coef": 1.2},
                        "set": {"actor.grad_clip": 1.0},
                        "min": {"algorithm.kl_ctrl.target_kl": 0.001},
                        "max": {"algorithm.kl_coef": 0.1},
                    }
                ],
            },
            {"name": "lr", "when": "g > 10", "actions": [{"type": "adjust", "set": {"algorithm.kl_coef": 0}}]},
        )
    )
    verdict = guard.check(1, {"k": 2, "g": 11})
    assert verdict.adjust == [
        Adjustment("actor.grad_clip", "set", 1.0),
        Adjustment("algorithm.kl_coef", "multiply", 1.2, max=0.1),
        Adjustment("algorithm.kl_ctrl.target_kl", "add", -0.005, min=0.001),
        Adjustment("algorithm.kl_coef", "set", 0.0),
    ]
    assert verdict.recovers and not verdict.good


def test_adjust_says_what_it_does():
    (rule,) = rules(
        {
            "name": "r",
            "when": "x > 1",
            "actions": [
                {
                    "type": "adjust",
                    "set": {"algorithm.kl_coef": 0},
                    "multiply": {"actor.lr": 0.5},
                    "add": {"algorithm.entropy_coef": 0.01, "algorithm.kl_ctrl.target_kl": -0.005},
                    "min": {"actor.lr": 1e-7, "algorithm.kl_ctrl.target_kl": 0.001},
                    "max": {"actor.lr": 1e-5, "algorithm.entropy_coef": 0.1},
                }
            ],
        }
    )
    assert rule.actions[0].describe() == (
        "set algorithm.kl_coef to 0, multiply actor.lr by 0.5 (between 1e-07 and 1e-05), "
        "add 0.01 to algorithm.entropy_coef (at most 0.1), "
        "subtract 0.005 from algorithm.kl_ctrl.target_kl (at least 0.001)"
    )
