"""A rule's triggers: threshold, nonfinite, spike, drop and expression (told apart by ``kind``), each
able to say what it watches in plain words; ``parse_when`` reads a rule's ``when`` as the trigger it
stands for."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator

from rlctl.policies.base import PolicyModel, as_written
from rlctl.policies.expr import Binary, Expression, Metric, Negate, Number
from rlctl.policies.expr_parser import parse_expression

Mode = Literal["max", "min"]

# --------------------------------------------------------------------------------------------------
# Triggers

Op = Literal[">", ">=", "<", "<="]


class ThresholdTrigger(PolicyModel):
    kind: Literal["threshold"] = Field(description="Fires when one metric crosses a fixed value.")
    metric: str = Field(min_length=1, description="Metric key of a step's row, e.g. actor/ppo_kl or actor/grad_norm.")
    op: Op = Field(description="Comparison of the metric's value against `value`: >, >=, < or <=.")
    value: float = Field(allow_inf_nan=False, description="The threshold the metric is compared to.")

    def describe(self) -> str:
        return f"{self.metric} {self.op} {as_written(self.value)}"


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
        None,
        gt=0,
        allow_inf_nan=False,
        description="Fire when value > mean + sigma x std of the history (OLMo-core uses 6 over 128).",
    )
    factor: float | None = Field(
        None,
        ge=1,
        allow_inf_nan=False,
        description="Fire when value > factor x the history's `baseline` (Megatron uses 10).",
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
            limit = f"mean + {as_written(self.sigma)} std"
        else:
            limit = f"{as_written(self.factor)} x the {self.baseline}"  # type: ignore[arg-type]
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

    floor: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Not armed while the baseline is below this (mode max; above it, mode min): a metric near "
        "its floor has nothing left to drop (an entropy of 0.01 that falls to 0.002 is a converged policy).",
    )

    @model_validator(mode="after")
    def _one_margin(self) -> DropTrigger:
        if (self.amount is None) == (self.fraction is None):
            raise ValueError("give exactly one of 'amount' (an absolute margin) or 'fraction' (of the baseline)")
        if self.baseline == "best" and "window" in self.model_fields_set:
            raise ValueError("'window' goes with baseline: median, not with baseline: best")
        return self

    def describe(self) -> str:
        margin = as_written(self.amount) if self.amount is not None else f"{as_written(self.fraction * 100)}%"  # type: ignore[operator]
        moves = "falls more than {} below" if self.mode == "max" else "rises more than {} above"
        if self.baseline == "median":
            base = "its last value" if self.window == 1 else f"the median of its last {self.window} values"
        else:
            base = "its best so far" if self.mode == "max" else "its best (lowest) so far"
        text = f"{self.metric} {moves.format(margin)} {base}"
        if self.floor is not None:
            text += f" while that is {'at least' if self.mode == 'max' else 'at most'} {as_written(self.floor)}"
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
