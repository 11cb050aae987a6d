"""Choosing snapshots: one selection for a resume (``--from``), an export (``--step``) and a policy's
rollback, and the plan a resume carries to every rank.

A spec (latest, last-good, best, step-N or N) names candidates in the run's catalog, best first
(``select``); those that cannot be used come with their problem and are skipped, each said. "best" is a
choice like an explicit step: the first usable of the best snapshots alone, never another one after
it. A rollback chooses among the good snapshots old enough (``rollback_candidates``). Trying the
candidates in order, then turning the run away from the steps after the one restored, is one turn for
a resume and a rollback alike (``rlctl.engine.recovery``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlctl.checkpoint.catalog import Catalog, SnapshotInfo, parse_step_spec
from rlctl.errors import SnapshotError
from rlctl.rundir.snapshots import ACTOR_STAGE, CRITIC_STAGE

Note = Callable[[str], None]


@dataclass(frozen=True)
class Selection:
    """The candidates a spec chose, best first, those that cannot be used among them."""

    spec: str  # as the user typed it
    wanted: int | str  # parsed
    option: str  # the option that named it
    url: str  # where the snapshots are
    candidates: tuple[SnapshotInfo, ...]

    @property
    def usable(self) -> list[SnapshotInfo]:
        return [c for c in self.candidates if c.usable]

    def first(self) -> SnapshotInfo:
        """The first usable candidate; a SnapshotError when there is none."""
        first = next((c for c in self.candidates if c.usable), None)
        if first is None:
            why = f" ({self.candidates[0].name}: {self.candidates[0].problem})" if self.candidates else ""
            raise SnapshotError(f"no usable snapshot for {self.option} {self.spec} in {self.url}{why}")
        return first

    def skip(self, note: Note, before: SnapshotInfo | None = None) -> None:
        """Say (to ``note``) why each candidate that cannot be used is skipped; with ``before``, only
        those ahead of it."""
        ahead = self.candidates[: self.candidates.index(before)] if before is not None else self.candidates
        for bad in (c for c in ahead if not c.usable):
            note(f"warning: skipping snapshot {bad.name}: {bad.problem}")


def select(catalog: Catalog, spec: str, option: str) -> Selection:
    """The candidates ``spec`` chooses in ``catalog``, best first. An explicit step that cannot be used,
    no good snapshot for last-good, and no usable one among the best are SnapshotErrors (so are an
    explicit step that is not there and a "best" no snapshot records: ``catalog.candidates``)."""
    wanted = parse_step_spec(spec, option)
    candidates = catalog.candidates(wanted)
    url = catalog.storage.url
    if isinstance(wanted, int) and candidates[0].problem:
        raise SnapshotError(f"snapshot {candidates[0].name} is not usable: {candidates[0].problem}")
    if wanted == "last-good" and not candidates:
        raise SnapshotError(f"no good snapshot in {url}")
    if wanted == "best":
        first = next((c for c in candidates if c.usable), None)
        if first is None:
            raise SnapshotError(
                f"no good snapshot in {url} that records {catalog.best_rule.metric} is usable "
                f"(the best, {candidates[0].name}: {candidates[0].problem})"
            )
        candidates = candidates[: candidates.index(first) + 1]
    return Selection(spec, wanted, option, url, tuple(candidates))


def rollback_candidates(
    catalog: Catalog, step: int, min_steps_back: int, best: tuple[str, str] | None
) -> list[SnapshotInfo]:
    """The usable good snapshots a rollback at ``step`` tries, best first: with ``best`` (the rule's
    metric and mode) the ones holding the best value of that metric, then (when none records it, or
    every one fails) the newest good ones; otherwise the newest good ones at least ``min_steps_back``
    steps back. Their manifests are read, not their files: the restore verifies every file it reads,
    and a broken one is skipped then."""
    horizon = step - min_steps_back
    newest = [i for i in reversed(catalog.scan(files=False)) if i.usable and i.good and i.step <= horizon]
    if best is None:
        return newest
    ranked = [i for i in catalog.best(*best, files=False) if i.step <= step]
    tried = {i.step for i in ranked}
    return ranked + [i for i in newest if i.step not in tried]


@dataclass(frozen=True)
class ResumePlan:
    """What the driver decided for a resume, the same for every rank: the snapshots to try (each rank
    scans them itself), best first, and what ``resume --set`` changed. It travels to ranks in other
    processes as plain data (``as_data`` / ``from_data``) or pickled."""

    wanted: int | str  # the --from spec, parsed: the resume event's "from"
    names: tuple[str, ...] = ()  # the usable snapshots to try, best first; none: the run starts over
    from_step: int = 0  # the first one's step: where the run goes on unless that one fails to load
    changes: dict[str, Any] = field(default_factory=dict)  # resume --set: {dotted key: {"from", "to"}}
    # the first one's ZeRO stages as its manifest records them ({manifest key: stage}): the engines are
    # built for them (``rlctl.rundir.snapshots.trained_stages``); none: the run starts over
    stages: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, selection: Selection, changes: dict[str, Any]) -> ResumePlan:
        usable = selection.usable
        first = (usable[0].manifest or {}) if usable else {}
        stages = {key: first[key] for key in (ACTOR_STAGE, CRITIC_STAGE) if key in first}
        return cls(selection.wanted, tuple(i.name for i in usable), usable[0].step if usable else 0, changes, stages)

    def as_data(self) -> dict[str, Any]:
        return {
            "wanted": self.wanted,
            "names": list(self.names),
            "from_step": self.from_step,
            "changes": self.changes,
            "stages": self.stages,
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> ResumePlan:
        return cls(data["wanted"], tuple(data["names"]), data["from_step"], data["changes"], data["stages"])

    def snapshots(self, catalog: Catalog) -> list[SnapshotInfo]:
        """The planned snapshots as this rank finds them, best first; a SnapshotError when none of them
        is there any more."""
        infos = {i.name: i for i in catalog.scan()}
        found = [infos[n] for n in self.names if n in infos]
        if self.names and not found:
            raise SnapshotError(
                f"the snapshots to resume from ({', '.join(self.names)}) are no longer in {catalog.storage.url}"
            )
        return found
