"""Which snapshots retention keeps: small pure rules over the catalog's infos, each ``keep(infos)`` the
steps it keeps. A snapshot is purged only when no rule keeps it, only when ``keep_last`` is set, only
after a commit, and only when it is usable: what cannot be read (unreadable, damaged or of another
format) is never deleted.

Always kept: the newest usable snapshot and the newest good one (``KeepNewest``), the steps a pending
rollback needs (``Protect``, chosen before each save by ``RollbackReach``: the newest good snapshot a
rollback of the policies' longest ``steps_back`` would go to) and the best by each metric a policy
rolls back to (``KeepBest`` of 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rlctl.checkpoint.catalog import VAL_METRIC, BestRule, SnapshotInfo


class Rule(Protocol):
    def keep(self, infos: Sequence[SnapshotInfo]) -> set[int]:
        """The steps of ``infos`` this rule keeps."""
        ...


def _usable(infos: Sequence[SnapshotInfo]) -> list[SnapshotInfo]:
    return [i for i in infos if i.usable]


@dataclass(frozen=True)
class KeepLast:
    """The ``n`` newest usable snapshots."""

    n: int

    def keep(self, infos: Sequence[SnapshotInfo]) -> set[int]:
        return {i.step for i in _usable(infos)[-self.n :]}


@dataclass(frozen=True)
class KeepNewest:
    """The newest usable snapshot and the newest usable good one."""

    def keep(self, infos: Sequence[SnapshotInfo]) -> set[int]:
        usable = _usable(infos)
        good = [i for i in usable if i.good]
        return {i.step for i in usable[-1:] + good[-1:]}


@dataclass(frozen=True)
class KeepEvery:
    """The usable snapshots whose step is a multiple of ``every`` (0: none)."""

    every: int

    def keep(self, infos: Sequence[SnapshotInfo]) -> set[int]:
        return {i.step for i in _usable(infos) if i.step % self.every == 0} if self.every else set()


@dataclass(frozen=True)
class KeepBest:
    """The ``k`` best usable good snapshots by the validation ``metric`` their manifest records, higher
    (``mode`` "max") or lower ("min") first (``BestRule``)."""

    metric: str = VAL_METRIC
    mode: str = "max"
    k: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min") or self.k < 1:
            raise ValueError(f"KeepBest needs mode max or min and k >= 1; got mode {self.mode!r}, k {self.k}")

    @property
    def rule(self) -> BestRule:
        return BestRule(self.metric, self.mode)

    def keep(self, infos: Sequence[SnapshotInfo]) -> set[int]:
        good = [i for i in _usable(infos) if i.good]
        return {i.step for i in self.rule.rank(good)[: self.k]}


@dataclass(frozen=True)
class Protect:
    """The given steps, whatever they are (the snapshot a pending rollback needs)."""

    steps: frozenset[int] = frozenset()

    def keep(self, infos: Sequence[SnapshotInfo]) -> set[int]:
        return set(self.steps)


@dataclass(frozen=True)
class RollbackReach:
    """The newest good committed snapshot a rollback of ``back`` steps from ``step`` would need: at
    most ``step - back`` (none when no policy steps back)."""

    step: int
    back: int

    def keep(self, infos: Sequence[SnapshotInfo]) -> set[int]:
        if not self.back:
            return set()
        needed = [i.step for i in infos if i.good and i.step <= self.step - self.back]
        return set(needed[-1:])


def kept(infos: Sequence[SnapshotInfo], rules: Iterable[Rule]) -> set[int]:
    """The steps of ``infos`` some rule keeps."""
    return set().union(*(rule.keep(infos) for rule in rules))


@dataclass
class Retention:
    """A run's retention: keep_last, keep_every, keep_best (checkpoint.*), the steps ``protected`` for a
    pending rollback and the best by each metric a policy may roll back to (``rollback_best``)."""

    keep_last: int | None = None  # None: keep every snapshot
    keep_every: int = 0  # also keep steps that are multiples of this (0: none)
    protected: set[int] = field(default_factory=set)  # steps a pending rollback needs
    best: KeepBest | None = None  # also keep the k best good snapshots by a validation metric
    rollback_best: tuple[KeepBest, ...] = ()  # and the best by each metric a policy may roll back to

    def rules(self) -> list[Rule]:
        """Every rule of this retention (with keep_last set: without it, nothing is purged)."""
        best = [*([self.best] if self.best is not None else []), *self.rollback_best]
        last = [KeepLast(self.keep_last)] if self.keep_last is not None else []
        return [*last, KeepNewest(), KeepEvery(self.keep_every), Protect(frozenset(self.protected)), *best]

    def purgeable(self, infos: Sequence[SnapshotInfo]) -> list[SnapshotInfo]:
        """The usable snapshots of ``infos`` no rule keeps, oldest first (none without keep_last)."""
        if self.keep_last is None:
            return []
        keep = kept(infos, self.rules())
        return [i for i in infos if i.usable and i.step not in keep]
