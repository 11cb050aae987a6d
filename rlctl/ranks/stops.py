"""The stop signals (SIGTERM: a preemption, SIGUSR1: a stop on request), from the first moment of a run.

A stop goes where it can be honoured: to the running trainer (it finishes the step, snapshots it and
stops), kept for the trainer while one is being restored, or, before any trainer exists (imports, the
run directory, the model being built), raised at once in the main thread as ``Stopped``: nothing is
lost then that a snapshot could save. ``STOPS`` is this process's. Python delivers signals to the main
thread only: elsewhere (a rank inside a threaded Ray actor) nothing is installed, and the driver
forwards stops instead.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from rlctl.errors import Stopped

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """The stop requests of this process: passed on to the trainer while it trains, kept until it is
    ready when one comes earlier (it then snapshots where it is and stops), or raised at once as
    ``Stopped`` before any trainer exists (``at_once``)."""

    def __init__(self) -> None:
        self._running = None
        self._pending: str | None = None
        self._at_once = False
        self.early: str | None = None  # a stop that came before any trainer took it

    def request(self, reason: str) -> None:
        if self._running is not None:
            self._running.request_stop(reason)
            return
        self.early = self.early or reason
        self._pending = reason  # also kept: code being imported may swallow the Stopped raised below
        if self._at_once:
            self._at_once = False  # one Stopped: a second signal during the unwinding is kept, not raised
            raise Stopped(reason)

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Within the block, until ``keep()``, a request raises Stopped (call it from the main thread)."""
        self._at_once = True
        try:
            yield
        finally:
            self._at_once = False

    def keep(self) -> None:
        """From now on, requests are kept for the trainer (or passed on to the ranks): a trainer exists,
        or ranks were started, whose snapshot a stop must not cut short."""
        self._at_once = False

    @contextlib.contextmanager
    def running(self, trainer) -> Iterator[None]:
        """Within the block, requests go to ``trainer`` (one kept from before goes at once)."""
        self.keep()
        self._running = trainer
        if self._pending is not None:
            trainer.request_stop(self._pending)
            self._pending = None
        try:
            yield
        finally:
            self._running = None


STOPS = StopRequests()  # this process's


@contextlib.contextmanager
def on_stop_signals(handler: Callable[[str], None]) -> Iterator[None]:
    """Within the block, SIGTERM and SIGUSR1 call ``handler`` with the signal's name ("SIGTERM")."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, _frame) -> None:
        handler(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def stops_from_the_start() -> Iterator[None]:
    """For a whole ``rlctl start`` or ``resume``: a stop signal raises Stopped until a trainer (or the
    ranks) can take it, and is kept for them after."""
    with on_stop_signals(STOPS.request), STOPS.at_once():
        yield


def block_stop_signals() -> None:
    """In a rank's process before exec: hold the stop signals until the rank can take them
    (``unblock_stop_signals``), so that a stop sent while it starts is not its death; leave Ctrl-C to
    the driver, which ends the ranks."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def unblock_stop_signals() -> None:
    """Take the stop signals held since the process started (a pending one is delivered now)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
