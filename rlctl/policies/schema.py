"""The rollback-policy schema: strict pydantic models, each field described, each able to say what it
does in plain words.

A policy file holds ``rules``; a rule is a *trigger* (threshold, nonfinite, spike or drop, told apart
by ``kind``), how long it must hold (``sustained``), when it is armed (``warmup``), the *actions* to take
(rollback, adjust, skip, halt, warn, told apart by ``type``) and the limits that keep a run from looping
forever (``max_triggers`` then ``then``, ``cooldown``). ``when: "actor/ppo_kl > 0.05"`` on a rule is sugar
for a threshold trigger.

Rule names must be unique within a set of rules; the loader and the evaluator check that (across files
too), because only they know where the rules came from. A run config names its policies by
``PolicySpec``: a file, a ready-made policy's name, or the policy inline.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, field_validator, model_validator

Mode = Literal["max", "min"]


class PolicyModel(BaseModel):
    """Strict: an unknown key is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid")


def _num(value: float) -> str:
    """A number as a person writes it: 0.05, 1e-06, 10."""
    return f"{value:g}"


# --------------------------------------------------------------------------------------------------
# Triggers

Op = Literal[">", ">=", "<", "<="]

_WHEN = re.compile(r"^\s*(?P<metric>[^\s<>=]+)\s*(?P<op>>=|<=|>|<)\s*(?P<value>\S+)\s*$")


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


Trigger = Annotated[ThresholdTrigger | NonfiniteTrigger | SpikeTrigger | DropTrigger, Field(discriminator="kind")]


def parse_when(text: str) -> ThresholdTrigger:
    """``"actor/ppo_kl > 0.05"`` -> the threshold trigger it stands for; ValueError when malformed."""
    match = _WHEN.match(text)
    if match is None:
        raise ValueError(f"expected 'METRIC OP NUMBER' such as 'actor/ppo_kl > 0.05', got {text!r}")
    try:
        value = float(match["value"])
    except ValueError:
        raise ValueError(f"{match['value']!r} is not a number in {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"the threshold must be a finite number, got {match['value']!r}")
    return ThresholdTrigger(kind="threshold", metric=match["metric"], op=match["op"], value=value)


# --------------------------------------------------------------------------------------------------
# Actions

AdjustKey = Literal[
    "actor.lr", "algorithm.kl_coef", "algorithm.clip_ratio", "algorithm.entropy_coef", "rollout.temperature"
]


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
    type: Literal["adjust"] = Field(description="Change hyperparameters of the run from now on.")
    set: dict[AdjustKey, PositiveFloat] = Field(
        default_factory=dict, description="Settings to replace, e.g. {actor.lr: 1.0e-7}."
    )
    multiply: dict[AdjustKey, PositiveFloat] = Field(
        default_factory=dict, description="Settings to scale, e.g. {actor.lr: 0.5} halves the learning rate."
    )

    @model_validator(mode="after")
    def _changes_something(self) -> AdjustAction:
        if not self.set and not self.multiply:
            raise ValueError("adjust needs 'set' or 'multiply' with at least one setting")
        both = sorted(self.set.keys() & self.multiply.keys())
        if both:
            raise ValueError(f"{', '.join(both)} is both set and multiplied; choose one")
        return self

    def describe(self) -> str:
        parts = [f"set {k} to {_num(v)}" for k, v in self.set.items()]
        parts += [f"multiply {k} by {_num(v)}" for k, v in self.multiply.items()]
        return ", ".join(parts)


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
        None, description="What fires the rule: a threshold, nonfinite, spike or drop trigger, chosen by `kind`."
    )
    when: str | None = Field(
        None, description='Shorthand for a threshold trigger, e.g. "actor/ppo_kl > 0.05" (instead of `trigger`).'
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
            raise ValueError("needs a 'trigger' (kind: threshold, nonfinite, spike or drop) or a 'when' expression")
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
    def resolved_trigger(self) -> ThresholdTrigger | NonfiniteTrigger | SpikeTrigger | DropTrigger:
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
}
ACTION_TYPES: dict[str, type[PolicyModel]] = {
    "rollback": RollbackAction,
    "adjust": AdjustAction,
    "skip": SkipAction,
    "halt": HaltAction,
    "warn": WarnAction,
}
ALL_MODELS: tuple[type[PolicyModel], ...] = (PolicyFile, Rule, *TRIGGER_KINDS.values(), *ACTION_TYPES.values())
