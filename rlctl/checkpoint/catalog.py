"""The read side of a run's snapshots: which there are, which are usable, which to choose.

A ``Catalog`` lists the step directories (``rlctl.checkpoint.layout``) and reads each one's manifest;
it writes nothing but the tidying a run's writer asks of it (``remove_uncommitted``), and needs none
of the machinery that writes snapshots: listing, choosing and checking them builds only this.

A directory without a manifest file is not a snapshot but the commit protocol's own unfinished
temporary: it is never chosen, and the run's writer removes it at start. A directory whose manifest
exists but cannot be read (garbage, truncated, fields of the wrong shape) is not chosen either, and
the run's writer moves it to ``quarantine/`` and says so: rlctl deletes only what it can prove is its
own. "latest" is found by listing, never from a pointer file.

A manifest records the run's last validation when there was one (``val``: the step validated and its
metrics): "best" (``candidates``, ``best``) and retention's ``KeepBest`` rank snapshots by it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlctl import events
from rlctl.checkpoint.layout import MANIFEST, quarantine_name, step_of
from rlctl.checkpoint.manifest import FORMAT, UnreadableManifest, parse_manifest, stored_checksum_problem
from rlctl.errors import SnapshotError
from rlctl.storage import Storage

EventFn = Callable[[dict[str, Any]], None]

SPECS = ("latest", "last-good", "best")


SPEC_WORDS = "latest, last-good, best, step-N or N"


def parse_step_spec(spec: str, option: str = "--from") -> int | str:
    """'latest' | 'last-good' | 'best' | 'step-500' | '500' -> 'latest' | 'last-good' | 'best' | 500; any
    other is a SnapshotError naming ``option``, the one the user typed (resume's --from, export's --step)."""
    if spec in SPECS:
        return spec
    m = re.fullmatch(r"(?:step-)?0*(\d+)", spec)
    if not m:
        raise SnapshotError(f"{option} expects {SPEC_WORDS}; got {spec!r}")
    return int(m.group(1))


@dataclass(frozen=True)
class Topology:
    """One fact besides the world size that a snapshot's files are laid out for (a directory-Stateful's
    topology, e.g. how an engine partitions its state): recorded in the manifest under ``key``; a
    snapshot that recorded another value (nor one of ``also``) is not usable, and ``mismatch`` (formatted
    with ``recorded`` and ``value``) says why."""

    key: str
    value: Any
    mismatch: str
    also: tuple[Any, ...] = ()  # other recorded values the run loads too (converting the files as it loads)
    absent: Any = None  # what a manifest without the key recorded (one written before the key was)

    def recorded(self, manifest: dict[str, Any]) -> Any:
        return manifest.get(self.key, self.absent)

    def problem(self, manifest: dict[str, Any]) -> str | None:
        recorded = self.recorded(manifest)
        if recorded == self.value or recorded in self.also:
            return None
        return self.mismatch.format(recorded=recorded, value=self.value)


@dataclass
class SnapshotInfo:
    step: int
    name: str
    manifest: dict[str, Any] | None = None
    problem: str | None = None  # why the snapshot is not usable
    unreadable: bool = False  # its manifest exists but cannot be read: quarantined, never deleted

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def usable(self) -> bool:
        return self.committed and self.problem is None

    @property
    def good(self) -> bool:
        return bool(self.manifest) and self.manifest.get("good") is True

    @property
    def _val(self) -> dict[str, Any]:
        """The manifest's last validation (checked in a manifest of this format; ignored in another)."""
        m = self.manifest or {}
        return (m.get("val") or {}) if m.get("format") == FORMAT else {}

    @property
    def val_step(self) -> int | None:
        """The step of the run's last validation when the snapshot was taken (None: none yet)."""
        return self._val.get("step")

    def val_metric(self, name: str) -> float | None:
        """The value of validation metric ``name`` the manifest records (None when it records none)."""
        value = self._val.get("metrics", {}).get(name)
        return None if value is None else float(value)

    def as_row(self, metric: str | None = None) -> dict[str, Any]:
        """The snapshot as a row of ``rlctl checkpoints``; with ``metric``, also its recorded value of
        that validation metric (a key of its name) and ``val_step``."""
        m = self.manifest or {}
        created, size = m.get("created"), m.get("total_bytes")  # (a manifest of another format: any shape)
        return {
            "step": self.step,
            "name": self.name,
            "time": created if isinstance(created, str) else None,
            "bytes": size if isinstance(size, int) and not isinstance(size, bool) else None,
            "committed": self.committed,
            "good": self.good,
            "usable": self.usable,
            "problem": self.problem,
            **({metric: self.val_metric(metric), "val_step": self.val_step} if metric is not None else {}),
        }


