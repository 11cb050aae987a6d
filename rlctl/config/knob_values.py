"""The knobs of a run config (``rlctl.policies.knobs.KNOBS``): one read or written by its dotted key,
its legal domain (the bounds its schema field declares), its schedule, and a policy adjustment of it.

A schedule gives a knob's value at every step: ``{schedule: [{until: X, value: V}, ..., {value: V}],
mode: step|linear, unit: fraction|step}``. Progress at step s is s / trainer.total_steps (unit
fraction, the default) or s (unit step). step mode: the value of the first entry whose ``until`` the
progress has not passed (``progress <= until``; the last entry may omit until, and after every until
the last value holds). linear: before the first until, the first value; then the value ramps from the
previous entry's value at its until to this entry's value at this until (a last entry without until
ends at the end of training); after the last until, the last value.

Composition with policy adjustments: a schedule carries ``scale`` (1), ``offset`` (0), ``min`` and
``max`` (none), and the knob's value at step s is ``clamp(schedule(s) * scale + offset, min, max)``,
then held in the knob's legal domain. An adjust of a scheduled knob changes those: multiply m ->
scale *= m and offset *= m; add d -> offset += d; set v -> scale = 0 and offset = v (pinned); its
min / max tighten the stored bounds (where they cross, the max wins, as in the clamp). An unscheduled
knob's value is changed directly, then held within the action's min / max and the legal domain.

A run's knobs (each one's value, and a scheduled one's composition) travel as plain data in the policy
state (``knob_settings`` / ``apply_knob_settings``): a resume from a snapshot older than an adjustment
takes the knobs of the snapshot's step, so that the re-run steps fire it again without compounding.

Pure functions of pydantic models: this module does not know the run config's classes (``schema``
imports it), only how to walk a model by a dotted key.
"""

from __future__ import annotations

import math
import types
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from rlctl.policies.knobs import KNOBS
from rlctl.yamlsrc import Origins

KnobKey = Literal[tuple(KNOBS)]


# --------------------------------------------------------------------------------------------------
# Schedules


class ScheduleEntry(BaseModel):
    """One piece of a schedule."""

    model_config = ConfigDict(extra="forbid")

    until: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Progress up to which (inclusive) this entry applies: a fraction of trainer.total_steps "
        "(unit: fraction) or a step (unit: step). Only the last entry may omit it.",
    )
    value: float = Field(
        allow_inf_nan=False,
        description="The knob's value (step mode), or the value reached at `until` (linear).",
    )


