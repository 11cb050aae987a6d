"""The rollback-policy schema: strict pydantic models, each field described, each able to say what it
does in plain words.

A policy file holds ``rules``; a rule is a *trigger* (threshold, nonfinite, spike, drop or expression,
told apart by ``kind``), how long it must hold (``sustained``), when it is armed (``warmup``), the
*actions* to take (rollback, adjust, skip, halt, warn, told apart by ``type``) and the limits that keep
a run from looping forever (``max_triggers`` then ``then``, ``cooldown``). ``when: "actor/ppo_kl > 0.05"`` on a rule is sugar
for a threshold trigger; any other ``when`` is an expression over several metrics (``rlctl.policies.expr``).
``adjust`` changes the knobs of ``rlctl.policies.knobs`` (set, multiply or add, within optional bounds).

Rule names must be unique within a set of rules; the loader and the evaluator check that (across files
too), because only they know where the rules came from. A run config names its policies by
``PolicySpec``: a file, a ready-made policy's name, or the policy inline.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, NoReturn, get_args

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, field_validator, model_validator

from rlctl.policies.expr import Binary, Expression, Metric, Negate, Number, parse_expression
from rlctl.policies.knobs import KNOBS

Mode = Literal["max", "min"]


class PolicyModel(BaseModel):
    """Strict: an unknown key is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid")


def _num(value: float) -> str:
    """A number as a person writes it: 0.05, 1e-06, 10."""
    return f"{value:g}"


def _fail(message: str) -> NoReturn:
    """Reject a model in a validator (pydantic turns the ValueError into a located error)."""
    raise ValueError(message)


# --------------------------------------------------------------------------------------------------
# Triggers

Op = Literal[">", ">=", "<", "<="]


class ThresholdTrigger(PolicyModel):
    kind: Literal["threshold"] = Field(description="Fires when one metric crosses a fixed value.")
    metric: str = Field(min_length=1, description="Metric key of a step's row, e.g. actor/ppo_kl or actor/grad_norm.")
    op: Op = Field(description="Comparison of the metric's value against `value`: >, >=, < or <=.")
    value: float = Field(allow_inf_nan=False, description="The threshold the metric is compared to.")

    def describe(self) -> str:
        return f"{self.metric} {self.op} {_num(self.value)}"


class NonfiniteTrigger(PolicyModel):
    kind: Literal["nonfinite"] = Field(description="Fires when a metric is NaN or Inf.")
    metrics: list[str] = Field(
        default_factory=lambda: ["*"],
        min_length=1,
        description="Glob patterns (fnmatch) of the metric keys to watch; '*' watches every metric.",
    )
    counters: bool = Field(
        True,
        description="Also fire when a NaN/Inf counter (actor/nonfinite/*) or actor/skipped_updates is above 0.",
    )

    def describe(self) -> str:
        watched = "any metric" if self.metrics == ["*"] else "a metric matching " + ", ".join(self.metrics)
        text = f"{watched} is NaN or Inf"
        if self.counters:
            text += ", or a NaN/Inf counter (actor/nonfinite/*, actor/skipped_updates) is above 0"
        return text


class SpikeTrigger(PolicyModel):
    kind: Literal["spike"] = Field(description="Fires when a metric jumps far above its own recent history.")
    metric: str = Field(min_length=1, description="Metric key whose history is watched, e.g. actor/grad_norm.")
    window: int = Field(128, ge=2, description="How many recent finite values form the history.")
    min_history: int = Field(
        16, ge=2, description="The trigger is not armed until the history holds this many finite values."
    )
    sigma: float | None = Field(
        None, gt=0, description="Fire when value > mean + sigma x std of the history (OLMo-core uses 6 over 128)."
    )
    factor: float | None = Field(
        None, ge=1, description="Fire when value > factor x the history's `baseline` (Megatron uses 10)."
    )
    baseline: Literal["median", "max"] = Field(
        "median", description="With `factor`: compare against the history's median or its max."
    )

    @model_validator(mode="after")
    def _one_rule(self) -> SpikeTrigger:
        if (self.sigma is None) == (self.factor is None):
            raise ValueError("give exactly one of 'sigma' (mean + k x std) or 'factor' (f x median or max)")
        if self.sigma is not None and "baseline" in self.model_fields_set:
            raise ValueError("'baseline' goes with 'factor', not with 'sigma'")
        if self.min_history > self.window:
            raise ValueError(f"'min_history' ({self.min_history}) cannot exceed 'window' ({self.window})")
        return self

    def describe(self) -> str:
        if self.sigma is not None:
            limit = f"mean + {_num(self.sigma)} std"
        else:
            limit = f"{_num(self.factor)} x the {self.baseline}"  # type: ignore[arg-type]
        return (
            f"{self.metric} rises above {limit} of its last {self.window} finite values, "
            f"once {self.min_history} are known"
        )


