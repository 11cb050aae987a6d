"""Keeping tracker libraries off the trainer's process state.

A run's saved RNG state must not depend on whether a tracker was on: every tracker call runs inside
``untouched()``, which puts Python's, NumPy's and torch's global RNG state back if the call moved it,
and ``fence_random`` points the module-level ``random`` of tracker packages (retry jitter, telemetry
sampling, which may run on their own threads) at a private generator. ``untouched()`` also puts back
the SIGINT/SIGTERM/SIGUSR1 handlers, ``sys.excepthook`` and ``sys.exit`` (wandb replaces the last two
when it starts its service), so the trainer's stop and exit handling stays its own.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rlctl.storage.clients import private_random_module

_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, n))


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np, "random"):
        states["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_rng_state"):
        states["torch"] = torch.get_rng_state()
    return states


def _restore_rng(before: dict[str, Any]) -> None:
    if random.getstate() != before["random"]:
        random.setstate(before["random"])
    if "numpy" in before:
        np = sys.modules["numpy"]
        now = np.random.get_state()
        if (
            now[0] != before["numpy"][0]
            or not np.array_equal(now[1], before["numpy"][1])
            or now[2:] != before["numpy"][2:]
        ):
            np.random.set_state(before["numpy"])
    if "torch" in before:
        torch = sys.modules["torch"]
        if not torch.equal(torch.get_rng_state(), before["torch"]):
            torch.set_rng_state(before["torch"])


def _restore_hooks(handlers: dict[int, Any], excepthook: Any, exit_fn: Any) -> None:
    sys.excepthook, sys.exit = excepthook, exit_fn
    if threading.current_thread() is not threading.main_thread():
        return  # handlers can be set from the main thread only (and only there can a library set one)
    for sig, handler in handlers.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@contextmanager
def untouched() -> Iterator[None]:
    """Run a tracker call; afterwards the global RNG states, the stop signals' handlers,
    ``sys.excepthook`` and ``sys.exit`` are what they were before it."""
    rng = _rng_states()
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    excepthook, exit_fn = sys.excepthook, sys.exit
    try:
        yield
    finally:
        _restore_rng(rng)
        _restore_hooks(handlers, excepthook, exit_fn)


_PRIVATE = private_random_module("rlctl.trackers")
_fenced_at = 0


def fence_random(packages: tuple[str, ...] = ("wandb", "mlflow", "tensorboard", "opentelemetry")) -> None:
    """Point the module-level ``random`` of the tracker packages imported so far at a private generator
    (cheap when nothing was imported since the last call)."""
    global _fenced_at
    if len(sys.modules) == _fenced_at:
        return
    for name, mod in list(sys.modules.items()):
        if name.partition(".")[0] in packages and getattr(mod, "__dict__", {}).get("random") is random:
            mod.random = _PRIVATE
    _fenced_at = len(sys.modules)
