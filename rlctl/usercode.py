"""Calling user code: a reward function, a tool, their modules' imports. Whatever the code raises or
exits with (an exception, ``SystemExit`` even with code 0, a ``KeyboardInterrupt`` it raises itself,
``GeneratorExit``) is an InputError naming what was called and the cause. A real Ctrl-C during the call
stays a ``KeyboardInterrupt`` (exit 130): while user code runs in the main thread, a SIGINT handler notes
that the signal arrived and then does what the handler before it did. (Where that handler was not set
from Python, a ``KeyboardInterrupt`` is taken as real.)"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from rlctl.errors import InputError, Stopped

T = TypeVar("T")


class _RealInterrupt:
    """Within the block (main thread only), whether a real SIGINT arrived; the handler that was there
    before still runs (``default_int_handler`` raises KeyboardInterrupt, SIG_IGN ignores it, SIG_DFL
    ends the process)."""

    def __enter__(self) -> _RealInterrupt:
        self.arrived = False
        self.previous: Any = None
        self.unknown = False  # a KeyboardInterrupt cannot be told apart: take it as real
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.getsignal(signal.SIGINT)
            if self.previous is None:  # set outside Python: not ours to replace
                self.unknown = True
            else:
                signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.arrived = True
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous == signal.SIG_DFL:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    @property
    def real(self) -> bool:
        return self.arrived or self.unknown


def call_user_code(what: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``; anything it raises or exits with becomes an InputError ``"{what}
    raised {cause}"``, except a KeyboardInterrupt that a real SIGINT caused."""
    with _RealInterrupt() as interrupt:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:  # user code may exit or raise anything
            if isinstance(exc, Stopped) or (isinstance(exc, KeyboardInterrupt) and interrupt.real):
                raise  # a stop or a Ctrl-C that really came while user code ran is not the code's fault
            raise InputError(f"{what} raised {describe_exception(exc)}") from None


def describe_exception(exc: BaseException) -> str:
    """``ValueError: boom (/x/mod.py:5)``, ``SystemExit(0) (...)``, ``SyntaxError: invalid syntax
    (/x/mod.py:3)``: the type, the message on one line and where it was raised."""
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}){_where(exc)}"
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}:{exc.lineno})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}{': ' + text if text else ''}{_where(exc)}"


def _where(exc: BaseException | None) -> str:
    """`` (FILE:LINE)`` of the innermost frame outside Python's import machinery, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")] if exc else []
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def import_or_none(name: str) -> Any:
    """The module, or None when it (or a package above it) does not exist; a module that exists but
    fails to import raises (a missing import inside it included)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            return None
        raise
