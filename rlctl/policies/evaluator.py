"""The per-step evaluator: metrics row in, firings out. Pure Python, cheap enough for every step.

Triggers are a registry of pure functions ``check(trigger, row, history, seen) -> Observation``: the
history is what the rule remembers of its metric (a spike's window; a drop's window, or for a drop from
the best, the improvements so far), ``seen`` how many values of it were observed (a drop's arming); the
other triggers ignore both. ``PolicyEngine`` adds what needs memory: consecutive hits (``sustained``),
``warmup``, ``cooldown``, trigger counts and escalation (``max_triggers`` then ``then``), and the
histories. It is Stateful, so a resumed run keeps its counts and histories.

A row that does not carry a trigger's metric (a validation metric between validations; for an expression,
any one of its metrics) is not an observation: the check answers ``absent``, and the rule's streak neither
grows nor breaks.

Rollbacks: the engine's state is *not* meant to be restored from the snapshot a rollback returns to
(the trigger counts would reset and ``max_triggers`` could never run out). Keep the live engine and
call ``rewind(step)`` instead: it forgets history recorded after ``step`` (so a drop's best so far is
again the best of the values up to ``step``) and keeps the counts.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlctl import events
from rlctl.errors import ConfigError
from rlctl.policies.actions import Action, HaltAction, WarnAction
from rlctl.policies.expr import as_number as as_number  # re-exported: rows are read one way everywhere
from rlctl.policies.schema import Rule
from rlctl.policies.triggers import DropTrigger, ExpressionTrigger, NonfiniteTrigger, SpikeTrigger, ThresholdTrigger
from rlctl.stateful import check_version

# version 1; "seen_steps" was added to a rule's state without a new version: a state without it loads
STATE_VERSION = 1
COUNTER_PREFIX = "actor/nonfinite/"  # counts of NaN/Inf in old_log_prob, ref_log_prob, log_prob, loss
SKIPPED_UPDATES = "actor/skipped_updates"


def json_number(value: float | None) -> float | str | None:
    """A float for a JSON log: NaN and infinities as the strings "NaN", "Infinity", "-Infinity"."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


# --------------------------------------------------------------------------------------------------
# Triggers: pure functions of (trigger, row, history, seen)


@dataclass(frozen=True)
class Observation:
    """What a trigger saw on one row: whether its condition held, on which metric, at what value,
    against what limit (None where there is no single number to show). ``absent``: the row did not
    carry the metric at all, so it is no observation (a streak neither grows nor breaks)."""

    held: bool
    metric: str | None = None
    value: float | None = None
    limit: float | None = None
    absent: bool = False


MISS = Observation(held=False)
ABSENT = Observation(held=False, absent=True)

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
}


def check_threshold(
    trigger: ThresholdTrigger, row: Mapping[str, Any], history: Sequence[float], seen: int
) -> Observation:
    """Holds when ``row[metric] OP value``. A missing metric is absent; NaN does not hold (nonfinite's job)."""
    value = as_number(row.get(trigger.metric))
    if value is None:
        return ABSENT
    return Observation(_OPS[trigger.op](value, trigger.value), trigger.metric, value, trigger.value)


def check_nonfinite(
    trigger: NonfiniteTrigger, row: Mapping[str, Any], history: Sequence[float], seen: int
) -> Observation:
    """Holds when a watched metric is NaN/Inf, or (with ``counters``) a NaN/Inf counter is above 0."""
    for key, raw in row.items():
        value = as_number(raw)
        if value is None:
            continue
        if not math.isfinite(value) and any(fnmatch.fnmatchcase(key, pat) for pat in trigger.metrics):
            return Observation(True, key, value, None)
        if trigger.counters and (key.startswith(COUNTER_PREFIX) or key == SKIPPED_UPDATES) and value > 0:
            return Observation(True, key, value, 0.0)
    return MISS


def spike_limit(trigger: SpikeTrigger, history: Sequence[float]) -> float | None:
    """The value above which ``trigger`` fires given its history; None while it is not armed."""
    if len(history) < trigger.min_history:
        return None
    if trigger.sigma is not None:
        mean = math.fsum(history) / len(history)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in history) / len(history))  # population std
        return mean + trigger.sigma * std
    baseline = statistics.median(history) if trigger.baseline == "median" else max(history)
    return trigger.factor * baseline  # type: ignore[operator]


def check_spike(trigger: SpikeTrigger, row: Mapping[str, Any], history: Sequence[float], seen: int) -> Observation:
    """Holds when the value is above ``spike_limit``. A missing metric is absent; NaN never holds
    (nonfinite's job); +Inf does."""
    value = as_number(row.get(trigger.metric))
    if value is None:
        return ABSENT
    if math.isnan(value):
        return MISS
    limit = spike_limit(trigger, history)
    return Observation(limit is not None and value > limit, trigger.metric, value, limit)


