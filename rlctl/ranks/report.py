"""How a run shows its progress: the Reporter protocol (``rlctl.commands.progress`` draws one on
stderr), a reporter that shows nothing (library calls, ranks other than the driver), and the events a
person must hear about at once (a failed snapshot), said through a reporter."""

from __future__ import annotations

from typing import Any, Protocol

from rlctl import events


class Reporter(Protocol):
    def ready(self, step: int, total: int) -> None: ...

    def step(self, row: dict[str, Any]) -> None: ...

    def note(self, text: str) -> None: ...


class SilentReporter:
    """A Reporter that shows nothing."""

    def ready(self, step: int, total: int) -> None: ...

    def step(self, row: dict[str, Any]) -> None: ...

    def note(self, text: str) -> None: ...


def report_event(reporter: Reporter, event: dict[str, Any]) -> None:
    """Say what an event means for the run when a person must hear it now: a failed snapshot,
    snapshots written in the training process for want of shared memory, or tools down past their
    retry budget."""
    if event.get("event") == events.SNAPSHOT_FAILED:
        reporter.note(snapshot_failed_note(event))
    elif event.get("event") == events.SNAPSHOT_WRITER_FALLBACK:
        reporter.note(f"warning: snapshots are written in the training process: {event.get('reason')}")
    elif event.get("event") == events.TOOLS_UNAVAILABLE:
        reporter.note(
            f"warning: every tool call failed (timed out or unavailable) in {event.get('steps')} steps in a row, "
            f"more than rollout.multi_turn.tool_retry_budget ({event.get('budget')}): the run stops after step "
            f"{event.get('step')}; resume it once the tools answer"
        )


def snapshot_failed_note(event: dict[str, Any]) -> str:
    """'warning: snapshot of step N failed: CAUSE (k of max_failures)'."""
    count = ""
    if event.get("consecutive") is not None and event.get("max_failures") is not None:
        count = f" ({event['consecutive']} of {event['max_failures']})"
    return f"warning: snapshot of step {event.get('step')} failed: {event.get('error')}{count}"


class ReportedEvents:
    """An event log whose events also pass ``report_event`` (rank 0 of a run shown in this process)."""

    def __init__(self, events, reporter: Reporter):
        self.events, self.reporter = events, reporter

    def emit(self, event: dict[str, Any]) -> None:
        self.events.emit(event)
        report_event(self.reporter, event)
