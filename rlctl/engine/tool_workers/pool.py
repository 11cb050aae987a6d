"""Tool calls run in worker processes, a pool per rank: a timeout is enforced by killing the worker
(CPU-bound code is stopped, as an asyncio or thread timeout cannot do), and a killed or dead worker is
replaced on its next call.

Each call ends in one of four outcomes (``process``): ``ok`` (its result), ``error`` (the tool raised: the
model is told the exception, a model-facing failure), ``timeout`` (the worker ran past
``rollout.multi_turn.tool_timeout_s`` and was killed) and ``unavailable`` (the tool raised
``ToolUnavailable``, or its worker process died): the last two are infrastructure failures, not the
model's. Workers start with the spawn method (nothing of the trainer's threads or CUDA state is
inherited) and import only the tool modules. The objects of stateful tools and environments live in the
workers (``process.Session``): a call may be bound to a worker (``run``'s ``slots``), and ``release`` ends
every object held when a rollout is over.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from rlctl.engine.tool_workers.process import ERROR, OK, RELEASE, TIMEOUT, UNAVAILABLE, Session, main

INFRA = frozenset({TIMEOUT, UNAVAILABLE})  # outcomes that are no mistake of the model's
__all__ = ["ERROR", "INFRA", "OK", "TIMEOUT", "UNAVAILABLE", "CallResult", "Session", "ToolPool"]


@dataclass(frozen=True)
class CallResult:
    outcome: str  # ok, error, timeout, unavailable
    text: str  # the result, or the sentence the model is told
    seconds: float


class _Worker:
    def __init__(self, ctx, sandbox=None) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=main, args=(child, sandbox), daemon=True, name="rlctl-tool-worker")
        self.process.start()
        child.close()
        try:
            if not self.conn.poll(120) or self.conn.recv() != ("ready", ""):
                raise EOFError("a tool worker process did not start")
        except (EOFError, OSError):  # it died starting
            self.stop(kill=True)
            raise

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.process.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                self.process.kill()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class ToolPool:
    """``workers`` processes running calls concurrently, each call given ``timeout_s`` seconds; ``sandbox``:
    the limits (``rlctl.sandbox.Limits``) the workers run the python tool's code under."""

    def __init__(self, workers: int, timeout_s: float, sandbox=None):
        self.timeout_s, self.sandbox = timeout_s, sandbox
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker | None] = [None] * workers

    @property
    def workers(self) -> int:
        return len(self._workers)

    def run(
        self,
        calls: list[tuple[str | Session, Any]],
        on_result: Callable[[int, CallResult], None] | None = None,
        slots: list[int | None] | None = None,
    ) -> list[CallResult]:
        """Each ``(module:function or Session, arguments)`` run in a worker; results in the order of
        ``calls``. ``on_result(index, result)`` is called as each call ends (a record written call by
        call). ``slots``: the worker each call must run in (None: any), so that the calls of one
        conversation's object reach the worker that holds it, in their order."""
        results: list[CallResult | None] = [None] * len(calls)
        pending = list(range(len(calls)))
        want = slots or [None] * len(calls)
        running: dict[int, tuple[int, float]] = {}  # worker slot -> (call index, start time)
        told: set[int] = set()
        while pending or running:
            for slot in range(len(self._workers)):
                if slot in running:
                    continue
                index = next((i for i in pending if want[i] is None or want[i] % len(self._workers) == slot), None)
                if index is not None:
                    pending.remove(index)
                    running[slot] = (index, time.monotonic())
                    self._send(slot, calls[index], results, running)
            self._collect(running, results)
            for index, result in enumerate(results):
                if result is not None and index not in told and on_result is not None:
                    told.add(index)
                    on_result(index, result)
        return results  # type: ignore[return-value]

    def _send(self, slot: int, call, results, running) -> None:
        worker = self._workers[slot]
        if worker is None or not worker.process.is_alive():
            if worker is not None:
                worker.stop(kill=True)
            try:
                worker = self._workers[slot] = _Worker(self._ctx, self.sandbox)
            except (EOFError, OSError) as exc:
                index, _ = running.pop(slot)
                results[index] = CallResult(UNAVAILABLE, f"the tool's worker process failed to start: {exc}", 0.0)
                return
            running[slot] = (running[slot][0], time.monotonic())  # the start-up is not the tool's time
        try:
            worker.conn.send(call)
        except OSError as exc:
            index, started = running.pop(slot)
            results[index] = CallResult(UNAVAILABLE, f"the tool's worker process failed: {exc}", 0.0)
            self._drop(slot)

    def _collect(self, running: dict[int, tuple[int, float]], results: list) -> None:
        """Wait for the first answer or deadline; record every call that finished or ran out of time."""
        if not running:
            return
        now = time.monotonic()
        deadline = min(started for _, started in running.values()) + self.timeout_s
        conns = {self._workers[slot].conn: slot for slot in running}
        ready = wait(list(conns), timeout=max(0.0, deadline - now))
        now = time.monotonic()
        for conn in ready:
            slot = conns[conn]
            index, started = running.pop(slot)
            try:
                outcome, text = conn.recv()
            except (EOFError, OSError):
                process = self._workers[slot].process
                process.join(timeout=5)  # its pipe may close before it is reaped
                code = process.exitcode
                outcome, text = UNAVAILABLE, f"the tool's worker process died (exit code {code})"
                self._drop(slot)
            results[index] = CallResult(outcome, text, now - started)
        for slot, (index, started) in list(running.items()):
            if now - started >= self.timeout_s:
                running.pop(slot)
                self._drop(slot)
                results[index] = CallResult(
                    TIMEOUT, f"the tool did not answer within {self.timeout_s:g} s", now - started
                )

    def _drop(self, slot: int) -> None:
        """Kill a worker (a timeout, a broken pipe): its slot starts a fresh one on its next call."""
        worker, self._workers[slot] = self._workers[slot], None
        if worker is not None:
            worker.stop(kill=True)

    def release(self) -> None:
        """Every live worker releases the objects it holds (``release()`` / ``close()``); one that does not
        answer within the timeout is killed (and its objects with it)."""
        for slot, worker in enumerate(self._workers):
            if worker is None or not worker.process.is_alive():
                continue
            try:
                worker.conn.send(RELEASE)
                if worker.conn.poll(self.timeout_s):
                    worker.conn.recv()
                    continue
            except (EOFError, OSError):
                pass
            self._drop(slot)

    def close(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.stop()
                self._workers[slot] = None

    def __enter__(self) -> ToolPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
