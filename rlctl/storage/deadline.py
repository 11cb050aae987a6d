"""An object-store request still waiting when its store's outage has lasted the retry budget is cut
short there, not a read timeout (60 s) later.

The retry loop (``rlctl.storage.failures.guarded``) runs each attempt on a remote store through ``attempt``: every
request fsspec starts for it on its event loop is looked at on that loop, with no thread of ours, and
cancelled once the store's open outage (``rlctl.storage.outages``) has lasted the budget, with the tasks
the request spread its work over (fsspec's batches, Azure's parallel blocks). Cancelling, not
abandoning: whatever the request had not sent is never sent, and its connection is closed, so an upload
given up on cannot land once the store is back (a thread left waiting on it did, over what the process
wrote since). A request that would begin once the deadline has passed is never begun. Bytes already
delivered cannot be called back: a server that was paused acts on them when it resumes.

The retry loop's last try begins at the deadline; it is cut ``LAST_TRY`` seconds later (a store that
refuses at once still says so in the sentence). What is not cut: a call that meets no outage (a slow
upload that the store answers may take as long as it takes, each read bounded by the client's read
timeout), and a call begun when its store's outage was already overdue (a first try after a long
silence is tried in full). An S3 multipart upload cut in its
middle leaves its parts on the store until the bucket's lifecycle rule for incomplete multipart uploads
removes them (s3fs aborts one only on an error, not on a cancellation).

The request is found through the context it was started in: fsspec's ``sync`` submits it from the
calling thread, so the task the loop makes for it carries that thread's context variables."""

from __future__ import annotations

import asyncio
import contextvars
import errno
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlctl.errors import RlctlError
from rlctl.storage.outages import OUTAGES, store_of

T = TypeVar("T")

RECHECK = 1.0  # the longest between two looks at a request while it runs
LAST_TRY = 1.0  # seconds an attempt begun at the deadline (the retry loop's last try) has before its cut
# the clients whose tasks are a request's own work (cancelled with it); others' tasks (aiohttp's host
# resolution, asyncio.to_thread) may be shared with other requests; a session's close is never cut
CLIENTS = ("/fsspec/", "/s3fs/", "/gcsfs/", "/adlfs/", "/azure/storage/")
NEVER_CUT = {"close", "__aexit__"}


class AttemptCut(OSError):
    """An attempt whose request was cut short at the deadline (ETIMEDOUT, so transient; not a
    TimeoutError, which fsspec's ``sync`` would turn into its own); ``cause``: the store's failure that
    opened the outage it met."""

    def __init__(self, cause: str):
        said = f"{cause}, and the attempt under way had no answer by the deadline" if cause else ""
        super().__init__(errno.ETIMEDOUT, said or "no answer by the deadline")
        self.cause = cause


@dataclass
class Watch:
    """One attempt, begun at ``tried``, on ``store`` with ``budget`` seconds of outage, in a call begun at
    ``began``; ``cut``: whether it was cut short; ``tasks``: the tasks its requests started for their work."""

    store: str
    budget: float
    began: float
    tried: float
    cut: bool = False
    tasks: list[asyncio.Future] = field(default_factory=list)

    def error(self) -> AttemptCut:
        outage = OUTAGES.current(self.store)
        return AttemptCut(outage.cause if outage is not None else "")

    def due(self) -> float | None:
        """When its requests are cut (monotonic time): the outage's deadline, or ``LAST_TRY`` seconds
        after the attempt began if later (the retry loop tries once more at the deadline: a store that
        refuses at once says so); never when the outage was already overdue as the call began (None),
        nor while no outage is open (None)."""
        due = OUTAGES.deadline(self.store, self.budget)
        return None if due is None or due <= self.began else max(due, self.tried + LAST_TRY)

    def overdue(self) -> bool:
        due = self.due()
        return self.cut or (due is not None and time.monotonic() >= due)


_WATCH: contextvars.ContextVar[Watch | None] = contextvars.ContextVar("rlctl_storage_watch", default=None)