class DropTrigger(PolicyModel):
    kind: Literal["drop"] = Field(
        description="Fires when a metric falls from its best so far (or its recent median) by more than a margin, "
        "e.g. validation accuracy; what practitioners roll back on by hand."
    )
    metric: str = Field(
        min_length=1,
        description="Metric key watched, e.g. val/score/mean. Rows without it (steps between validations) and "
        "NaN/Inf values are not observations: they neither hold nor break a streak and are not remembered.",
    )
    mode: Mode = Field(
        "max", description="max: higher is better, so a drop is a fall; min: lower is better, so a drop is a rise."
    )
    baseline: Literal["best", "median"] = Field(
        "best", description="Compare against the best value so far, or the median of the last `window` values."
    )
    window: int = Field(
        5, ge=1, description="With baseline: median, how many recent values (that did not break the rule) count."
    )
    min_history: int = Field(1, ge=1, description="The trigger is not armed until this many values have been seen.")
    amount: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Fire when the value is more than this far past the baseline."
    )
    fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fire when the value is more than this fraction of |baseline| past it (0.05: 5%).",
    )

    @model_validator(mode="after")
    def _one_margin(self) -> DropTrigger:
        if (self.amount is None) == (self.fraction is None):
            raise ValueError("give exactly one of 'amount' (an absolute margin) or 'fraction' (of the baseline)")
        if self.baseline == "best" and "window" in self.model_fields_set:
            raise ValueError("'window' goes with baseline: median, not with baseline: best")
        return self

    def describe(self) -> str:
        margin = _num(self.amount) if self.amount is not None else f"{_num(self.fraction * 100)}%"  # type: ignore[operator]
        moves = "falls more than {} below" if self.mode == "max" else "rises more than {} above"
        if self.baseline == "median":
            base = "its last value" if self.window == 1 else f"the median of its last {self.window} values"
        else:
            base = "its best so far" if self.mode == "max" else "its best (lowest) so far"
        text = f"{self.metric} {moves.format(margin)} {base}"
        if self.min_history > 1:
            text += f", once {self.min_history} values are known"
        return text


class ExpressionTrigger(PolicyModel):
    kind: Literal["expression"] = Field(
        description="Fires when an expression over one or more metrics holds, e.g. "
        "'actor/reward_kl_penalty / abs(actor/pg_loss) > 0.2'."
    )
    expr: str = Field(
        min_length=1,
        description="The condition: metrics, numbers, + - * /, abs() min() max(), comparisons (> >= < <= == !=) "
        "joined by and/or/not. A row without one of its metrics is no observation; a comparison meeting NaN does "
        "not hold.",
    )

    @field_validator("expr")
    @classmethod
    def _expr_parses(cls, v: str) -> str:
        parse_expression(v)
        return v

    @property
    def parsed(self) -> Expression:
        """The expression's tree (parsed once per text)."""
        return parse_expression(self.expr)

    def describe(self) -> str:
        return self.parsed.describe()


Trigger = Annotated[
    ThresholdTrigger | NonfiniteTrigger | SpikeTrigger | DropTrigger | ExpressionTrigger, Field(discriminator="kind")
]
AnyTrigger = ThresholdTrigger | NonfiniteTrigger | SpikeTrigger | DropTrigger | ExpressionTrigger


def parse_when(text: str) -> ThresholdTrigger | ExpressionTrigger:
    """A rule's ``when``: exactly ``METRIC OP NUMBER`` (``"actor/ppo_kl > 0.05"``) is the threshold trigger it
    stands for, anything else an expression trigger; ValueError (with the column) when malformed."""
    root = parse_expression(text).root
    if isinstance(root, Binary) and root.op in get_args(Op):
        limit = root.right
        sign = -1.0 if isinstance(limit, Negate) else 1.0
        limit = limit.operand if isinstance(limit, Negate) else limit
        if isinstance(root.left, Metric) and isinstance(limit, Number):
            return ThresholdTrigger(kind="threshold", metric=root.left.name, op=root.op, value=sign * limit.value)
    return ExpressionTrigger(kind="expression", expr=text)