class ScheduleConfig(BaseModel):
    """A knob's value as a function of the step, and the policy adjustments composed with it."""

    model_config = ConfigDict(extra="forbid")

    schedule: list[ScheduleEntry] = Field(
        min_length=1, description="The entries, in order of `until`: [{until: 0.2, value: 0.0}, {value: 0.001}]."
    )
    mode: Literal["step", "linear"] = Field(
        "step", description="step: each entry's value holds up to its until; linear: ramps between the entries."
    )
    unit: Literal["fraction", "step"] = Field(
        "fraction", description="fraction: `until` is a fraction of trainer.total_steps; step: a step number."
    )
    scale: float = Field(
        1.0, allow_inf_nan=False, description="Policy adjustments: the schedule's value is multiplied by this ..."
    )
    offset: float = Field(
        0.0, allow_inf_nan=False, description="... and this is added (multiply scales both; add adds; set pins)."
    )
    min: float | None = Field(
        None, allow_inf_nan=False, description="Policy adjustments: the value never goes below this."
    )
    max: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Policy adjustments: the value never goes above this (max wins over min).",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ScheduleConfig:
        untils = [e.until for e in self.schedule]
        if None in untils[:-1]:
            raise ValueError(f"entry {untils.index(None)} has no 'until': only the last entry may omit it")
        given = [u for u in untils if u is not None]
        if any(b <= a for a, b in zip(given, given[1:], strict=False)):
            raise ValueError(f"the entries' 'until' must increase, got {given}")
        if self.unit == "fraction" and given and given[-1] > 1:
            raise ValueError(
                f"with unit: fraction, 'until' is a fraction of trainer.total_steps (<= 1), got {given[-1]}"
            )
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self

    def progress(self, step: int, total_steps: int) -> float:
        """Where step ``step`` is, in this schedule's unit."""
        return step / total_steps if self.unit == "fraction" else float(step)

    def base(self, step: int, total_steps: int) -> float:
        """The schedule's own value at ``step`` (before scale, offset and bounds)."""
        p, entries = self.progress(step, total_steps), self.schedule
        end = 1.0 if self.unit == "fraction" else float(total_steps)
        for i, entry in enumerate(entries):
            until = entry.until if entry.until is not None else (end if self.mode == "linear" else math.inf)
            if p > until and not math.isclose(p, until, rel_tol=1e-9):  # 3 / 10 is just above 0.3
                continue
            if self.mode == "step" or i == 0:
                return entry.value
            start, before = entries[i - 1].until, entries[i - 1].value
            if until <= start:
                return entry.value
            return before + (entry.value - before) * (p - start) / (until - start)
        return entries[-1].value

    def compose(self, value: float) -> float:
        """``clamp(value * scale + offset, min, max)`` (min first, then max: max wins where they cross)."""
        out = value * self.scale + self.offset
        if self.min is not None:
            out = max(out, self.min)
        if self.max is not None:
            out = min(out, self.max)
        return out

    def value_at(self, step: int, total_steps: int) -> float:
        """The knob's value at ``step``: the schedule composed with the adjustments (not yet held in the
        knob's legal domain: ``in_domain``)."""
        return self.compose(self.base(step, total_steps))

    def extremes(self) -> list[float]:
        """Every value the schedule can give lies between these (it is piecewise linear in the step)."""
        return [self.compose(e.value) for e in self.schedule]

    def adjusted(self, op: str, value: float, lo: float | None = None, hi: float | None = None) -> ScheduleConfig:
        """A copy with a policy adjustment composed in (see the module's docstring). Bounds only tighten;
        where the new min lies above the max (or the new max below the min), the max wins, as it does in
        ``compose``: min is lowered to it, so the stored bounds stay valid (min <= max)."""
        scale, offset = self.scale, self.offset
        if op == "multiply":
            scale, offset = scale * value, offset * value
        elif op == "add":
            offset = offset + value
        else:  # set: pinned
            scale, offset = 0.0, value
        low = lo if self.min is None else (self.min if lo is None else max(self.min, lo))
        high = hi if self.max is None else (self.max if hi is None else min(self.max, hi))
        if low is not None and high is not None and low > high:
            low = high
        return self.model_copy(update={"scale": scale, "offset": offset, "min": low, "max": high})


def lift_schedules(data: Any, origins: Origins | None = None) -> Any:
    """Raw config data with every knob written as a mapping (``algorithm.kl_coef: {schedule: ...}``)
    moved to the top-level ``schedules`` (replacing one there), and, given ``origins``, their origins
    moved along (in place), so that errors inside still name the line they were written on. The data
    is copied where it changes; anything not shaped like a config is returned as it is."""
    if not isinstance(data, dict):
        return data
    for key in KNOBS:
        data, found = _pop_mapping(data, key.split("."))
        if found is None:
            continue
        schedules = data.get("schedules")
        data["schedules"] = {**(schedules if isinstance(schedules, dict) else {}), key: found}
        if origins is not None:
            path = tuple(key.split("."))
            for old in [k for k in origins if k[: len(path)] == path]:
                origins[("schedules", key, *old[len(path) :])] = origins.pop(old)
            if ("schedules", key) in origins:  # a mistake found across schedules points here
                origins.setdefault(("schedules",), origins[("schedules", key)])
    return data


