"""A rule's actions: rollback, adjust (the knobs of ``rlctl.policies.knobs``: set, multiply or add,
within optional bounds), skip, halt and warn (told apart by ``type``), each able to say what it does
in plain words."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, FiniteFloat, model_validator

from rlctl.policies.base import PolicyModel, as_written, reject
from rlctl.policies.knobs import KNOBS
from rlctl.policies.triggers import DropTrigger

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
            reject("adjust needs 'set', 'multiply' or 'add' with at least one knob")
        ops: dict[str, list[str]] = {}
        for key, op, _ in changes:
            ops.setdefault(key, []).append(op)
        for key, used in ops.items():
            if len(used) > 1:
                reject(f"{key} is in both '{used[0]}' and '{used[1]}'; give each knob one change")
        for bound in ("min", "max"):
            for key in getattr(self, bound):
                if key not in ops:
                    reject(f"'{bound}' names {key}, which this action does not change; bound only knobs it changes")
        for key, lo in self.min.items():
            if key in self.max and lo > self.max[key]:
                reject(f"the bounds of {key} are empty: min {as_written(lo)} is above max {as_written(self.max[key])}")
        for key, value in self.set.items():
            if not self.min.get(key, value) <= value <= self.max.get(key, value):
                reject(f"set {key} to {as_written(value)} lies outside its own bounds")
        return self

    def describe(self) -> str:
        words = {"set": "set {k} to {v}", "multiply": "multiply {k} by {v}", "add": "add {v} to {k}"}
        parts = []
        for key, op, value in self.changes():
            if op == "add" and value < 0:
                text = f"subtract {as_written(-value)} from {key}"
            else:
                text = words[op].format(k=key, v=as_written(value))
            parts.append(text + self._bounds(key))
        return ", ".join(parts)

    def _bounds(self, key: str) -> str:
        lo, hi = self.min.get(key), self.max.get(key)
        if lo is not None and hi is not None:
            return f" (between {as_written(lo)} and {as_written(hi)})"
        if lo is not None:
            return f" (at least {as_written(lo)})"
        return f" (at most {as_written(hi)})" if hi is not None else ""


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