def trigger_metrics(trigger: AnyTrigger) -> list[str]:
    """The metric names a trigger reads; for a nonfinite trigger, its glob patterns."""
    if isinstance(trigger, NonfiniteTrigger):
        return list(trigger.metrics)
    if isinstance(trigger, ExpressionTrigger):
        return trigger.parsed.metrics()
    return [trigger.metric]


# --------------------------------------------------------------------------------------------------
# Actions

AdjustKey = Literal[tuple(KNOBS)]  # type: ignore[valid-type]  # the knobs, in their documented order
NonNegative = Annotated[FiniteFloat, Field(ge=0)]
Positive = Annotated[FiniteFloat, Field(gt=0)]
AdjustOp = Literal["set", "multiply", "add"]


class RollbackAction(PolicyModel):
    type: Literal["rollback"] = Field(description="Restore an earlier snapshot and train on from there.")
    to: Literal["last-good", "steps_back", "best"] = Field(
        "last-good",
        description="last-good: the newest snapshot of a good step; steps_back: a snapshot at least "
        "`min_steps_back` steps before the event (PaLM restarted about 100 steps before a spike); best: the "
        "snapshot with the best value of the rule's drop metric (only with a `kind: drop` trigger), else last-good.",
    )
    min_steps_back: int | None = Field(
        None, ge=1, description="With to: steps_back, how many steps before the event the snapshot must be."
    )

    @model_validator(mode="after")
    def _steps_back_needs_k(self) -> RollbackAction:
        if self.to == "steps_back" and self.min_steps_back is None:
            raise ValueError("to: steps_back needs 'min_steps_back'")
        if self.to != "steps_back" and self.min_steps_back is not None:
            raise ValueError("'min_steps_back' goes with to: steps_back")
        return self

    def describe(self, trigger: PolicyModel | None = None) -> str:
        """In plain words; ``trigger`` is the rule's, which says what "best" means for to: best."""
        if self.to == "steps_back":
            return f"roll back to a snapshot at least {self.min_steps_back} steps before the event"
        if self.to == "best":
            best = "the best"
            if isinstance(trigger, DropTrigger):
                best = f"the {'highest' if trigger.mode == 'max' else 'lowest'} {trigger.metric}"
            return f"roll back to the snapshot with {best} (else the last good snapshot)"
        return "roll back to the last good snapshot"


class AdjustAction(PolicyModel):
    type: Literal["adjust"] = Field(
        description="Change knobs of the run from now on (rlctl.policies.knobs: the settings safe to change mid-run)."
    )
    set: dict[AdjustKey, NonNegative] = Field(
        default_factory=dict, description="Knobs to replace, e.g. {actor.lr: 1.0e-7}; 0 is allowed (kl_coef: 0)."
    )
    multiply: dict[AdjustKey, Positive] = Field(
        default_factory=dict, description="Knobs to scale, e.g. {actor.lr: 0.5} halves the learning rate."
    )
    add: dict[AdjustKey, FiniteFloat] = Field(
        default_factory=dict,
        description="Amounts to add to knobs (negative to subtract), e.g. {algorithm.kl_ctrl.target_kl: -0.005}.",
    )
    min: dict[AdjustKey, FiniteFloat] = Field(
        default_factory=dict,
        description="Lower bounds of knobs this action changes: after the change the knob is at least this, "
        "so repeated firings cannot run it away.",
    )
    max: dict[AdjustKey, FiniteFloat] = Field(
        default_factory=dict, description="Upper bounds of knobs this action changes: after the change, at most this."
    )

    def changes(self) -> list[tuple[str, AdjustOp, float]]:
        """(knob, op, value) of each change, in the order set, multiply, add."""
        ops: list[tuple[AdjustOp, dict[str, float]]] = [
            ("set", self.set),
            ("multiply", self.multiply),
            ("add", self.add),
        ]
        return [(key, op, value) for op, values in ops for key, value in values.items()]

    @model_validator(mode="after")
    def _changes_fit(self) -> AdjustAction:
        changes = self.changes()
        if not changes:
            _fail("adjust needs 'set', 'multiply' or 'add' with at least one knob")
        ops: dict[str, list[str]] = {}
        for key, op, _ in changes:
            ops.setdefault(key, []).append(op)
        for key, used in ops.items():
            if len(used) > 1:
                _fail(f"{key} is in both '{used[0]}' and '{used[1]}'; give each knob one change")
        for bound in ("min", "max"):
            for key in getattr(self, bound):
                if key not in ops:
                    _fail(f"'{bound}' names {key}, which this action does not change; bound only knobs it changes")
        for key, lo in self.min.items():
            if key in self.max and lo > self.max[key]:
                _fail(f"the bounds of {key} are empty: min {_num(lo)} is above max {_num(self.max[key])}")
        for key, value in self.set.items():
            if not self.min.get(key, value) <= value <= self.max.get(key, value):
                _fail(f"set {key} to {_num(value)} lies outside its own bounds")
        return self

    def describe(self) -> str:
        words = {"set": "set {k} to {v}", "multiply": "multiply {k} by {v}", "add": "add {v} to {k}"}
        parts = []
        for key, op, value in self.changes():
            if op == "add" and value < 0:
                text = f"subtract {_num(-value)} from {key}"
            else:
                text = words[op].format(k=key, v=_num(value))
            parts.append(text + self._bounds(key))
        return ", ".join(parts)

    def _bounds(self, key: str) -> str:
        lo, hi = self.min.get(key), self.max.get(key)
        if lo is not None and hi is not None:
            return f" (between {_num(lo)} and {_num(hi)})"
        if lo is not None:
            return f" (at least {_num(lo)})"
        return f" (at most {_num(hi)})" if hi is not None else ""


