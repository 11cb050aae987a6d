"""The body of a tool worker process: import tool functions on first use and run the calls the pool
sends, one at a time, answering each with its outcome. Light on purpose (no torch, no rlctl engine): a
worker killed on a timeout is replaced in a fraction of a second.

A call of a stateful tool or an environment names a ``Session``: the object kept for one conversation.
The worker makes it at its first call (``Class()``, then ``create``/``reset`` with the conversation's
values) and keeps it until the pool sends ``RELEASE`` (``release``/``close`` of every object held). A
worker that does not hold the object (it was replaced after a timeout, or the conversation's earlier
calls were answered from the run's record) makes it and first repeats the conversation's earlier calls
(``history``), their answers discarded, so the call finds the state those calls left.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

OK, ERROR, UNAVAILABLE, TIMEOUT = "ok", "error", "unavailable", "timeout"
RELEASE = "release"  # the pool's message: release every object held (a rollout ended)
# kind -> (its setup, its call, its release): the methods a stateful tool and an environment have
KINDS = {"tool": ("create", "call", "release"), "environment": ("reset", "step", "close")}


@dataclass(frozen=True)
class Session:
    """A call to the object one conversation keeps (a stateful tool or an environment)."""

    kind: str  # tool or environment (``KINDS``)
    spec: str  # module:Class
    instance: str  # the conversation's name for the object, unique within a rank's rollout
    setup: dict[str, Any] = field(default_factory=dict)  # keyword arguments of create / reset
    history: tuple[Any, ...] = ()  # the arguments of the conversation's earlier calls, in order


def resolve(spec: str) -> Any:
    """The function ``module:function`` names (the working directory importable, as for rewards)."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _invoke(fn, arguments: Any) -> Any:
    """A tool's arguments are keywords; an environment's action is positional (a one-item list)."""
    return fn(*arguments) if isinstance(arguments, (list, tuple)) else fn(**arguments)


def _session_call(cache: dict[str, Any], held: dict[str, list], session: Session, arguments: Any) -> Any:
    setup, method, _ = KINDS[session.kind]
    entry = held.get(session.instance)
    if entry is None:
        if session.spec not in cache:
            cache[session.spec] = resolve(session.spec)
        obj = cache[session.spec]()
        if callable(getattr(obj, setup, None)):
            getattr(obj, setup)(**session.setup)
        entry = held[session.instance] = [obj, 0, session.kind]
    obj, applied, _ = entry
    for earlier in session.history[applied:]:  # rebuild the state the earlier calls left
        try:
            _invoke(getattr(obj, method), earlier)
        except Exception:  # answered already (recorded): only its effect on the state counts
            pass
        entry[1] += 1
    entry[1] += 1
    return _invoke(getattr(obj, method), arguments)


def run_call(functions: dict[str, Any], spec: str | Session, arguments: Any, held=None) -> tuple[str, str]:
    """(outcome, text) of one call: (ok, str(result)); (error, "TypeName: message") when the tool raised;
    (unavailable, message) when it raised ``ToolUnavailable`` (its infrastructure failed). An
    environment's step answers its (observation, reward, done) as JSON."""
    from rlctl.tools import ToolError, ToolUnavailable

    try:
        if isinstance(spec, Session):
            result = _session_call(functions, held if held is not None else {}, spec, arguments)
            if spec.kind == "environment":
                return OK, _step_json(result)
        else:
            if spec not in functions:
                functions[spec] = resolve(spec)
            result = functions[spec](**arguments)
    except ToolUnavailable as exc:
        return UNAVAILABLE, str(exc) or "the tool is unavailable"
    except ToolError as exc:  # told in the tool's own words
        return ERROR, str(exc)
    except Exception as exc:  # the tool's own mistake (or the model's arguments): told to the model
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        where = f" (at {os.path.basename(last[0].filename)} line {last[0].lineno})" if last else ""
        return ERROR, f"{type(exc).__name__}: {exc}{where}"
    return OK, result if isinstance(result, str) else repr(result) if not isinstance(result, (dict, list)) else _json(
        result
    )


def _step_json(result: Any) -> str:
    """An environment's step answer as JSON; a TypeError naming the shape expected otherwise."""
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise TypeError(f"step() must return (observation, reward, done), got {result!r}")
    observation, reward, done = result
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"step()'s observation must be a string or None, got {observation!r}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward:
        raise TypeError(f"step()'s reward must be a finite number, got {reward!r}")
    return json.dumps({"observation": observation, "reward": float(reward), "done": bool(done)})


def release(held: dict[str, list]) -> int:
    """``release()`` / ``close()`` every object held (what they raise is ignored); how many there were."""
    for obj, _, kind in held.values():
        try:
            done = getattr(obj, KINDS[kind][2], None)
            if callable(done):
                done()
        except Exception:
            pass
    count = len(held)
    held.clear()
    return count


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def main(conn, sandbox=None) -> None:
    """Answer calls ``(spec or Session, arguments)`` until the pipe closes or None arrives; ``RELEASE``
    releases the objects held. The worker dies with its rank (PR_SET_PDEATHSIG): a call still running when
    the rank is killed stops there. ``sandbox``: the limits the built-in python tool runs code under
    (``rlctl.sandbox.Limits``), the run's ``rollout.multi_turn.sandbox``."""
    _die_with_parent()
    if sandbox is not None:
        from rlctl.sandbox import configure

        configure(sandbox)
    functions: dict[str, Any] = {}
    held: dict[str, list] = {}
    conn.send(("ready", ""))  # started: the pool's clock for the first call starts now
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        if job == RELEASE:
            conn.send(("released", str(release(held))))
            continue
        conn.send(run_call(functions, *job, held=held))
