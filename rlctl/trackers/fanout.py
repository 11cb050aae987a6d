"""``Trackers``: rank 0's one object that feeds every configured tracker a run's metric rows and events.

It opens the trackers at the first row or event with a step (importing their libraries then), gives an
event without a step the last step seen (held back until one is known), turns the trackers on a
rollback or resume, keeps their libraries off the trainer's RNG and signal handling (``guard``), and
drops a tracker that fails with one warning on stderr: training goes on, metrics.jsonl stays the truth.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from rlctl import events
from rlctl.errors import ConfigError
from rlctl.numbers import is_step
from rlctl.trackers.base import History, Tracker, event_text, metric_values, walltime
from rlctl.trackers.install import PIP, REQUIRES
from rlctl.trackers.isolation import fence_random, untouched
from rlctl.trackers.run_ids import TrackerIds

# events after which the run did not end well (a tracker run is closed as failed or killed)
NOT_OK = frozenset({"halted", "crashed", "failed", "interrupted", "preempted"})
# a tracker's name in trainer.loggers -> its name as people know it, and back
NAMES = {"tensorboard": "TensorBoard", "wandb": "W&B", "mlflow": "MLflow"}
KEYS = {shown: key for key, shown in NAMES.items()}


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    cause = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return cause if len(cause) <= 300 else cause[:297] + "..."


class Trackers:
    """The configured trackers of one run, fed on rank 0 (see the module docstring).

    Its calls belong to the thread that made it (the training loop): a row or event passed from another
    thread (an event of a snapshot committed in the background) is queued and delivered at that
    thread's next call, so tracker libraries run on one thread and the RNG guard never races the loop."""

    def __init__(
        self,
        names: list[str],
        run_dir: str,
        *,
        run_name: str,
        config: dict[str, Any],
        history: Callable[[], list[dict[str, Any]]],
    ):
        """run_dir: the run directory, a LOCAL path. config: the run config as a plain dict (logged as
        hyperparameters). history(): the run's metric rows as they stand now (metrics.jsonl, after any
        turn), for replaying into a new tracker run. Nothing heavy happens until the first row or event."""
        unknown = [n for n in names if n not in REQUIRES]
        if unknown:
            raise ConfigError(f"trainer.loggers: unknown tracker {unknown[0]!r} (known: {', '.join(REQUIRES)})")
        if "://" in str(run_dir) and not str(run_dir).startswith("file://"):
            raise ConfigError(f"trackers write into a local run directory, and {run_dir} is not one")
        self.names = list(dict.fromkeys(names))
        self.run_dir = str(run_dir).removeprefix("file://")
        self.run_name, self.config = run_name, config
        self.history = History(history)
        self._live: list[Tracker] | None = None  # opened at the first row or stepped event
        self._last_step: int | None = None
        self._pending: list[dict[str, Any]] = []  # events without a step, before any step was known
        self._ok = True
        self._closed = False
        self._owner = threading.get_ident()
        self._inbox: deque[tuple[str, dict[str, Any]]] = deque()  # from other threads

    def _queued(self, kind: str, payload: dict[str, Any]) -> bool:
        """On another thread: queue the call (True). On the owner's: deliver what others queued first."""
        if threading.get_ident() != self._owner:
            self._inbox.append((kind, payload))
            return True
        while self._inbox:
            queued_kind, queued = self._inbox.popleft()
            (self._row if queued_kind == "row" else self._event)(queued)
        return False

    def _open(self) -> list[Tracker]:
        if self._live is None:
            self._live = []
            ids = TrackerIds(self.run_dir)
            for name in self.names:
                with untouched():
                    try:
                        self._live.append(self._make(name, ids))
                    except Exception as exc:
                        self._warn(NAMES[name], exc)
        return self._live

    def _make(self, name: str, ids: TrackerIds) -> Tracker:
        os.makedirs(self.run_dir, exist_ok=True)
        if name == "tensorboard":
            from rlctl.trackers.tensorboard_tracker import TensorBoardTracker

            return TensorBoardTracker(self.run_dir, self.history)
        if name == "wandb":
            from rlctl.trackers.wandb_tracker import WandbTracker

            return WandbTracker(self.run_dir, self.run_name, self.config, ids, self.history)
        from rlctl.trackers.mlflow_tracker import MlflowTracker

        return MlflowTracker(self.run_dir, self.run_name, self.config, ids, self.history)

    def _each(self, call: Callable[[Tracker], None]) -> None:
        """``call`` on every live tracker; one that raises is warned about once and dropped."""
        live = self._open()
        for tracker in list(live):
            with untouched():
                try:
                    call(tracker)
                except Exception as exc:
                    live.remove(tracker)
                    self._warn(tracker.name, exc)
                finally:
                    fence_random()

    def _warn(self, name: str, exc: BaseException) -> None:
        key = KEYS.get(name, name)
        hint = f"; to install it: {PIP[key]}" if isinstance(exc, ImportError) and key in PIP else ""
        print(
            f"warning: {name} stops receiving metrics after an error ({_describe(exc)}){hint}; "
            "training goes on and metrics.jsonl keeps every row",
            file=sys.stderr,
        )

    def log_row(self, row: dict[str, Any]) -> None:
        """A step's metrics row ({"step": int, "timestamp": float, "actor/pg_loss": 0.1, ...}): numbers
        (and "NaN", "Infinity", "-Infinity") are logged at ``step``; anything else is skipped."""
        if not self._closed and not self._queued("row", row):
            self._row(row)

    def _row(self, row: dict[str, Any]) -> None:
        step = row.get("step")
        if not is_step(step):
            return
        self.history.reached(step - 1)
        self._flush_pending(step)
        values, wall = metric_values(row), walltime(row)
        self._each(lambda t: t.log(step, values, wall))
        self._last_step = step

    def log_event(self, event: dict[str, Any]) -> None:
        """A run event ({"event": kind, "step": N, ...}): the scalar ``events/<kind>`` = 1 and its text
        at its step (a rollback's at ``to_step``; one without a step at the last step seen). A rollback,
        and a resume, turn the trackers away from the steps after their step first."""
        if not self._closed and not self._queued("event", event):
            self._event(event)

    def _event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if not isinstance(kind, str) or not kind:
            return
        turn = self._turn_of(event)
        if turn is not None:
            to_step, branch = turn
            self.history.turned(to_step)
            self._each(lambda t: t.turn(to_step, branch=branch, why=event_text(event, to_step)))
            self._last_step = to_step
        if kind in NOT_OK:
            self._ok = False
        step = turn[0] if turn is not None else event.get("step")
        if not is_step(step):
            step = self._last_step
        if step is None:
            self._pending.append(event)
            return
        self._flush_pending(step)
        self._mark(event, step)

    def _turn_of(self, event: dict[str, Any]) -> tuple[int, bool] | None:
        """(the step the run turned to, whether the later steps get other values) of a rollback or a
        resume (other values: it changed knobs, or a policy acted after its step, so the steps re-done
        take another path: ``replays_exactly`` false); None for any other event."""
        if event["event"] == events.ROLLBACK and is_step(event.get("to_step")):
            return event["to_step"], True
        if event["event"] == events.RESUME and is_step(event.get("step")):
            return event["step"], bool(event.get("changes")) or event.get("replays_exactly") is False
        return None

    def _mark(self, event: dict[str, Any], step: int) -> None:
        if is_step(event.get("step")) and event["event"] not in (events.ROLLBACK, events.RESUME):
            self.history.reached(event["step"] - 1)
            self._last_step = max(self._last_step or 0, event["step"])
        kind, text = event["event"], event_text(event, step)
        self._each(lambda t: t.event(step, kind, text))

    def _flush_pending(self, step: int) -> None:
        pending, self._pending = self._pending, []
        for event in pending:
            self._mark(event, step)

    def close(self) -> None:
        """Flush and end every tracker run (as completed unless the run halted, crashed, was stopped)."""
        if self._closed:
            return
        self._owner = threading.get_ident()  # whoever closes delivers what is queued
        self._queued("close", {})
        if self._pending:
            self._flush_pending(self._last_step or 0)
        if self._live is not None:
            self._each(lambda t: t.close(self._ok))
        self._closed = True
