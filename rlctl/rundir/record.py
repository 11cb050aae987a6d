"""A run read back, one way, for every reader: `rlctl inspect`, `rlctl runs`, `policy replay`, `policy
calibrate` and the summary at the end of a run.

A ``RunRecord`` reads each file of the run directory once, when first asked for, and never writes: the
config as written (``config``), the metric rows kept (``rows``) and those a rollback or resume turned
away from (``abandoned``), both in the order they were written (``history``), the events, the lease,
and from these the last outcome and the status. It never imports torch (cron scripts call it). A line of
metrics.jsonl, metrics.abandoned.jsonl or events.jsonl that cannot be read is skipped and said once per
file (``warnings``), never fatal.

For the process that runs the run, two readings of its end: ``ended_since`` (whether an outcome was
recorded after a point of events.jsonl) and ``standing`` (where an interrupted run stands).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

from rlctl.events import CRASHED, ENDED, RESUME, START
from rlctl.metrics import BadLines, parse_rows, read_rows
from rlctl.numbers import is_number
from rlctl.rundir.directory import last_step, read_config_data
from rlctl.rundir.history import ever_committed
from rlctl.rundir.layout import ABANDONED, CONFIG, EVENTS, METRICS, not_a_run
from rlctl.rundir.lease import lease_state, read_lease
from rlctl.rundir.snapshots import snapshot_catalog
from rlctl.storage import Storage

if TYPE_CHECKING:
    from rlctl.checkpoint.catalog import SnapshotInfo
    from rlctl.config import RunConfig

DEFAULT_LEASE_TIMEOUT = 120.0  # seconds: trainer.lease_timeout's default, for a config that lacks it


@dataclass(frozen=True)
class HistoryRow:
    """One metric row as the live run wrote it; ``turned``: the tag of the rollback or resume that
    turned the run away from it (None for a row of metrics.jsonl)."""

    row: dict[str, Any]
    turned: dict[str, Any] | None = None

    @property
    def step(self) -> int:
        return self.row["step"]


class RunRecord:
    """The run directory at ``run``, read lazily (each file once) and never written."""

    def __init__(self, run: Storage):
        self.run = run
        self.url = run.url
        self._bad = {name: BadLines(run.url_of(name)) for name in (METRICS, ABANDONED, EVENTS)}
        self._read: list[str] = []

    def _rows(self, name: str, require_step: bool = False) -> list[dict[str, Any]]:
        self._read.append(name)
        return read_rows(self.run, name, self._bad[name], require_step=require_step)

    @cached_property
    def config(self) -> dict[str, Any]:
        """The parsed config.yaml as written (not validated); a ConfigError naming the file."""
        return read_config_data(self.run)

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl: the history the run kept, one row per step."""
        return self._rows(METRICS, require_step=True)

    @cached_property
    def abandoned(self) -> list[dict[str, Any]]:
        """The rows of metrics.abandoned.jsonl, each with its ``abandoned`` tag."""
        return self._rows(ABANDONED, require_step=True)

    @cached_property
    def history(self) -> list[HistoryRow]:
        """Every metric row, kept and abandoned, in the order they were written (``order_history``)."""
        return order_history(self.rows, self.abandoned)

    @cached_property
    def events(self) -> list[dict[str, Any]]:
        return self._rows(EVENTS)

    @cached_property
    def lease(self) -> dict[str, Any] | None:
        return read_lease(self.run)

    def warnings(self) -> list[str]:
        """One warning per file read so far with lines that could not be read, in the order read."""
        return [w for name in dict.fromkeys(self._read) if (w := self._bad[name].warning()) is not None]

    @property
    def bad_lines(self) -> list[int]:
        """The line numbers of metrics.jsonl that could not be read."""
        return self._bad[METRICS].lines

    def setting(self, section: str, key: str) -> Any:
        """``config[section][key]`` as the file has it (None where the file lacks it or is odd)."""
        part = self.config.get(section)
        return part.get(key) if isinstance(part, dict) else None

    @property
    def rollout(self) -> tuple[str, str, float | None]:
        """(rollout.mode, rollout.backend, the staleness of the last step's batch: None in sync or before a
        step), as the files have them."""
        mode, backend = self.setting("rollout", "mode"), self.setting("rollout", "backend")
        mode = mode if isinstance(mode, str) else "sync"
        stale = self.rows[-1].get("rollout/staleness/max") if self.rows and mode != "sync" else None
        return mode, backend if isinstance(backend, str) else "hf", stale if isinstance(stale, (int, float)) else None

    @property
    def total_steps(self) -> int:
        value = self.setting("trainer", "total_steps")
        return value if isinstance(value, int) else 0

    @property
    def step(self) -> int:
        """The last step the run kept (0: it never trained one)."""
        return self.rows[-1]["step"] if self.rows else 0

    def events_of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in kinds]

    def last_outcome(self) -> dict[str, Any] | None:
        """The last start, resume or end (``rlctl.events.ENDED``) of events.jsonl: how the run ended
        when it is an end, else a run that is going on or died without saying."""
        return next((e for e in reversed(self.events) if e.get("event") in ENDED | {START, RESUME}), None)

    def status(self, lease_timeout: float | None = None) -> str:
        """running (a live lease), completed, halted (by a policy), preempted (stopped by a signal:
        resume it), interrupted (Ctrl-C: resume it), node_lost (a Ray node that held ranks was lost:
        resume it elsewhere), or crashed (no live lease and none of the above: killed, or an error)."""
        configured = self.setting("trainer", "lease_timeout")
        timeout = lease_timeout or (float(configured) if is_number(configured) else DEFAULT_LEASE_TIMEOUT)
        if lease_state(self.lease, timeout) == "live":
            return "running"
        last = (self.last_outcome() or {}).get("event")
        return last if last in ENDED - {CRASHED} else "crashed"