def _pop_mapping(node: dict, path: list[str]) -> tuple[dict, dict | None]:
    """(``node`` copied along ``path`` without the mapping found at its end, that mapping), or
    (``node`` itself, None) when there is no mapping there."""
    head, *rest = path
    child = node.get(head)
    if not isinstance(child, dict):
        return node, None
    if not rest:
        return {k: v for k, v in node.items() if k != head}, child
    new_child, found = _pop_mapping(child, rest)
    return ({**node, head: new_child}, found) if found is not None else (node, None)


# --------------------------------------------------------------------------------------------------
# A knob of a config model, by dotted key


@dataclass(frozen=True)
class Domain:
    """A knob's legal values, as its schema field declares them: lo < / <= value < / <= hi."""

    lo: float = -math.inf
    lo_open: bool = False
    hi: float = math.inf
    hi_open: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def clamp(self, value: float) -> float:
        """The legal value nearest to ``value`` (the next float inside an open bound)."""
        if self.contains(value):
            return value
        if value <= self.lo:
            return math.nextafter(self.lo, math.inf) if self.lo_open else self.lo
        return math.nextafter(self.hi, -math.inf) if self.hi_open else self.hi

    def describe(self) -> str:
        parts = []
        if self.lo > -math.inf:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        if self.hi < math.inf:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi:g}")
        return " and ".join(parts) or "any number"


def _model_of(tp: Any) -> type[BaseModel] | None:
    if get_origin(tp) in (Union, types.UnionType):
        tp = next((a for a in get_args(tp) if a is not type(None)), None)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def knob_field(root: type[BaseModel], key: str) -> FieldInfo:
    """The schema field a dotted key names in model class ``root``; KeyError when there is none."""
    *parents, name = key.split(".")
    model: type[BaseModel] | None = root
    for part in parents:
        field = model.model_fields.get(part) if model is not None else None
        model = _model_of(field.annotation) if field is not None else None
    if model is None or name not in model.model_fields:
        raise KeyError(key)
    return model.model_fields[name]


def is_float_field(root: type[BaseModel], key: str) -> bool:
    """Whether ``key`` names a float field (or an optional one) of ``root``."""
    try:
        tp = knob_field(root, key).annotation
    except KeyError:
        return False
    return tp is float or (get_origin(tp) in (Union, types.UnionType) and set(get_args(tp)) == {float, type(None)})


def domain(root: type[BaseModel], key: str) -> Domain:
    """A knob's legal values, read from its field's gt / ge / lt / le."""
    lo, lo_open, hi, hi_open = -math.inf, False, math.inf, False
    for meta in knob_field(root, key).metadata:
        if isinstance(meta, at.Gt):
            lo, lo_open = float(meta.gt), True
        elif isinstance(meta, at.Ge):
            lo, lo_open = float(meta.ge), False
        elif isinstance(meta, at.Lt):
            hi, hi_open = float(meta.lt), True
        elif isinstance(meta, at.Le):
            hi, hi_open = float(meta.le), False
    return Domain(lo, lo_open, hi, hi_open)


def _parent(cfg: BaseModel, key: str) -> tuple[BaseModel, str]:
    *parents, name = key.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    return node, name


def get_knob(cfg: BaseModel, key: str) -> float | None:
    """The value of the knob ``key`` (dotted: ``algorithm.kl_ctrl.target_kl``) in config ``cfg``."""
    node, name = _parent(cfg, key)
    return getattr(node, name)


def set_knob(cfg: BaseModel, key: str, value: float | None) -> None:
    """Set the knob ``key`` of ``cfg`` in place (the field's own validation applies)."""
    node, name = _parent(cfg, key)
    setattr(node, name, value)


def in_domain(cfg: BaseModel, key: str, value: float) -> tuple[float, str | None]:
    """``value`` held in the knob's legal domain, and a note saying so when it had to move."""
    legal = domain(type(cfg), key)
    if legal.contains(value):
        return value, None
    held = legal.clamp(value)
    return held, f"{value!r} is outside {key}'s legal values ({legal.describe()}): held at {held!r}"


# --------------------------------------------------------------------------------------------------
# Following schedules and applying adjustments


