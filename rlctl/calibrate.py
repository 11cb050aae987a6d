"""Proposing a policy from a healthy run: thresholds for KL, a grad-norm spike, an entropy floor,
repetition and the importance ratio, each with the evidence it was drawn from.

An upper limit is ``max(q + margin x |q|, just above the largest value seen)`` where ``q`` is the
``quantile`` of the run's values (``q x (1 + margin)`` for a positive q); a floor is symmetric (the
``1 - quantile`` quantile, less the margin, and just below the smallest value). A spike's factor is the
largest ratio of a value to the median of the values before it (as the spike trigger computes it),
times ``1 + margin``. Numbers are rounded outwards to three significant digits. A share (repetition,
degenerate_frac: at most 1) gets no limit of 1 or more (``> 1`` could never fire): it is capped, as
``>= 1`` (firing only on the maximum), or, when the run itself reached 1, left out. So no proposed rule
fires on the run it was drawn from; that is checked, not assumed: each rule is replayed through a
PolicyEngine on the same rows and its count written in its comment. Non-finite values (NaN, +-inf) are
the nonfinite rule's job: the limits are drawn from the finite values only, and the steps where the
rule's metric is not finite are left out of its replay too (its comment says how many).

A run that gives nothing to calibrate (every signal missing, constant or too short: one row, or
``--until`` 0 or 1) is an InputError, never a policy without rules.

The policy is YAML written as text (comments survive); ``rlctl.policies.validate_policy`` reads it back
into the very rules that were replayed.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlctl.errors import InputError
from rlctl.numbers import is_number
from rlctl.policies import Rule, validate_policy
from rlctl.rundir.layout import METRICS
from rlctl.rundir.record import HistoryRow, read_run
from rlctl.rundir.replay import replay

DIGITS = 3  # significant digits of a proposed number
SPIKE_WINDOW = 128
SPIKE_MIN_HISTORY = 16
MAX_TRIGGERS = 3
ENTROPY_COOLDOWN = 10
ROLLBACK_SKIP = ({"type": "rollback"}, {"type": "skip"})


@dataclass(frozen=True)
class Signal:
    """A failure signature calibrate proposes a rule for: the rule's name, the metrics that show it
    (the first the run has is used), which way it goes wrong, and what the rule does."""

    name: str
    metrics: tuple[str, ...]
    kind: Literal["upper", "floor", "spike"]
    what: str
    actions: tuple[dict[str, Any], ...]
    limits: dict[str, Any] = field(default_factory=lambda: {"max_triggers": MAX_TRIGGERS, "then": "halt"})
    bound: float | None = None  # the largest value the metric can take (a share: 1.0)


SIGNALS = (
    Signal(
        "kl",
        ("actor/ppo_kl",),
        "upper",
        "KL between the rollout policy and the updated actor: too large a step",
        ({"type": "rollback"}, {"type": "adjust", "multiply": {"actor.lr": 0.5}}),
    ),
    Signal("grad-spike", ("actor/grad_norm",), "spike", "a gradient-norm spike", ROLLBACK_SKIP),
    Signal(
        "entropy-floor",
        ("actor/entropy",),
        "floor",
        "entropy collapse, which often comes before degenerate output",
        ({"type": "warn"},),
        {"cooldown": ENTROPY_COOLDOWN},
    ),
    Signal(
        "repetition",
        ("response/repetition/mean", "response/degenerate_frac"),
        "upper",
        "repetitive, degenerate responses (the '!!!!' signature)",
        ROLLBACK_SKIP,
        bound=1.0,
    ),
    Signal(
        "ppo-ratio",
        ("actor/ppo_ratio/max",),
        "upper",
        "an importance ratio clipping cannot bound",
        ROLLBACK_SKIP,
    ),
)


@dataclass
class Proposal:
    """A proposed rule (as policy data), the comment lines of its evidence, and how many times it
    fires when replayed on the run."""

    signal: Signal
    metric: str
    rule: dict[str, Any]
    evidence: list[str]
    summary: str
    fired: int = 0


@dataclass
class Calibration:
    """What calibrate found in a run: the rules it proposes and the signals it left out (and why)."""

    source: str
    steps: tuple[int, int]
    rows: int
    quantile: float
    margin: float
    proposals: list[Proposal]
    left_out: list[tuple[Signal, str]]


# -- numbers --------------------------------------------------------------------------------------------
def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (not empty), interpolated linearly between order statistics."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def rounded(value: float, up: bool) -> float:
    """``value`` rounded to DIGITS significant digits, up (towards +inf) or down; exact as written."""
    if value == 0 or not math.isfinite(value):
        return value
    scale = 10.0 ** (math.floor(math.log10(abs(value))) - (DIGITS - 1))
    units = round(value / scale, 6)
    return float(number_text((math.ceil(units) if up else math.floor(units)) * scale))


def number_text(value: float) -> str:
    """A number as YAML and a `when:` read it back exactly: 0.00185, 3.2, 1.5e-07 (never 1e-07)."""
    text = f"{value:.{DIGITS}g}"
    mantissa, e, exponent = text.partition("e")
    return text if not e or "." in mantissa else f"{mantissa}.0e{exponent}"


def shown(value: float) -> str:
    """An observed number in a comment: four significant digits, one more than a limit has."""
    return f"{value:.4g}"


def beyond(value: float, up: bool) -> float:
    """The first DIGITS-digit number strictly above (``up``) or below ``value``."""
    step = max(abs(value) * 1e-3, 1e-12)
    return rounded(value + step if up else value - step, up)


def upper_limit(values: Sequence[float], q: float, margin: float) -> tuple[float, float]:
    """(the limit, the quantile value) of an upper threshold."""
    qv = quantile(values, q)
    return max(rounded(qv + margin * abs(qv), up=True), beyond(max(values), up=True)), qv


def floor_limit(values: Sequence[float], q: float, margin: float) -> tuple[float, float]:
    """(the floor, the low quantile value): symmetric to ``upper_limit``."""
    qv = quantile(values, 1 - q)
    return min(rounded(qv - margin * abs(qv), up=False), beyond(min(values), up=False)), qv


def spike_ratios(points: Sequence[tuple[int, float]], window: int, min_history: int) -> list[tuple[int, float]]:
    """(step, value / median of the previous ``window`` values) at every step where a spike trigger is
    armed; +inf where that median is 0 and the value above it (no factor bounds it)."""
    history: deque[float] = deque(maxlen=window)
    out = []
    for step, value in points:
        if len(history) >= min_history:
            median = statistics.median(history)
            if median > 0:
                out.append((step, value / median))
            elif value > median:
                out.append((step, math.inf))
        history.append(value)
    return out


# -- the proposals --------------------------------------------------------------------------------------
def calibrate(rows: Sequence[dict[str, Any]], quantile_: float, margin: float, source: str) -> Calibration:
    """Propose a rule for each of SIGNALS from ``rows`` (a healthy run's, in step order)."""
    if not rows:
        raise InputError(f"run {source} has no metric rows to calibrate from")
    steps = (rows[0]["step"], rows[-1]["step"])
    cal = Calibration(source, steps, len(rows), quantile_, margin, [], [])
    for signal in SIGNALS:
        metric = next((m for m in signal.metrics if any(is_number(r.get(m), finite=True) for r in rows)), None)
        if metric is None:
            cal.left_out.append((signal, f"this run never wrote {' or '.join(signal.metrics)}"))
            continue
        points = [(r["step"], float(r[metric])) for r in rows if is_number(r.get(metric), finite=True)]
        made = _propose(signal, metric, points, quantile_, margin)
        if isinstance(made, str):
            cal.left_out.append((signal, made))
            continue
        finite = [r for r in rows if not _nonfinite(r.get(metric))]  # the rest is the nonfinite rule's job
        made.fired = count_firings(made.rule, finite)
        skipped = len(rows) - len(finite)
        made.evidence.append(
            f"replayed on this run: fires {made.fired} times"
            + (f" (leaving out {_counted(skipped, 'step')} where {metric} was not finite)" if skipped else "")
        )
        cal.proposals.append(made)
    if not cal.proposals:
        why = "; ".join(f"{s.name}: {reason}" for s, reason in cal.left_out)
        raise InputError(
            f"run {source} gives nothing to calibrate from its {_counted(len(rows), 'row')} (steps {steps[0]}-{steps[1]}): {why}"
        )
    return cal


def _nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _counted(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _propose(signal: Signal, metric: str, points: list[tuple[int, float]], q: float, margin: float) -> Proposal | str:
    """The proposal for one signal, or why it is left out."""
    values = [v for _, v in points]
    if len(values) < 2:
        return f"{metric} has {len(values)} finite value in this run: too few to calibrate from"
    if min(values) == max(values):
        return f"{metric} was {number_text(values[0])} at every step: no spread to calibrate a limit from"
    if signal.kind == "spike":
        return _spike(signal, metric, points, margin)
    return _threshold(signal, metric, points, q, margin)


def _threshold(signal: Signal, metric: str, points: list[tuple[int, float]], q: float, margin: float) -> Proposal | str:
    values = [v for _, v in points]
    upper = signal.kind == "upper"
    limit, qv = upper_limit(values, q, margin) if upper else floor_limit(values, q, margin)
    extreme = max(points, key=lambda p: p[1]) if upper else min(points, key=lambda p: p[1])
    past = sum(v > qv for v in values) if upper else sum(v < qv for v in values)
    op, word, sign = (">", "max", "+") if upper else ("<", "min", "-")
    qname = f"{number_text(q if upper else 1 - q)} quantile"
    evidence = [
        f"{metric}: {signal.what}.",
        f"over {len(values)} steps: {qname} {shown(qv)}, {word} {shown(extreme[1])} "
        f"(step {extreme[0]}); {past} step{'s' if past != 1 else ''} beyond the quantile itself.",
        f"limit: {'max' if upper else 'min'}({qname} {sign} {number_text(margin)} x |it|, just "
        f"{'above the max' if upper else 'below the min'}) = {number_text(limit)}.",
    ]
    if upper and signal.bound is not None and limit >= signal.bound:
        bound = number_text(signal.bound)
        if extreme[1] >= signal.bound:
            return (
                f"{metric} reached {bound}, the most a share can be, at step {extreme[0]}: no limit above it can fire"
            )
        op, limit = ">=", signal.bound
        evidence.append(
            f"capped at {bound}: a share is never above it, so this rule fires only when {metric} is {bound}."
        )
    when = f"{metric} {op} {number_text(limit)}"
    rule = {"name": signal.name, "description": _sentence(signal.what), "when": when}
    rule |= {"actions": list(signal.actions), **signal.limits}
    summary = f"{when}  ({qname} {shown(qv)}, {word} {shown(extreme[1])})"
    return Proposal(signal, metric, rule, evidence, summary)


def _spike(signal: Signal, metric: str, points: list[tuple[int, float]], margin: float) -> Proposal | str:
    min_history = max(2, min(SPIKE_MIN_HISTORY, len(points) // 2))
    ratios = spike_ratios(points, SPIKE_WINDOW, min_history)
    if not ratios:
        return f"{metric} has {len(points)} values: too few to arm a spike trigger"
    top = max(ratios, key=lambda p: p[1])
    if not math.isfinite(top[1]):
        return f"the median of {metric} before step {top[0]} was 0: no factor of it can be calibrated"
    factor = max(rounded(top[1] * (1 + margin), up=True), beyond(top[1], up=True), 1.0)
    evidence = [
        f"{metric}: {signal.what}.",
        f"over {len(ratios)} armed steps (once {min_history} values are known): the largest value / median "
        f"of the values before it is {shown(top[1])} (step {top[0]}).",
        f"factor: max({shown(top[1])} x (1 + {number_text(margin)}), just above it) = {number_text(factor)}.",
    ]
    trigger = {"kind": "spike", "metric": metric, "factor": factor, "baseline": "median"}
    trigger |= {"window": SPIKE_WINDOW, "min_history": min_history}
    rule = {"name": signal.name, "description": _sentence(signal.what), "trigger": trigger}
    rule |= {"actions": list(signal.actions), **signal.limits}
    summary = f"{metric} > {number_text(factor)} x median  (largest ratio {shown(top[1])} at step {top[0]})"
    return Proposal(signal, metric, rule, evidence, summary)


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def as_rule(rule: dict[str, Any]) -> Rule:
    """A proposed rule validated as a policy file would be."""
    return validate_policy({"rules": [rule]}, source=f"rule {rule['name']} (calibrated)").rules[0]


def count_firings(rule: dict[str, Any], rows: Sequence[dict[str, Any]]) -> int:
    """How many times ``rule`` fires when ``rows`` (kept rows, in step order) are replayed through it."""
    return len(replay([HistoryRow(r) for r in rows], [as_rule(rule)]))


# -- the policy file, as text -----------------------------------------------------------------------------
def render(cal: Calibration) -> str:
    """The proposed policy as YAML text, each rule under the comment of its evidence."""
    first, last = cal.steps
    header = (
        f"Proposed by `rlctl policy calibrate` from {cal.source}, steps {first}-{last} ({cal.rows} rows), "
        f"quantile {number_text(cal.quantile)}, margin {number_text(cal.margin)}. An upper limit is "
        "max(quantile + margin x |quantile|, just above the max seen); a floor is symmetric; a spike's factor "
        "is the largest value / median ratio seen x (1 + margin). Rolling back needs snapshots "
        "(checkpoint.every > 0). Try it on another run: rlctl policy replay RUN --policy THIS_FILE"
    )
    lines = [
        *(f"# {line}" for line in textwrap.wrap(header, 100, break_on_hyphens=False)),
        f"description: {json.dumps(f'Thresholds calibrated on {cal.source}, steps {first}-{last}.')}",
        "rules:",
    ]
    for p in cal.proposals:
        lines += [f"  # {text}" for text in p.evidence]
        lines += _rule_lines(p.rule)
    for signal, why in cal.left_out:
        lines.append(f"  # left out {signal.name}: {why}.")
    return "\n".join(lines) + "\n"


def _rule_lines(rule: dict[str, Any]) -> list[str]:
    out = [f"  - name: {rule['name']}"]
    for key, value in rule.items():
        if key == "name":
            continue
        if key == "actions":
            out += ["    actions:", *(f"      - {_flow(a)}" for a in value)]
        elif key == "trigger":
            out += ["    trigger:", *(f"      {k}: {_flow(v)}" for k, v in value.items())]
        else:
            out.append(f"    {key}: {_flow(value)}")
    return out


def _flow(value: Any) -> str:
    """A value in YAML flow style: strings quoted (JSON's quoting is YAML's), numbers exact."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return number_text(value)
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)


def summary_lines(cal: Calibration) -> list[str]:
    """The stderr summary: one line per proposed rule, then what was left out."""
    first, last = cal.steps
    lines = [f"calibrated on {cal.rows} rows of {cal.source} (steps {first}-{last}):"]
    width = max((len(p.signal.name) for p in cal.proposals), default=0)
    lines += [f"  {p.signal.name.ljust(width)}  {p.summary}; fires {p.fired} times here" for p in cal.proposals]
    lines += [f"  left out {s.name}: {why}" for s, why in cal.left_out]
    return lines


def run_rows(url: str, until: int | None, warn=None, timeout: float | None = None) -> list[dict[str, Any]]:
    """The rows of the run's metrics.jsonl (the history it kept; rows it turned away from are left
    out), up to step ``until``; a line that cannot be read is skipped and said through ``warn``.
    ``timeout``: as ``read_run``'s."""
    record = read_run(url, timeout)
    rows = [r for r in record.rows if until is None or r["step"] <= until]
    for text in record.warnings() if warn is not None else ():
        warn(text)
    if not rows:
        upto = f" up to step {until}" if until is not None else ""
        raise InputError(
            f"run {record.url} has no metric rows{upto} ({METRICS} is missing or empty): nothing to calibrate"
        )
    return rows