def drop_baseline(trigger: DropTrigger, history: Sequence[float]) -> float:
    """The value a drop is measured from: the best of ``history`` or its median (history not empty)."""
    if trigger.baseline == "median":
        return statistics.median(history)
    return max(history) if trigger.mode == "max" else min(history)


def drop_limit(trigger: DropTrigger, history: Sequence[float], seen: int) -> float | None:
    """The value past which ``trigger`` fires (below it for mode max, above for min): the baseline
    less (or plus) the margin; None while it is not armed (fewer than ``min_history`` values seen, or a
    baseline past its ``floor``)."""
    if seen < trigger.min_history or not history:
        return None
    baseline = drop_baseline(trigger, history)
    if trigger.floor is not None and (baseline < trigger.floor if trigger.mode == "max" else baseline > trigger.floor):
        return None
    margin = trigger.amount if trigger.amount is not None else trigger.fraction * abs(baseline)  # type: ignore[operator]
    return baseline - margin if trigger.mode == "max" else baseline + margin


def check_drop(trigger: DropTrigger, row: Mapping[str, Any], history: Sequence[float], seen: int) -> Observation:
    """Holds when the value is past ``drop_limit``. A missing metric, NaN or Inf is absent (no
    observation at all: validation metrics are in some rows only, and NaN is nonfinite's job)."""
    value = as_number(row.get(trigger.metric))
    if value is None or not math.isfinite(value):
        return ABSENT
    limit = drop_limit(trigger, history, seen)
    held = limit is not None and (value < limit if trigger.mode == "max" else value > limit)
    return Observation(held, trigger.metric, value, limit)


def improves(trigger: DropTrigger, value: float, history: Sequence[float]) -> bool:
    """True when ``value`` is a new best for ``trigger`` (strictly better than all of ``history``)."""
    if not history:
        return True
    return value > max(history) if trigger.mode == "max" else value < min(history)


def check_expression(
    trigger: ExpressionTrigger, row: Mapping[str, Any], history: Sequence[float], seen: int
) -> Observation:
    """Holds when the expression does. A row without one of its metrics is absent. With a comparison at
    the top, the observation shows its left side (metric and value) and its right side (limit)."""
    expression = trigger.parsed
    reading = expression.evaluate(row)
    if reading is None:
        return ABSENT
    return Observation(reading.held, expression.subject, reading.value, reading.limit)


TRIGGER_CHECKS: dict[str, Callable[[Any, Mapping[str, Any], Sequence[float], int], Observation]] = {
    "threshold": check_threshold,
    "nonfinite": check_nonfinite,
    "spike": check_spike,
    "drop": check_drop,
    "expression": check_expression,
}


# --------------------------------------------------------------------------------------------------
# Firings


@dataclass(frozen=True)
class Firing:
    """A rule fired at a step: what it saw and what the run must do now.

    ``actions`` are the rule's actions, or the single escalation action (halt or warn, from the rule's
    ``then``) when the rule has already fired ``max_triggers`` times; ``escalated`` tells which.
    """

    rule: str
    step: int
    trigger: str  # plain words: "actor/ppo_kl > 0.05 for 3 consecutive steps"
    metric: str | None  # the metric that fired it
    value: float | None  # its observed value (NaN/Inf for a nonfinite trigger)
    limit: float | None  # what it was compared to (None: no single number, e.g. "is NaN")
    actions: tuple[Action, ...]
    escalated: bool = False
    count: int = 1  # how many times this rule has fired (within max_triggers' window), this one included
    drop_metric: tuple[str, str] | None = None  # (metric, mode) of a drop trigger: what a rollback to: best ranks by
    stage: int = 0  # which of the rule's escalate stages gave the actions (0: the rule's own actions)

    @property
    def warn_only(self) -> bool:
        """True when the run goes on untouched: every action is a warning."""
        return all(a.type == "warn" for a in self.actions)

    def as_event(self) -> dict[str, Any]:
        """The firing as a JSON-serialisable dict for the event log (non-finite floats as strings)."""
        return {
            "event": events.POLICY,
            "rule": self.rule,
            "step": self.step,
            "trigger": self.trigger,
            "metric": self.metric,
            "value": json_number(self.value),
            "limit": json_number(self.limit),
            "actions": [a.model_dump(mode="json") for a in self.actions],
            "escalated": self.escalated,
            "count": self.count,
            "stage": self.stage,
        }


def firing_event(firing: Firing) -> dict[str, Any]:
    """``firing.as_event()``, as a function."""
    return firing.as_event()