class SkipAction(PolicyModel):
    type: Literal["skip"] = Field(description="Skip data: the offending step's prompts and/or the next batches.")
    batches: int = Field(0, ge=0, description="How many of the next batches of prompts to skip.")
    offending: bool = Field(True, description="Skip the prompts of the step that fired the rule.")

    @model_validator(mode="after")
    def _skips_something(self) -> SkipAction:
        if self.batches == 0 and not self.offending:
            raise ValueError("skip with batches: 0 and offending: false skips nothing")
        return self

    def describe(self) -> str:
        parts = ["the offending step's prompts"] if self.offending else []
        if self.batches:
            parts.append("the next batch" if self.batches == 1 else f"the next {self.batches} batches")
        return "skip " + " and ".join(parts)


class HaltAction(PolicyModel):
    type: Literal["halt"] = Field(description="Stop the run (it exits with the documented policy-halt code).")

    def describe(self) -> str:
        return "halt the run"


class WarnAction(PolicyModel):
    type: Literal["warn"] = Field(description="Only record an event and a warning; training goes on.")

    def describe(self) -> str:
        return "log a warning"


Action = Annotated[RollbackAction | AdjustAction | SkipAction | HaltAction | WarnAction, Field(discriminator="type")]

_ENDS_RUN_ALONE = {"rollback", "adjust", "skip"}  # what halt cannot be combined with


