"""The stop signals (SIGTERM: a preemption, SIGUSR1: a stop on request), installed for a block and
restored after it. Python delivers signals to the main thread only: elsewhere (a rank inside a
threaded Ray actor) nothing is installed, and the driver forwards stops instead."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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