def attempt(url: str, fn: Callable[[], T], budget: float, times: tuple[float, float]) -> T:
    """``fn()``, an attempt begun at ``times[1]`` of a call begun at ``times[0]``, its requests on the store
    of ``url`` cut at the outage deadline: AttemptCut then, whatever the client made of the cut (a value,
    another error). Nothing to cut on a local path or in memory."""
    store = store_of(url)
    runner = _fsspec_runner()
    if store is None or runner is None:
        return fn()
    _install(runner)
    watch = Watch(store, budget, *times)
    token = _WATCH.set(watch)
    try:
        result = fn()
    except Exception as exc:  # (an interrupt, SystemExit: as they are)
        if watch.cut and not isinstance(exc, AttemptCut | RlctlError):
            raise watch.error() from exc
        raise
    finally:
        _WATCH.reset(token)
        watch.tasks.clear()
    if watch.cut:
        raise watch.error()
    return result


@functools.cache
def _fsspec_runner() -> Any:
    """fsspec's coroutine that runs each request of its ``sync`` (whose ``result`` list the cut fills)."""
    try:
        from fsspec import asyn
    except ImportError:  # pragma: no cover - fsspec is a dependency
        return None
    runner = getattr(asyn, "_runner", None)
    code = getattr(runner, "__code__", None)
    names = set(code.co_varnames) if code is not None else set()
    return runner if {"event", "coro", "result"} <= names else None


def _install(runner: Any) -> None:
    """Watch the tasks of fsspec's loop (once per loop: a forked child gets a fresh one; two threads
    that install at once wrap it twice, which looks twice and cuts once)."""
    from fsspec.asyn import get_loop

    loop = get_loop()
    factory = loop.get_task_factory()
    if not getattr(factory, "rlctl_watching", False):
        loop.set_task_factory(_factory(factory, runner.__code__))


def _factory(previous: Any, runner_code: Any) -> Any:
    def make(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future:
        context = kwargs.get("context")
        watch = context.get(_WATCH) if context is not None else _WATCH.get()
        code = getattr(coro, "cr_code", None)
        if watch is not None and code is runner_code and watch.overdue():
            coro, code = _refused(coro, watch), None  # (never begun: nothing of it is sent)
        task = previous(loop, coro, **kwargs) if previous is not None else asyncio.Task(coro, loop=loop, **kwargs)
        if watch is not None and code is runner_code:
            _look(loop, task, watch)
        elif watch is not None and code is not None and _own_work(code):
            watch.tasks.append(task)
        return task

    make.rlctl_watching = True
    return make


def _own_work(code: Any) -> bool:
    return code.co_name not in NEVER_CUT and any(part in code.co_filename for part in CLIENTS)


def _refused(runner: Any, watch: Watch) -> Any:
    """A request that would begin past the deadline: fsspec's runner closed unstarted, its waiting thread
    woken with the cut; a coroutine that does nothing in its place."""
    watch.cut = True
    args = runner.cr_frame.f_locals
    args["result"][0] = watch.error()
    if asyncio.iscoroutine(args["coro"]):
        args["coro"].close()
    runner.close()
    args["event"].set()
    return _nothing()


async def _nothing() -> None:
    return None


def _look(loop: asyncio.AbstractEventLoop, task: asyncio.Future, watch: Watch) -> None:
    """Cut ``task`` once its store's outage is overdue: looked at once it has started, then at the
    outage's deadline and at least every ``RECHECK`` seconds (the outage may be found older, or a
    client may swallow a cancellation: cut again)."""
    pending: list[asyncio.TimerHandle] = []

    def look() -> None:
        if task.done():
            return
        if watch.overdue():
            _cut(task, watch)
            pending[:] = [loop.call_later(RECHECK, look)]
            return
        due = watch.due()
        wait = RECHECK if due is None else min(max(due - time.monotonic(), 0.0), RECHECK)
        pending[:] = [loop.call_later(wait, look)]

    # first looked at once the task has taken its first step, inside fsspec's try: a task cancelled before
    # it starts never runs the finally that wakes the waiting thread (which would wait forever)
    pending.append(loop.call_soon(look))
    task.add_done_callback(lambda _task: [handle.cancel() for handle in pending])


def _cut(task: asyncio.Future, watch: Watch) -> None:
    watch.cut = True
    try:
        frame = getattr(task.get_coro(), "cr_frame", None)
        result = frame.f_locals.get("result") if frame is not None else None
        if isinstance(result, list) and len(result) == 1 and not isinstance(result[0], AttemptCut):
            result[0] = watch.error()  # what fsspec's sync raises in the waiting thread
    finally:
        for work in watch.tasks:
            if not work.done():
                work.cancel()
        task.cancel()