def is_healthy(firings: Iterable[Firing]) -> bool:
    """A step is good when no rule with a non-warn action fired on it."""
    return all(f.warn_only for f in firings)


# --------------------------------------------------------------------------------------------------
# The engine


def _count(rule: Rule, state: RuleState, step: int) -> int:
    """The firings ``max_triggers`` and the escalate stages count, the one at ``step`` included: over the
    run, or those of the window's last steps (a firing at a later step, from before a rollback, is recent).
    Records the firing, and forgets those the window has left behind."""
    within = rule.limit.within if rule.limit is not None else None
    state.fired.append(step)
    if within is None:
        del state.fired[:-1]  # only the last one is kept: the count is the total
        return state.triggers
    state.fired = [s for s in state.fired if s > step - within]
    return len(state.fired)


@dataclass
class RuleState:
    """What one rule remembers between steps."""

    triggers: int = 0  # times fired
    streak: int = 0  # consecutive observations the condition held
    streak_step: int | None = None  # the last step of that streak (or of a row without the metric after it)
    cooldown_until: int | None = None  # not evaluated at steps <= this
    last_fired: int | None = None
    fired: list[int] = field(default_factory=list)  # the steps it fired at (those max_triggers' window holds)
    # (step, value): a spike's or a median drop's window; a drop from the best: each new best, in order
    history: deque[tuple[int, float]] = field(default_factory=deque)
    seen: list[int] = field(default_factory=list)  # a drop's arming: steps of its first min_history values

    def values(self) -> list[float]:
        return [v for _, v in self.history]

    def to_dict(self) -> dict[str, Any]:
        return {
            "triggers": self.triggers,
            "streak": self.streak,
            "streak_step": self.streak_step,
            "cooldown_until": self.cooldown_until,
            "last_fired": self.last_fired,
            "fired_steps": list(self.fired),
            "history": [v for _, v in self.history],
            "history_steps": [s for s, _ in self.history],
            "seen_steps": list(self.seen),
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], window: int | None, min_history: int = 0) -> RuleState:
        """A rule's state as ``to_dict`` wrote it. One without ``seen_steps`` (written before it existed)
        counts the first ``min_history`` steps of its history as seen; one without ``fired_steps``, that it
        fired at its last firing only."""
        pairs = list(zip(state.get("history_steps", []), state.get("history", [])))
        seen = state.get("seen_steps", [s for s, _ in pairs[:min_history]])
        return cls(
            triggers=int(state["triggers"]),
            streak=int(state["streak"]),
            streak_step=state["streak_step"],
            cooldown_until=state["cooldown_until"],
            last_fired=state["last_fired"],
            fired=[int(s) for s in state.get("fired_steps", [state["last_fired"]] if state["last_fired"] else [])],
            history=deque(((int(s), float(v)) for s, v in pairs), maxlen=window),
            seen=[int(s) for s in seen],
        )