VAL_METRIC = "val/score/mean"  # what "best" ranks by unless checkpoint.keep_best names another (its default)


@dataclass(frozen=True)
class BestRule:
    """Which snapshots are the best: by the validation ``metric`` their manifest records, higher
    (``mode`` "max") or lower ("min") first."""

    metric: str = VAL_METRIC
    mode: str = "max"

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise ValueError(f"the best snapshots need mode max or min; got mode {self.mode!r}")

    def rank(self, infos: Sequence[SnapshotInfo]) -> list[SnapshotInfo]:
        """Those of ``infos`` taken at a validated step that record the metric, best first (of equal
        values, the earlier step). A snapshot taken between validations carries the last one's value,
        which its own weights never scored: it never ranks."""
        sign = -1.0 if self.mode == "max" else 1.0
        scored = [
            (value, i) for i in infos if i.step == i.val_step and (value := i.val_metric(self.metric)) is not None
        ]
        scored.sort(key=lambda vi: (sign * vi[0], vi[1].step))
        return [i for _, i in scored]


class Catalog:
    """One run's snapshots as they lie on ``storage``: ``scan`` (every step directory, and why one is
    not usable here), ``candidates`` (what a spec such as "latest" or "best" chooses), ``best`` and
    ``quarantine``. ``world_size`` and ``topology``: what a snapshot must have been written for to be
    usable here; ``keep_best``: what "best" means for the run (checkpoint.keep_best; None: the highest
    val/score/mean); ``on_event`` hears of every snapshot quarantined. ``elastic``: a snapshot of another
    world size is usable too (the run's engines convert their files as they load them,
    ``rlctl.checkpoint.elastic``); else ``fixed_world`` says why it is not, after the mismatch."""

    def __init__(
        self,
        storage: Storage,
        *,
        world_size: int = 1,
        topology: Sequence[Topology] = (),
        keep_best: BestRule | None = None,
        on_event: EventFn | None = None,
        elastic: bool = False,
        fixed_world: str = "",
    ):
        self.storage = storage
        self.world_size = world_size
        self.elastic, self.fixed_world = elastic, fixed_world
        self.topology = tuple(topology)
        self.keep_best = keep_best
        self.on_event = on_event or (lambda event: None)
        self.quarantined: list[SnapshotInfo] = []  # moved aside by remove_uncommitted, with the reason

    @property
    def best_rule(self) -> BestRule:
        """What "best" means for this run: checkpoint.keep_best's rule, else the highest val/score/mean."""
        return self.keep_best or BestRule()

    # -- discovery ---------------------------------------------------------------------------------
    def step_dirs(self) -> list[tuple[int, str]]:
        """(step, directory name) of every step directory, oldest first."""
        return sorted((step, name) for name in self.storage.listdir() if (step := step_of(name)) is not None)

    def scan(self, deep: bool = False, files: bool = True) -> list[SnapshotInfo]:
        """Every step directory, committed or not, oldest first. ``files``: also check that every file
        its manifest lists is there with its size (False: the manifest alone, for a caller that restores
        the snapshot it picks, which verifies every file it reads); ``deep`` also checks every sha256 (on
        any storage, streamed)."""
        infos = [SnapshotInfo(step, name) for step, name in self.step_dirs()]
        for info in infos:
            self._inspect(info, deep, files)
        return infos

    def _inspect(self, info: SnapshotInfo, deep: bool, files: bool = True) -> None:
        try:
            raw = self.storage.read_bytes(info.name, MANIFEST)
        except FileNotFoundError:
            info.problem = "no manifest: never committed (interrupted or in progress)"
            return
        try:
            info.manifest = parse_manifest(raw)
        except UnreadableManifest as exc:
            info.problem, info.unreadable = str(exc), True
            return
        info.problem = self._problem(info, deep, files)

    def _problem(self, info: SnapshotInfo, deep: bool, files: bool = True) -> str | None:
        m = info.manifest or {}
        if m["format"] != FORMAT:
            return f"manifest format {m['format']!r}; this rlctl reads format {FORMAT}"
        if m["step"] != info.step:
            return f"its manifest is of step {m['step']}, not of step {info.step}"
        if m["world_size"] != self.world_size and not self.elastic:
            why = f" ({self.fixed_world})" if self.fixed_world else ""
            return f"written by {m['world_size']} rank(s); this run has {self.world_size}{why}"
        for fact in self.topology:
            if (problem := fact.problem(m)) is not None:
                return problem
        if not (files or deep):
            return None
        sizes = self.storage.file_sizes(info.name)
        for rel, meta in m["files"].items():
            if rel not in sizes:
                return f"file {rel} is missing"
            if (size := sizes[rel]) != meta["size"]:
                return f"file {rel} has {size} bytes; the manifest says {meta['size']}"
        return stored_checksum_problem(self.storage, info.name, m) if deep else None

    # -- choosing ----------------------------------------------------------------------------------
    def best(self, metric: str, mode: str, files: bool = True) -> list[SnapshotInfo]:
        """The usable good snapshots of validated steps that record validation ``metric``, best first
        (``mode`` "max": highest first; "min": lowest; of equal values the earlier step). ``files``: as
        for ``scan``."""
        return BestRule(metric, mode).rank([i for i in self.scan(files=files) if i.usable and i.good])

    def candidates(self, spec: int | str) -> list[SnapshotInfo]:
        """Snapshots to try for ``spec``, best first. An explicit step gives that one only; "best" the
        good committed snapshots that record ``best_rule``'s metric, best value first (raises when none
        does). Those that cannot be read (in place, or quarantined by this catalog) come with their
        ``problem`` and are never usable: the caller says why it skips them."""
        infos = self.scan()
        if spec == "best":
            return self._best_candidates(infos)
        if isinstance(spec, int):
            match = [i for i in infos if i.step == spec] or [i for i in self.quarantined if i.step == spec][-1:]
            if not match:
                steps = ", ".join(str(i.step) for i in infos if i.usable) or "none"
                raise SnapshotError(f"no snapshot of step {spec} in {self.storage.url} (usable steps: {steps})")
            return match
        found = [i for i in infos if i.committed or i.unreadable] + self.quarantined
        ordered = sorted(found, key=lambda i: i.step, reverse=True)
        return [i for i in ordered if i.good] if spec == "last-good" else ordered

    def _best_candidates(self, infos: list[SnapshotInfo]) -> list[SnapshotInfo]:
        rule = self.best_rule
        ranked = rule.rank([i for i in infos if i.committed and i.good])
        if not ranked:
            raise SnapshotError(
                f"no good snapshot in {self.storage.url} records the validation metric {rule.metric} (a "
                "snapshot records it once the run has validated: trainer.val_every)"
            )
        return ranked

    # -- tidying (the run's writer alone) --------------------------------------------------------------
    def remove_uncommitted(self) -> list[int]:
        """Tidy up before choosing a snapshot (call only as the run's writer): delete the step
        directories without a manifest file, the commit protocol's own unfinished temporaries, and move
        those whose manifest cannot be read to quarantine/ (never deleted; each is reported and listed
        in ``quarantined``, with the reason and where it went in its ``problem``). Returns the steps
        deleted."""
        removed = []
        for info in self.scan():
            if info.unreadable:
                self.quarantine(info)
            elif not info.committed:
                self.storage.rm(info.name, recursive=True)
                removed.append(info.step)
        return removed

    def quarantine(self, info: SnapshotInfo) -> None:
        """Move the unusable snapshot ``info`` aside to quarantine/ (never deleted) and say so."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest, n = quarantine_name(info.name, stamp), 1
        while self.storage.exists(dest):
            dest, n = quarantine_name(info.name, stamp, n), n + 1
        self.storage.move_dir(info.name, dest)
        reason, location = info.problem, self.storage.url_of(dest)
        info.problem = f"{reason}; moved to {location}"
        self.quarantined.append(info)
        self.on_event({"event": events.SNAPSHOT_QUARANTINED, "step": info.step, "reason": reason, "location": location})