def follow_schedules(cfg: Any, step: int) -> bool:
    """Set every scheduled knob of run config ``cfg`` to its value at ``step``; whether any changed."""
    changed = False
    for key, sched in cfg.schedules.items():
        value = in_domain(cfg, key, sched.value_at(step, cfg.trainer.total_steps))[0]
        changed |= value != get_knob(cfg, key)
        set_knob(cfg, key, value)
    return changed


def adjust_knob(
    cfg: Any,
    key: str,
    current: float | None,
    op: str,
    value: float,
    lo: float | None = None,
    hi: float | None = None,
    step: int = 0,
) -> tuple[float, str | None]:
    """Apply one policy adjustment to the knob ``key`` of run config ``cfg`` (whose value now is
    ``current``), as the module's docstring says; set the field and return (its new value, a note when
    the legal domain held it). ``step``: the step whose value a scheduled knob now takes."""
    sched = cfg.schedules.get(key)
    if sched is not None:
        sched = cfg.schedules[key] = sched.adjusted(op, value, lo, hi)
        raw = sched.value_at(step, cfg.trainer.total_steps)
    else:
        raw = value if op == "set" else current * value if op == "multiply" else current + value
        raw = raw if lo is None else max(raw, lo)
        raw = raw if hi is None else min(raw, hi)
    new, note = in_domain(cfg, key, raw)
    set_knob(cfg, key, new)
    return new, note


def may_exceed(cfg: Any, key: str, threshold: float) -> bool:
    """Whether the knob ``key`` is, or may become by its schedule, above ``threshold``."""
    now = get_knob(cfg, key)
    sched = cfg.schedules.get(key)
    return (now is not None and now > threshold) or (sched is not None and any(v > threshold for v in sched.extremes()))


# --------------------------------------------------------------------------------------------------
# The knobs' settings as plain data (what the policy state carries, so a resume restores them)

COMPOSITION = ("scale", "offset", "min", "max")


def knob_settings(cfg: Any) -> dict[str, dict[str, float | None]]:
    """Every knob of run config ``cfg`` as plain data: ``{key: {"value": v}}``, and for a scheduled knob
    its composition with policy adjustments as well (``scale``, ``offset``, ``min``, ``max``)."""
    settings: dict[str, dict[str, float | None]] = {}
    for key in KNOBS:
        entry: dict[str, float | None] = {"value": get_knob(cfg, key)}
        sched = cfg.schedules.get(key)
        if sched is not None:
            entry.update({name: getattr(sched, name) for name in COMPOSITION})
        settings[key] = entry
    return settings


def apply_knob_settings(cfg: Any, settings: dict[str, dict[str, Any]], keep: Collection[str] = ()) -> None:
    """Set the knobs of run config ``cfg`` as ``settings`` (from ``knob_settings``) say, except those in
    ``keep`` (a resume's ``--set``) and those the settings do not name; a scheduled knob takes the
    composition too (its schedule stays the config's). All or nothing: ValueError when a setting does not
    fit (an unknown key, a value outside the knob's legal domain, bounds that cross), nothing changed."""
    updates = []
    for key, entry in settings.items():
        if key in keep:
            continue
        if key not in KNOBS or not isinstance(entry, dict) or "value" not in entry:
            raise ValueError(f"{key!r} is no knob setting")
        value, sched = entry["value"], cfg.schedules.get(key)
        if value is None and knob_field(type(cfg), key).annotation is float:
            raise ValueError(f"{key} cannot be empty")
        if value is not None and not domain(type(cfg), key).contains(float(value)):
            raise ValueError(f"{key} = {value!r} is outside its legal values ({domain(type(cfg), key).describe()})")
        if sched is not None and all(name in entry for name in COMPOSITION):
            sched = ScheduleConfig.model_validate({**sched.model_dump(), **{name: entry[name] for name in COMPOSITION}})
        updates.append((key, value, sched))
    for key, value, sched in updates:
        set_knob(cfg, key, value)
        if sched is not None:
            cfg.schedules[key] = sched