class PolicyEngine:
    """Evaluates rules, in order, on each step's metrics row. Stateful (``state_dict`` /
    ``load_state_dict``).

    >>> engine = PolicyEngine(load_policies(["policies/default.yaml"]))   # doctest: +SKIP
    >>> for firing in engine.evaluate(step, row): ...                      # doctest: +SKIP
    """

    def __init__(self, rules: Iterable[Rule]):
        self.rules: list[Rule] = list(rules)
        names = [r.name for r in self.rules]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"rule names must be unique across policies; used more than once: {', '.join(twice)}")
        self._state: dict[str, RuleState] = {r.name: self._fresh(r) for r in self.rules}
        self._last: tuple[int, list[Firing]] | None = None

    @staticmethod
    def _fresh(rule: Rule) -> RuleState:
        """A rule's state before any step: its history bounded by the trigger's window (unbounded for a
        drop from the best: it holds only the improvements; empty for triggers without one)."""
        trigger = rule.resolved_trigger
        window: int | None = 0
        if isinstance(trigger, SpikeTrigger):
            window = trigger.window
        elif isinstance(trigger, DropTrigger):
            window = trigger.window if trigger.baseline == "median" else None
        return RuleState(history=deque(maxlen=window))

    # -- evaluation --------------------------------------------------------------------------------

    def evaluate(self, step: int, row: Mapping[str, Any]) -> list[Firing]:
        """The rules that fire on ``step`` whose metrics are ``row``, in rule order. Call once per step."""
        firings = [f for rule in self.rules if (f := self._evaluate_rule(rule, step, row)) is not None]
        self._last = (step, firings)
        return firings

    def healthy(self, step: int, row: Mapping[str, Any] | None = None) -> bool:
        """True when ``step`` is good: no rule with a non-warn action fired on it.

        Reads the result of the ``evaluate(step, ...)`` just done (no side effects). If ``step`` was not
        the last step evaluated, evaluates it now with ``row`` (which then counts as that step's
        evaluation)."""
        if self._last is not None and self._last[0] == step:
            return is_healthy(self._last[1])
        if row is None:
            raise ValueError(f"step {step} has not been evaluated; pass its metrics row")
        return is_healthy(self.evaluate(step, row))

    def _evaluate_rule(self, rule: Rule, step: int, row: Mapping[str, Any]) -> Firing | None:
        state = self._state[rule.name]
        trigger = rule.resolved_trigger
        cooling = state.cooldown_until is not None and step <= state.cooldown_until
        if cooling and not isinstance(trigger, DropTrigger):  # a drop keeps its best so far up to date
            return None
        observed = TRIGGER_CHECKS[trigger.kind](trigger, row, state.values(), len(state.seen))
        self._remember(trigger, state, step, observed)
        if cooling:
            return None
        if observed.absent:  # no observation: the streak neither grows nor breaks
            if state.streak_step == step - 1:
                state.streak_step = step
            return None
        if step <= rule.warmup or not observed.held:
            state.streak = 0
            return None
        state.streak = state.streak + 1 if state.streak_step == step - 1 else 1
        state.streak_step = step
        if state.streak < rule.sustained:
            return None
        return self._fire(rule, state, step, observed)

    @staticmethod
    def _remember(trigger: Any, state: RuleState, step: int, observed: Observation) -> None:
        """Keep what the trigger's next checks need. A drop counts its values (up to ``min_history``)
        and, from the best, keeps each new best. A spike's or a median drop's window takes the value
        unless it broke the rule (held) or is not finite."""
        value = observed.value
        if observed.absent or value is None or not math.isfinite(value):
            return
        if isinstance(trigger, DropTrigger):
            if len(state.seen) < trigger.min_history:
                state.seen.append(step)
            if trigger.baseline == "best":
                if improves(trigger, value, state.values()):
                    state.history.append((step, value))
                return
        if state.history.maxlen and not observed.held:
            state.history.append((step, value))

    @staticmethod
    def _fire(rule: Rule, state: RuleState, step: int, observed: Observation) -> Firing:
        state.triggers += 1
        state.streak = 0
        state.last_fired = step
        state.cooldown_until = step + rule.cooldown if rule.cooldown else None
        count = _count(rule, state, step)
        stages = [i for i, stage in enumerate(rule.escalate, 1) if count > stage.after]
        stage = stages[-1] if stages else 0
        actions: tuple[Action, ...] = tuple(rule.escalate[stage - 1].actions if stage else rule.actions)
        escalated = rule.limit is not None and count > rule.limit.count
        if escalated:
            actions = (HaltAction(type="halt"),) if rule.then == "halt" else (WarnAction(type="warn"),)
        trigger = rule.resolved_trigger
        return Firing(
            rule.name,
            step,
            rule.describe_condition(warmup=False),
            observed.metric,
            observed.value,
            observed.limit,
            actions,
            escalated,
            count,
            (trigger.metric, trigger.mode) if isinstance(trigger, DropTrigger) else None,
            stage,
        )

    # -- rollbacks ---------------------------------------------------------------------------------

    def rewind(self, step: int) -> None:
        """After the run rolled back to ``step``: forget values recorded after it (a drop's best so far is
        again the best up to ``step``, its arming as of then) and any streak in progress; keep trigger
        counts, cooldowns and last-fired steps (so ``max_triggers`` still runs out)."""
        for state in self._state.values():
            kept = [(s, v) for s, v in state.history if s <= step]
            state.history.clear()
            state.history.extend(kept)
            state.seen = [s for s in state.seen if s <= step]
            state.streak, state.streak_step = 0, None
        self._last = None

    def triggers(self, name: str) -> int:
        """How many times the rule ``name`` has fired."""
        return self._state[name].triggers

    # -- Stateful ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "rules": {name: s.to_dict() for name, s in self._state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counts, streaks, cooldowns and histories. A rule absent from ``state`` (added since)
        starts fresh; state of a rule no longer configured is ignored, so policies may change on resume.
        A version-1 state written before ``seen_steps`` existed loads (a drop counts its history as seen)."""
        check_version("policy engine", state, STATE_VERSION)
        saved = state.get("rules", {})
        for rule in self.rules:
            window = self._fresh(rule).history.maxlen
            trigger = rule.resolved_trigger
            arming = trigger.min_history if isinstance(trigger, DropTrigger) else 0
            self._state[rule.name] = (
                RuleState.from_dict(saved[rule.name], window, arming) if rule.name in saved else self._fresh(rule)
            )
        self._last = None
