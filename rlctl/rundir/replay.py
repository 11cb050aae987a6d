"""Trying policies on a recorded run: its whole metric history, replayed through a PolicyEngine that
acts on nothing, and where each rule would have fired.

The history is what the live run saw: the rows of metrics.jsonl and the abandoned ones
(metrics.abandoned.jsonl, each tagged by the rollback or resume that turned away from it), in the order
they were written (``rlctl.rundir.record``). Where the history goes back to an earlier step (a turn), the
engine is set as the live run's was: after a rollback, rewound to the step before (its trigger counts
kept); after a resume, the snapshot's state or the one policy_state.json carried, or a fresh state when
the resume found no snapshot and started over (``Turns``). So replaying a run with the policy it ran
under lists the firings of its events.jsonl.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rlctl.errors import ConfigError, InputError
from rlctl.events import RESUME
from rlctl.numbers import NOT_METRICS
from rlctl.policies import Firing, PolicyEngine, Rule, load_policies
from rlctl.rundir.directory import read_config_data
from rlctl.rundir.layout import METRICS
from rlctl.rundir.record import HistoryRow, read_run
from rlctl.storage import Storage

Warn = Callable[[str], None]


@dataclass(frozen=True)
class Replayed:
    """A firing of the replay, and the tag of the turn that later abandoned its row (None if kept)."""

    firing: Firing
    turned: dict[str, Any] | None

    def record(self) -> dict[str, Any]:
        """The firing as events.jsonl would hold it (without ``event``), and ``turned_away``."""
        event = {k: v for k, v in self.firing.as_event().items() if k != "event"}
        return {**event, "turned_away": self.turned.get("event") if self.turned else None}


# -- the history --------------------------------------------------------------------------------------
def read_history(url: str, warn: Warn | None = None, timeout: float | None = None) -> list[HistoryRow]:
    """The run's metric rows, kept and abandoned, in the order they were written. A line that cannot
    be read is skipped and said once per file (through ``warn``); a run without any row is an
    InputError, a directory that is no run a ConfigError. ``timeout``: as ``read_run``'s."""
    record = read_run(url, timeout)
    history = record.history
    for text in record.warnings() if warn is not None else ():
        warn(text)
    if not history:
        raise InputError(f"run {record.url} has no metric rows ({METRICS} is missing or empty): nothing to replay")
    return history


# -- the policies -------------------------------------------------------------------------------------
def policy_rules(url: str, files: Sequence[str | os.PathLike[str]], timeout: float | None = None) -> list[Rule]:
    """The rules of the policy ``files``, or, when none is named, of the policies the run ran under
    (its config.yaml holds them inline, read within ``timeout`` as ``read_run``'s)."""
    if files:
        return load_policies(files)
    config = read_config_data(Storage(url) if timeout is None else Storage.for_reading(url, timeout))
    specs = config.get("policies")
    if not specs:
        raise ConfigError(f"run {url} ran without policies; name the policy to replay with --policy FILE")
    return load_policies(specs)


# -- the replay ---------------------------------------------------------------------------------------
def replay(history: Iterable[HistoryRow], rules: Sequence[Rule]) -> list[Replayed]:
    """Every firing of ``rules`` over ``history``, acting on nothing. Where the history goes back to an
    earlier step, the engine's state is what the live run's was after that turn (``Turns``)."""
    engine = PolicyEngine(rules)
    turns = Turns(engine, snapshot_at_start=any(a.type == "rollback" for r in rules for a in r.actions))
    out: list[Replayed] = []
    previous: HistoryRow | None = None
    for item in history:
        if previous is not None and item.step <= previous.step:
            turns.turn(item.step - 1, resumed=(previous.turned or {}).get("event") == RESUME)
        firings = engine.evaluate(item.step, item.row)
        turns.evaluated(item.step, halted=any(a.type == "halt" for f in firings for a in f.actions))
        out += [Replayed(f, item.turned) for f in firings]
        previous = item
    return out


class Turns:
    """The policy state a live run carries across a turn (rlctl.engine.recovery): a rollback rewinds
    the live state (counts kept) and writes it to policy_state.json as of the step rolled back to, as a
    halt does as of its step; a resume takes the snapshot's state, or the file's when the file is of the
    snapshot's step or later (rewound to it). A resume that found no snapshot started over (``rlctl.engine.
    recovery.Recovery.resume``: no restore, so nothing carried): a fresh state, and policy_state.json stays as it
    was. That is a turn to step -1 (the fresh run wrote its step 0 again), or to step 0 when the run had
    no snapshot of step 0: a run whose policy rolls back (``snapshot_at_start``) always snapshots step 0
    before training. The turn's kind is the tag of the row just before it (the turn abandoned that row)."""

    def __init__(self, engine: PolicyEngine, snapshot_at_start: bool = False):
        self.engine = engine
        self.snapshot_at_start = snapshot_at_start
        self.fresh = engine.state_dict()
        self.snapshots: dict[int, dict[str, Any]] = {}  # the state after each step of the current path
        self.persisted: tuple[int, dict[str, Any]] | None = None  # what policy_state.json holds

    def evaluated(self, step: int, halted: bool) -> None:
        self.snapshots[step] = self.engine.state_dict()
        if halted:
            self.persisted = (step, self.snapshots[step])

    def turn(self, step: int, resumed: bool) -> None:
        """The run went back to ``step``: by a resume from its snapshot (or from none), or a rollback."""
        if resumed and (step < 0 or (step == 0 and not self.snapshot_at_start)):
            self.engine.load_state_dict(self.fresh)  # started over: no snapshot, nothing carried
            return
        if resumed and (self.persisted is None or self.persisted[0] < step):
            self.engine.load_state_dict(self.snapshots.get(step, self.fresh))
            return
        if resumed:
            self.engine.load_state_dict(self.persisted[1])  # type: ignore[index]
        self.engine.rewind(step)
        self.persisted = (step, self.engine.state_dict())


def firing_counts(replayed: Sequence[Replayed], rules: Sequence[Rule]) -> dict[str, list[int]]:
    """For each rule, in rule order, the steps where it fired (empty: it never fired)."""
    steps: dict[str, list[int]] = {r.name: [] for r in rules}
    for item in replayed:
        steps[item.firing.rule].append(item.firing.step)
    return steps


def metric_keys(history: Iterable[HistoryRow]) -> set[str]:
    """Every metric key the run wrote, kept or abandoned (``step`` and ``timestamp`` aside)."""
    return {k for item in history for k in item.row if k not in NOT_METRICS}
