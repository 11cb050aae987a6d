"""An object-store request still waiting when its store's outage has lasted the retry budget is cut
short there, not a read timeout (60 s) later.

The retry loop (``rlctl.storage.failures.guarded``) runs each attempt on a remote store ``watched``: every
request fsspec starts for it on its event loop is checked on that loop, with no thread of ours, and
cancelled once the store's open outage (``rlctl.storage.outages``) has lasted the budget. Cancelling,
not abandoning: whatever the request had not sent is never sent, and its connection is closed, so an
upload given up on cannot land once the store is back (a thread left waiting on it did, over what the
process wrote since). An attempt that meets no outage is never cut: a slow upload that the store
answers may take as long as it takes, each read bounded by the client's read timeout. Nor is one begun
after its store's outage was already overdue: a first try after a long silence is tried in full.

The request is found through the context it was started in: fsspec's ``sync`` submits it from the
calling thread, so the task the loop makes for it carries that thread's context variables."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from rlctl.errors import RlctlError
from rlctl.storage.outages import OUTAGES, store_of

T = TypeVar("T")

RECHECK = 1.0  # seconds between looks at a request's store while it meets no overdue outage


class AttemptCut(TimeoutError):
    """An attempt whose request was cut short at the deadline; ``cause``: the store's failure that
    opened the outage it met."""

    def __init__(self, cause: str):
        super().__init__(f"{cause}, and the attempt under way had no answer by the deadline" if cause else "")
        self.cause = cause


@dataclass
class Watch:
    """One attempt on ``store`` with ``budget`` seconds of outage; ``cut``: whether it was cut short."""

    store: str
    budget: float
    began: float
    cut: bool = False

    def error(self) -> AttemptCut:
        return AttemptCut(_cause(self.store))


_INSTALLING = threading.Lock()
_WATCH: contextvars.ContextVar[Watch | None] = contextvars.ContextVar("rlctl_storage_watch", default=None)


def attempt(url: str, fn: Callable[[], T], budget: float) -> T:
    """``fn()``, its requests on the store of ``url`` cut at the outage deadline: AttemptCut then, whatever
    the client made of the cut (a value, another error)."""
    with watched(url, budget) as watch:
        try:
            result = fn()
        except BaseException as exc:
            if watch is not None and watch.cut and not isinstance(exc, AttemptCut | RlctlError):
                raise watch.error() from exc
            raise
        if watch is not None and watch.cut:
            raise watch.error()
        return result


@contextlib.contextmanager
def watched(url: str, budget: float) -> Iterator[Watch | None]:
    """Run an attempt on ``url`` with its requests cut at its store's outage deadline (nothing to cut on
    a local path or in memory: None)."""
    store = store_of(url)
    runner = _fsspec_runner()
    if store is None or runner is None:
        yield None
        return
    _install(runner)
    watch = Watch(store, budget, time.monotonic())
    token = _WATCH.set(watch)
    try:
        yield watch
    finally:
        _WATCH.reset(token)


@functools.cache
def _fsspec_runner() -> Any:
    """fsspec's coroutine that runs each request of its ``sync`` (whose ``result`` list the cut fills)."""
    try:
        from fsspec import asyn
    except ImportError:  # pragma: no cover - fsspec is a dependency
        return None
    runner = getattr(asyn, "_runner", None)
    code = getattr(runner, "__code__", None)
    return runner if code is not None and "result" in code.co_varnames else None


def _install(runner: Any) -> None:
    """Watch the tasks of fsspec's loop (once per loop: a forked child gets a fresh one)."""
    from fsspec.asyn import get_loop

    loop = get_loop()
    if getattr(loop.get_task_factory(), "rlctl_watching", False):
        return
    with _INSTALLING:
        factory = loop.get_task_factory()
        if not getattr(factory, "rlctl_watching", False):
            loop.set_task_factory(_factory(factory, runner.__code__))


def _factory(previous: Any, runner_code: Any) -> Any:
    def make(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future:
        if previous is not None:
            task = previous(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        context = kwargs.get("context")
        watch = context.get(_WATCH) if context is not None else _WATCH.get()
        if watch is not None and getattr(coro, "cr_code", None) is runner_code:
            _look(loop, task, watch)
        return task

    make.rlctl_watching = True
    return make


def _look(loop: asyncio.AbstractEventLoop, task: asyncio.Future, watch: Watch) -> None:
    """Cut ``task`` once its store's outage is overdue (or its attempt was cut): looked at as it starts,
    then at the outage's deadline, or every ``RECHECK`` seconds while none is open."""
    pending: list[asyncio.TimerHandle] = []

    def look() -> None:
        if task.done():
            return
        due = OUTAGES.deadline(watch.store, watch.budget)
        if due is not None and due <= watch.began:
            due = None  # begun after the deadline (a first try after an overdue outage): tried in full
        now = time.monotonic()
        if watch.cut or (due is not None and now >= due):
            _cut(task, watch)
            return
        pending[:] = [loop.call_later((due - now) if due is not None else RECHECK, look)]

    # first looked at once the task has taken its first step, inside fsspec's try: a task cancelled before
    # it starts never runs the finally that wakes the waiting thread (which would wait forever)
    pending.append(loop.call_soon(look))
    task.add_done_callback(lambda _task: [handle.cancel() for handle in pending])


def _cut(task: asyncio.Future, watch: Watch) -> None:
    watch.cut = True
    frame = getattr(task.get_coro(), "cr_frame", None)
    result = frame.f_locals.get("result") if frame is not None else None
    if isinstance(result, list) and len(result) == 1:
        result[0] = watch.error()  # what fsspec's sync raises in the waiting thread
    task.cancel()


def _cause(store: str) -> str:
    outage = OUTAGES.current(store)
    return outage.cause if outage is not None else ""
