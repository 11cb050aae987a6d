"""The rollback-policy schema: strict pydantic models, each field described, each able to say what it
does in plain words. A rule and a policy file are here; the triggers in ``triggers``, the actions in
``actions``.

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
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlctl.policies.actions import Action, AdjustAction, HaltAction, RollbackAction, SkipAction, WarnAction
from rlctl.policies.base import PolicyModel
from rlctl.policies.triggers import (
    AnyTrigger,
    DropTrigger,
    ExpressionTrigger,
    NonfiniteTrigger,
    SpikeTrigger,
    ThresholdTrigger,
    Trigger,
    parse_when,
    trigger_metrics,
)

_ENDS_RUN_ALONE = {"rollback", "adjust", "skip"}  # what halt cannot be combined with


# --------------------------------------------------------------------------------------------------
# Rules and files

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class MaxTriggers(PolicyModel):
    count: int = Field(ge=1, description="How many firings the rule may make within `within` steps.")
    within: int | None = Field(
        None, ge=1, description="The window, in steps, the firings are counted in (none: over the whole run)."
    )

    def describe(self) -> str:
        times = "once" if self.count == 1 else f"{self.count} times"
        return f"at most {times}" + (f" within {self.within} steps" if self.within else "")


class Escalation(PolicyModel):
    after: int = Field(ge=1, description="This stage takes over from the firing after this many firings.")
    actions: list[Action] = Field(min_length=1, description="What to do instead of the rule's actions.")

    @field_validator("actions")
    @classmethod
    def _actions_combine(cls, actions: list) -> list:
        return check_combination(actions)

    def describe(self, trigger: PolicyModel) -> str:
        return f"after {self.after} firing{'s' if self.after > 1 else ''}: {describe_actions(self.actions, trigger)}"


def check_combination(actions: list) -> list:
    """A list of actions is valid when no type is listed twice and halt stands alone."""
    types = [a.type for a in actions]
    twice = sorted({t for t in types if types.count(t) > 1})
    if twice:
        raise ValueError(f"action type {', '.join(twice)} is listed more than once; merge them")
    if "halt" in types and _ENDS_RUN_ALONE & set(types):
        others = ", ".join(t for t in types if t in _ENDS_RUN_ALONE)
        raise ValueError(f"halt ends the run, so it cannot be combined with {others}")
    return actions


def describe_actions(actions: list, trigger: PolicyModel) -> str:
    return ", ".join(a.describe(trigger) if isinstance(a, RollbackAction) else a.describe() for a in actions)


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
    escalate: list[Escalation] = Field(
        default_factory=list,
        description="Stronger actions for a rule that keeps firing: from the firing after `after` (counted as "
        "`max_triggers` counts), each stage's actions replace the rule's. Stages in increasing `after`.",
    )
    max_triggers: int | MaxTriggers | None = Field(
        None,
        description="Fire the actions at most this many times over the run (a number), or within a window of "
        "steps ({count: 5, within: 200}); after that, do `then` instead.",
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
        return check_combination(actions)

    @field_validator("max_triggers", mode="before")
    @classmethod
    def _count_is_a_count(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError(f"input should be greater than or equal to 1 (got {v})")
        return v

    @property
    def limit(self) -> MaxTriggers | None:
        """``max_triggers`` as a count and a window (None: the rule may fire forever)."""
        if self.max_triggers is None or isinstance(self.max_triggers, MaxTriggers):
            return self.max_triggers
        return MaxTriggers(count=self.max_triggers)

    @model_validator(mode="after")
    def _stages_in_order(self) -> Rule:
        afters = [stage.after for stage in self.escalate]
        if afters != sorted(set(afters)):
            raise ValueError(f"escalate's stages must come in increasing 'after', got {afters}")
        limit = self.limit
        if limit is not None and afters and afters[-1] >= limit.count:
            raise ValueError(
                f"escalate's stage after {afters[-1]} firings never runs: max_triggers allows {limit.count}"
            )
        return self

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
            in_a_row = ", on {} values in a row" if isinstance(trigger, DropTrigger) else " for {} consecutive steps"
            text += in_a_row.format(self.sustained)
        if warmup and self.warmup:
            text += f" (armed after step {self.warmup})"
        return text

    def describe(self) -> str:
        """The whole rule as one sentence, as ``rlctl policy check`` prints it."""
        actions = describe_actions(self.actions, self.resolved_trigger)
        actions += "".join(f"; {stage.describe(self.resolved_trigger)}" for stage in self.escalate)
        limits = []
        if self.limit is not None:
            limits.append(f"{self.limit.describe()}, then {self.then}")
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
ALL_MODELS: tuple[type[PolicyModel], ...] = (
    PolicyFile,
    Rule,
    MaxTriggers,
    Escalation,
    *TRIGGER_KINDS.values(),
    *ACTION_TYPES.values(),
)


def rule_metrics(rule: Rule) -> list[str]:
    """The metric names a rule's trigger reads (for a nonfinite trigger, its glob patterns), in order."""
    return trigger_metrics(rule.resolved_trigger)