def read_run(url: str, timeout: float | None = None) -> RunRecord:
    """The run at ``url``; a ConfigError where the directory holds neither config.yaml nor metrics.jsonl.
    ``timeout``: a read-only command's bound on storage that does not answer (``Storage.for_reading``)."""
    run = Storage(url) if timeout is None else Storage.for_reading(url, timeout)
    if not run.exists(CONFIG) and not run.exists(METRICS):
        raise not_a_run(run.url)
    return RunRecord(run)


def order_history(kept: Sequence[dict[str, Any]], abandoned: Sequence[dict[str, Any]]) -> list[HistoryRow]:
    """Rows of metrics.jsonl and of metrics.abandoned.jsonl merged in the order they were written: by
    ``timestamp`` (a row without a finite number there takes its file predecessor's; the first rows of a
    file without one come first), then step; on a tie of both, an abandoned row before a kept one (a
    kept row of a step was written after every abandoned row of that step: after the turn that
    abandoned them), then file order."""
    history = [HistoryRow(r) for r in kept]
    history += [HistoryRow({k: v for k, v in r.items() if k != "abandoned"}, _tag(r)) for r in abandoned]
    stamps = _stamps(kept) + _stamps(abandoned)
    order = sorted(range(len(history)), key=lambda i: (stamps[i], history[i].step, history[i].turned is None, i))
    return [history[i] for i in order]


def _tag(row: dict[str, Any]) -> dict[str, Any]:
    tag = row.get("abandoned")
    return tag if isinstance(tag, dict) else {"event": "unknown"}


def _stamps(rows: Sequence[dict[str, Any]]) -> list[float]:
    out, last = [], float("-inf")
    for r in rows:
        stamp = r.get("timestamp")
        if is_number(stamp, finite=True):
            last = float(stamp)
        out.append(last)
    return out


def ended_since(run: Storage, offset: int) -> bool:
    """Whether an outcome (``rlctl.events.ENDED``) was recorded in events.jsonl after byte ``offset`` (by
    this process or rank 0); True when the log cannot be read now (then nothing more is written to it)."""
    try:
        since = run.read_bytes(EVENTS)[offset:] if run.exists(EVENTS) else b""
    except Exception:  # unreadable now: do not write either
        return True
    return any(e.get("event") in ENDED for e in parse_rows(since))


class Standing(NamedTuple):
    """Where an interrupted run stands: the last step it trained, its last usable snapshot (None: none),
    and whether it ever committed one."""

    trained: int
    last: SnapshotInfo | None
    committed: bool


def standing(run: Storage, cfg: RunConfig) -> Standing:
    """Where the run at ``run`` stands now; when the storage is failing too, what is known (no step, no
    snapshot, and committed: nothing is said to be lost by starting over)."""
    try:
        catalog = snapshot_catalog(run, cfg)
        usable = [i for i in catalog.scan() if i.usable]
        return Standing(
            last_step(run), usable[-1] if usable else None, bool(usable) or ever_committed(run, catalog.storage)
        )
    except Exception:  # the storage is failing too: say what is known
        return Standing(0, None, True)