# --------------------------------------------------------------------------------------------------
# Rules and files

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class Rule(PolicyModel):
    name: str = Field(description="Unique name of the rule, used in events and messages (letters, digits, - _ .).")
    description: str = Field("", description="What the rule is for, in plain words.")
    trigger: Trigger | None = Field(
        None,
        description="What fires the rule: a threshold, nonfinite, spike, drop or expression trigger, chosen by `kind`.",
    )
    when: str | None = Field(
        None,
        description='Instead of `trigger`: "METRIC OP NUMBER" (a threshold trigger, e.g. "actor/ppo_kl > 0.05") or '
        'any expression (e.g. "actor/entropy < 0.05 and response/degenerate_frac > 0.5").',
    )
    sustained: int = Field(
        1,
        ge=1,
        description="Fire only after the condition held this many consecutive steps; a row without the metric "
        "(e.g. between validations) neither holds nor breaks the streak.",
    )
    warmup: int = Field(
        0, ge=0, description="Not armed until step > warmup (a spike's or drop's history is still collected)."
    )
    actions: list[Action] = Field(
        min_length=1, description="What to do when the rule fires; combinable, each chosen by `type`."
    )
    max_triggers: int | None = Field(
        None, ge=1, description="Fire the actions at most this many times; after that, do `then` instead."
    )
    then: Literal["halt", "warn"] = Field(
        "halt", description="What to do once `max_triggers` is exhausted, so a run cannot loop forever."
    )
    cooldown: int = Field(0, ge=0, description="After firing, do not evaluate the rule for this many steps.")

    @field_validator("name")
    @classmethod
    def _name_is_a_word(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"must be letters, digits, '-', '_' or '.', starting with a letter or digit, got {v!r}")
        return v

    @field_validator("when")
    @classmethod
    def _when_parses(cls, v: str | None) -> str | None:
        if v is not None:
            parse_when(v)
        return v

    @field_validator("actions")
    @classmethod
    def _actions_combine(cls, actions: list) -> list:
        types = [a.type for a in actions]
        twice = sorted({t for t in types if types.count(t) > 1})
        if twice:
            raise ValueError(f"action type {', '.join(twice)} is listed more than once; merge them")
        if "halt" in types and _ENDS_RUN_ALONE & set(types):
            others = ", ".join(t for t in types if t in _ENDS_RUN_ALONE)
            raise ValueError(f"halt ends the run, so it cannot be combined with {others}")
        return actions

    @model_validator(mode="after")
    def _one_trigger(self) -> Rule:
        if self.trigger is not None and self.when is not None:
            raise ValueError("give either 'trigger' or 'when', not both")
        if self.when is not None:
            self.trigger = parse_when(self.when)
        if self.trigger is None:
            raise ValueError(
                "needs a 'trigger' (kind: threshold, nonfinite, spike, drop or expression) or a 'when' expression"
            )
        return self

    @model_validator(mode="after")
    def _best_needs_a_drop(self) -> Rule:
        best = any(isinstance(a, RollbackAction) and a.to == "best" for a in self.actions)
        if best and not isinstance(self.trigger, DropTrigger):
            raise ValueError(
                f"rollback to: best needs a drop trigger (kind: drop), whose metric and mode say which snapshot "
                f"is best; this rule's trigger is {self.resolved_trigger.kind}"
            )
        return self

    @property
    def resolved_trigger(self) -> AnyTrigger:
        """The trigger, whether written as `trigger` or as `when` (validation guarantees one)."""
        assert self.trigger is not None
        return self.trigger

    def describe_condition(self, warmup: bool = True) -> str:
        """'actor/ppo_kl > 0.05 for 3 consecutive steps (armed after step 10)'."""
        trigger = self.resolved_trigger
        text = trigger.describe()
        if self.sustained > 1:
            # a drop's metric is usually in some rows only (validations), so count its values, not steps
            in_a_row = " on {} values in a row" if isinstance(trigger, DropTrigger) else " for {} consecutive steps"
            text += in_a_row.format(self.sustained)
        if warmup and self.warmup:
            text += f" (armed after step {self.warmup})"
        return text

    def describe(self) -> str:
        """The whole rule as one sentence, as ``rlctl policy check`` prints it."""
        actions = ", ".join(
            a.describe(self.resolved_trigger) if isinstance(a, RollbackAction) else a.describe() for a in self.actions
        )
        limits = []
        if self.max_triggers is not None:
            times = "once" if self.max_triggers == 1 else f"{self.max_triggers} times"
            limits.append(f"at most {times}, then {self.then}")
        if self.cooldown:
            limits.append(f"cooldown {self.cooldown} step{'s' if self.cooldown > 1 else ''}")
        tail = "".join(f"; {part}" for part in limits)
        return f"rule {self.name}: when {self.describe_condition()}: {actions}{tail}."

    @property
    def warn_only(self) -> bool:
        """True when firing this rule (before escalation) only warns."""
        return all(a.type == "warn" for a in self.actions)


class PolicyFile(PolicyModel):
    description: str = Field("", description="What this set of rules is for, in plain words.")
    rules: list[Rule] = Field(min_length=1, description="The rules, evaluated in this order at every step.")


# how a run config names a policy: a path to a YAML file (or a ready-made policy's name), or the policy
# inline; the resolved config holds them all inline
PolicySpec = str | dict[str, Any]

TRIGGER_KINDS: dict[str, type[PolicyModel]] = {
    "threshold": ThresholdTrigger,
    "nonfinite": NonfiniteTrigger,
    "spike": SpikeTrigger,
    "drop": DropTrigger,
    "expression": ExpressionTrigger,
}
ACTION_TYPES: dict[str, type[PolicyModel]] = {
    "rollback": RollbackAction,
    "adjust": AdjustAction,
    "skip": SkipAction,
    "halt": HaltAction,
    "warn": WarnAction,
}
ALL_MODELS: tuple[type[PolicyModel], ...] = (PolicyFile, Rule, *TRIGGER_KINDS.values(), *ACTION_TYPES.values())


def rule_metrics(rule: Rule) -> list[str]:
    """The metric names a rule's trigger reads (for a nonfinite trigger, its glob patterns), in order."""
    return trigger_metrics(rule.resolved_trigger)
