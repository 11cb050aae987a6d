"""One supervisor for the ranks of a run, whatever runs them (local processes, Ray actors), through a
small handle protocol: it polls every rank, gives the others a grace period when one fails and then
kills them, ends them all at once when the run's lease is lost, and decides the run's outcome from the
ranks' results. Meanwhile it shows rank 0's metric rows and snapshot failures as they land (the
driver's progress). ``StopForwarder`` passes SIGTERM/SIGUSR1 on to every rank from the moment the
first one starts."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from rlctl.errors import ExitCode, NodeLost, RankFailed
from rlctl.metrics import parse_rows
from rlctl.ranks.report import Reporter, report_event
from rlctl.ranks.stops import STOPS, on_stop_signals
from rlctl.rundir.layout import EVENTS, METRICS
from rlctl.rundir.selection import ResumePlan
from rlctl.storage import Storage

GRACE_S = 10.0  # how long the other ranks get to notice a failed rank before they are stopped
POLL_S = 0.1
# exits every rank takes together after the same step (rank 0 may still be committing a snapshot):
# they never start the grace clock
COORDINATED = {ExitCode.OK, ExitCode.HALTED, ExitCode.PREEMPTED}


class RankHandle(Protocol):
    """One running rank, as the supervisor sees it."""

    def poll(self) -> int | None:
        """The rank's exit code once it has ended, else None."""

    def stop(self, signal_name: str) -> None:
        """Pass a stop signal ("SIGTERM", "SIGUSR1") on to the rank, if it still runs."""

    def kill(self) -> None:
        """End the rank now, if it still runs."""

    def result(self) -> dict[str, Any] | None:
        """Once ended: {"code", "message", "summary"}, or None when the rank left no result."""


class StopForwarder:
    """Stop signals to the driver, passed on to every rank: also to a rank added after the signal came
    (a local rank holds it until it can take it; a Ray actor keeps it for its trainer)."""

    def __init__(self) -> None:
        self.ranks: list[Any] = []
        self.reason: str | None = None

    def add(self, rank: Any) -> None:
        """Follow ``rank`` (anything with ``stop(signal_name)``)."""
        self.ranks.append(rank)
        if self.reason is not None:
            rank.stop(self.reason)

    def __call__(self, signal_name: str) -> None:
        self.reason = signal_name
        for rank in self.ranks:
            rank.stop(signal_name)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopForwarder]:
        """Within the block, SIGTERM/SIGUSR1 go to the ranks (and never raise here again: ranks were
        started whose snapshot a stop must not cut short)."""
        STOPS.keep()
        with on_stop_signals(self):
            yield self


