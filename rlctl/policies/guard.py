"""What the run does about a step: the firings of every rule, merged into one verdict.

``PolicyGuard`` wraps the evaluator and keeps what must outlive a rollback: the evaluator's counts and
windows, the prompts skipped so far, and the adjustments made. It also carries the run's knob settings
(``knobs``: plain data the trainer refreshes before each snapshot and each write of the file), so that a
resume takes the knobs of the step it resumes from, not those of later adjustments that no snapshot
recorded (their steps are re-run, and fire again). It is Stateful (a snapshot carries it),
but a rollback never restores it from the snapshot it returns to: the trigger counts would reset and
``max_triggers`` could never run out. The trainer also writes it to RUN_DIR/policy_state.json at every
rollback and halt, so a kill before the next snapshot loses none of what they did (a firing that only
adjusts or warns is re-done when a resume re-runs its step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rlctl.policies.actions import AdjustAction, HaltAction, RollbackAction, SkipAction
from rlctl.policies.evaluator import Firing, PolicyEngine
from rlctl.policies.schema import Rule
from rlctl.policies.triggers import DropTrigger
from rlctl.stateful import StateMismatchError, check_version


class PolicyStateError(StateMismatchError):
    """A policy state (RUN_DIR/policy_state.json, or a snapshot's) that this guard cannot load: another
    version, or not the shape it writes. Nothing was changed; the caller may warn and go on."""


@dataclass(frozen=True)
class Adjustment:
    """One change of one knob that a verdict asks for: ``set`` it to ``value``, ``multiply`` it by
    ``value`` or ``add`` ``value`` to it; then hold the result within ``min`` and ``max`` (where given)."""

    key: str  # a KNOBS key
    op: Literal["set", "multiply", "add"]
    value: float
    min: float | None = None  # bounds applied to the knob's value after the change
    max: float | None = None


def adjustments(action: AdjustAction) -> list[Adjustment]:
    """The changes one adjust action asks for, each with its bounds: set, then multiply, then add."""
    return [Adjustment(key, op, value, action.min.get(key), action.max.get(key)) for key, op, value in action.changes()]


@dataclass
class Verdict:
    """The merged decision for one step."""

    step: int
    firings: list[Firing] = field(default_factory=list)
    halt: Firing | None = None  # the firing that halts the run, if any
    rollback: RollbackAction | None = None  # the furthest-reaching rollback asked for
    rollback_rule: str | None = None
    # with to: best, (metric, mode) of the rule's drop trigger: restore the snapshot whose validation holds
    # the best value of that metric (max: highest, min: lowest), else the last good snapshot
    rollback_best: tuple[str, str] | None = None
    adjust: list[Adjustment] = field(default_factory=list)  # in rule order
    skip_offending: bool = False
    skip_batches: int = 0

    @property
    def good(self) -> bool:
        """No rule with a non-warn action fired: the step may be snapshotted as good."""
        return all(f.warn_only for f in self.firings)

    @property
    def recovers(self) -> bool:
        return self.rollback is not None or bool(self.adjust) or self.skip_offending or self.skip_batches > 0


def _reach(action: RollbackAction) -> int:
    """How many steps back a rollback is sure to go (what retention must keep): K for steps_back, else 0."""
    return (action.min_steps_back or 0) if action.to == "steps_back" else 0


def _rank(action: RollbackAction) -> tuple[int, bool]:
    """How far back a rollback reaches, for ``merge``: last-good < best < steps_back (by K).

    A rollback to: best goes no later than last-good would in practice (the best value lies before the
    drop), but how far is unknown until the snapshots are scanned; an explicit steps_back is a promise
    of at least K steps, so it wins over best."""
    return _reach(action), action.to == "best"


def merge(step: int, firings: Iterable[Firing]) -> Verdict:
    """Halt wins over everything; the rollback that reaches furthest back wins over the others (a
    steps_back by its K, then to: best, then last-good; on a tie, the first rule's); adjustments apply
    in rule order; skips add up."""
    verdict = Verdict(step, list(firings))
    for firing in verdict.firings:
        for action in firing.actions:
            if isinstance(action, HaltAction) and verdict.halt is None:
                verdict.halt = firing
            elif isinstance(action, RollbackAction):
                if verdict.rollback is None or _rank(action) > _rank(verdict.rollback):
                    verdict.rollback, verdict.rollback_rule = action, firing.rule
                    verdict.rollback_best = firing.drop_metric if action.to == "best" else None
            elif isinstance(action, AdjustAction):
                verdict.adjust += adjustments(action)
            elif isinstance(action, SkipAction):
                verdict.skip_offending |= action.offending
                verdict.skip_batches += action.batches
    return verdict


class PolicyGuard:
    VERSION = 2  # 2: the knob settings (version 1, still read, had none: knobs None)

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.engine = PolicyEngine(rules)
        self.skipped_prompts: set[int] = set()
        self.adjustments: list[dict[str, Any]] = []
        # {knob key: {"value": v, and for a scheduled knob "scale", "offset", "min", "max"}} as of the
        # state's step (``rlctl.config.knob_values.knob_settings``); None: unknown (the config's stand)
        self.knobs: dict[str, dict[str, Any]] | None = None

    @property
    def rolls_back(self) -> bool:
        return any(isinstance(a, RollbackAction) for r in self.rules for a in r.actions)

    @property
    def max_steps_back(self) -> int:
        """The furthest any rule may need to roll back (retention keeps a snapshot that far back)."""
        return max((_reach(a) for r in self.rules for a in r.actions if isinstance(a, RollbackAction)), default=0)

    @property
    def best_metrics(self) -> list[tuple[str, str]]:
        """(metric, mode) of every rule that may roll back to: best (retention keeps those snapshots)."""
        found = [
            (r.resolved_trigger.metric, r.resolved_trigger.mode)
            for r in self.rules
            if isinstance(r.resolved_trigger, DropTrigger)
            and any(isinstance(a, RollbackAction) and a.to == "best" for a in r.actions)
        ]
        return list(dict.fromkeys(found))

    def check(self, step: int, row: Mapping[str, Any]) -> Verdict:
        return merge(step, self.engine.evaluate(step, row))

    def rewind(self, step: int) -> None:
        self.engine.rewind(step)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "engine": self.engine.state_dict(),
            "skipped_prompts": sorted(self.skipped_prompts),
            "adjustments": list(self.adjustments),
            "knobs": _copy_knobs(self.knobs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the evaluator, the skipped prompts, the adjustments and the knob settings, all or nothing:
        a state of another version or shape raises PolicyStateError and leaves the guard as it was. A
        version 1 state has no knob settings (knobs None)."""
        try:
            old = isinstance(state, dict) and state.get("version") == 1
            check_version("policy guard", state, 1 if old else self.VERSION)
            engine = PolicyEngine(self.rules)
            engine.load_state_dict(state["engine"])
            skipped = {int(i) for i in state["skipped_prompts"]}
            adjustments = [dict(a) for a in state["adjustments"]]
            knobs = None if old else _copy_knobs(state["knobs"])
        except StateMismatchError as exc:  # another version
            raise PolicyStateError(str(exc)) from None
        except (LookupError, TypeError, ValueError, AttributeError) as exc:  # a hand-edited or cut-off state
            raise PolicyStateError(f"policy state is not readable ({type(exc).__name__}: {exc})") from None
        self.engine, self.skipped_prompts, self.adjustments = engine, skipped, adjustments
        self.knobs = knobs


def _copy_knobs(knobs: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """A copy of knob settings (TypeError / ValueError when they are not a mapping of mappings)."""
    return None if knobs is None else {str(key): dict(entry) for key, entry in knobs.items()}
