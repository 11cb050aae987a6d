"""The body of a tool worker process: import tool functions on first use and run the calls the pool
sends, one at a time, answering each with its outcome. Light on purpose (no torch, no rlctl engine): a
worker killed on a timeout is replaced in a fraction of a second."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

OK, ERROR, UNAVAILABLE, TIMEOUT = "ok", "error", "unavailable", "timeout"


def resolve(spec: str) -> Any:
    """The function ``module:function`` names (the working directory importable, as for rewards)."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def run_call(functions: dict[str, Any], spec: str, arguments: dict[str, Any]) -> tuple[str, str]:
    """(outcome, text) of one call: (ok, str(result)); (error, "TypeName: message") when the tool raised;
    (unavailable, message) when it raised ``ToolUnavailable`` (its infrastructure failed)."""
    from rlctl.tools import ToolUnavailable

    try:
        if spec not in functions:
            functions[spec] = resolve(spec)
        result = functions[spec](**arguments)
    except ToolUnavailable as exc:
        return UNAVAILABLE, str(exc) or "the tool is unavailable"
    except Exception as exc:  # the tool's own mistake (or the model's arguments): told to the model
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        where = f" (at {os.path.basename(last[0].filename)} line {last[0].lineno})" if last else ""
        return ERROR, f"{type(exc).__name__}: {exc}{where}"
    return OK, result if isinstance(result, str) else repr(result) if not isinstance(result, (dict, list)) else _json(
        result
    )


def _json(value: Any) -> str:
    import json

    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def main(conn) -> None:
    """Answer calls ``(spec, arguments)`` until the pipe closes or None arrives. The worker dies with its
    rank (PR_SET_PDEATHSIG): a call still running when the rank is killed stops there."""
    _die_with_parent()
    functions: dict[str, Any] = {}
    conn.send(("ready", ""))  # started: the pool's clock for the first call starts now
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(run_call(functions, *job))