def supervise(
    ranks: Sequence[RankHandle],
    run: Storage,
    plan: ResumePlan | None,
    total: int,
    reporter: Reporter,
    fence: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Follow ``ranks`` to their end; the run's summary, or RankFailed with the rank that failed.
    ``fence`` (the lease's check) is called at every poll: when it raises, every rank is killed at once
    (none may commit after the lease is lost) and its error is raised."""
    follower = Follower(run, reporter)
    follower.poll(force=True)
    reporter.ready(plan.from_step if plan is not None else 0, total)
    try:
        failed_first = _wait(ranks, follower, fence or (lambda: None))
    except BaseException:
        for r in ranks:
            r.kill()
        raise
    follower.poll(force=True)
    return outcome([r.result() for r in ranks], failed_first, run.url)


def _wait(ranks: Sequence[RankHandle], follower: Follower, fence: Callable[[], None]) -> int | None:
    """Poll every rank until all have ended; the first rank whose end started the grace clock."""
    failed_first, failed_at = None, None
    while True:
        fence()
        codes = [r.poll() for r in ranks]  # every rank, every time
        for rank, code in enumerate(codes):
            if failed_first is None and starts_grace(code):
                failed_first, failed_at = rank, time.monotonic()
        if all(c is not None for c in codes):
            return failed_first
        follower.poll()
        if ExitCode.NODE_LOST in codes:  # the ranks left cannot finish a step without those of a lost
            for r in ranks:  # node: each says whether it was on a lost node too, then it is ended now
                r.poll()
                r.kill()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for r in ranks:  # a rank left the group: the others would wait in a collective forever
                r.kill()
        time.sleep(POLL_S)


def starts_grace(code: int | None) -> bool:
    """Whether a rank ending with ``code`` has left the others stuck (a crash, or an error on that rank
    alone), rather than taking a coordinated exit every rank takes after the same step."""
    return code is not None and code not in COORDINATED


def outcome(results: list[dict | None], failed_first: int | None, url: str = "RUN") -> dict[str, Any]:
    """The run's result from the ranks' results: rank 0's, unless another rank failed first, or a node
    was lost (NodeLost: whatever the other ranks said, they failed for want of its ranks)."""
    lost = [res for res in results if res and res["code"] == ExitCode.NODE_LOST]
    if lost:
        raise node_lost(lost, url)
    first = results[0]
    # a rank that ended with its own error (not a crash) says why the others went down
    own = [r for r, res in enumerate(results) if res and starts_grace(res["code"]) and res["code"] != 1]
    if own and (first is None or first["code"] in (0, 1)):
        failed_first = own[0]
    if failed_first is not None and failed_first != 0:
        r = results[failed_first] or {"code": 1, "message": None}
        if first is None or first["code"] in (0, 1):
            raise RankFailed(
                r["message"]
                or f"rank {failed_first} failed (exit code {r['code']}); its "
                "error is above. The other ranks were stopped",
                r["code"] or 1,
            )
    if first is None:
        raise RankFailed("rank 0 died without a result; see its error above", 1)
    if first["code"]:
        raise RankFailed(first["message"] or f"rank 0 failed (exit code {first['code']})", first["code"])
    return first["summary"]


def node_lost(results: list[dict[str, Any]], url: str) -> NodeLost:
    """The error of a run whose ranks in ``results`` (each with its "rank" and "node") were on lost
    nodes: each node once, with its ranks."""
    nodes: dict[str, dict[str, Any]] = {}
    for res in results:
        node = nodes.setdefault(res["node"]["id"], {**res["node"], "ranks": []})
        node["ranks"].append(res["rank"])
    said = "; ".join(
        f"{n['cause']}, with rank{'s' if len(n['ranks']) > 1 else ''} {', '.join(map(str, n['ranks']))} on it"
        for n in nodes.values()
    )
    return NodeLost(
        f"{said}. The other ranks were stopped; what was committed is kept: resume on healthy nodes "
        f"(rlctl resume {url} --from latest)",
        list(nodes.values()),
    )


class Follower:
    """Shows rank 0's metric rows (the driver's progress bar) and snapshot failures as they land."""

    def __init__(self, run: Storage, reporter: Reporter):
        self.reporter = reporter
        self.tails = [
            Tail(run, METRICS, reporter.step, require_step=True),
            Tail(run, EVENTS, lambda event: report_event(reporter, event)),
        ]
        self._last = 0.0

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.5:
            return
        self._last = now
        for tail in self.tails:
            tail.poll()


class Tail:
    """The rows appended to a JSONL file of the run since the first poll, each passed to ``show``."""

    def __init__(self, run: Storage, rel: str, show: Callable[[dict[str, Any]], None], require_step: bool = False):
        self.run, self.rel, self.show, self.require_step = run, rel, show, require_step
        self.offset: int | None = None

    def poll(self) -> None:
        try:
            size, tail = self._read_from(self.offset or 0)
        except FileNotFoundError:
            size, tail = 0, b""
        except Exception:  # a flaky read of remote storage: progress waits for the next poll
            return
        if self.offset is None or size < self.offset:  # rows from before this launch are history;
            self.offset = size  # a rollback moved rows away
            return
        end = tail.rfind(b"\n") + 1  # whole lines only
        if end:
            self.offset += end
            for row in parse_rows(tail[:end], require_step=self.require_step):
                self.show(row)

    def _read_from(self, offset: int) -> tuple[int, bytes]:
        """The file's size and its bytes from ``offset``: a local file is read from there only, an
        object (no ranged append semantics to rely on) whole."""
        if self.run.is_local:
            with open(self.run.path(self.rel), "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(min(offset, size))
                return size, fh.read()
        data = self.run.read_bytes(self.rel)
        return len(data), data[offset:]
