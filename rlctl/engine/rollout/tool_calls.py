"""A multi-turn rollout's calls, once parsed and checked: each made into a job for the rank's tool workers
(``engine.tool_workers.pool``), run together, replayed from the run's record where it holds them and recorded
as each ends (``engine.tool_workers.call_record``), and counted by outcome.

A function is called with the row's hidden arguments among its own (never shown to the model). A
stateful tool and an environment are objects kept per conversation in the workers (``Session``): every
call of a conversation goes to the worker holding its object, with the conversation's earlier calls,
from which a worker that does not hold it rebuilds it; the objects are released when the generate ends.
Under the ``tool_outage`` fault drill (``rlctl.faults``) every call of its steps is answered as
unavailable, the tools never asked and nothing replayed (an infrastructure failure is never recorded).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from rlctl import faults
from rlctl.engine.rollout.conversation import Conversation, ToolStats
from rlctl.engine.tool_workers.call_record import ToolRecord, call_key
from rlctl.engine.tool_workers.loader import Tools
from rlctl.engine.tool_workers.pool import ERROR, INFRA, TIMEOUT, UNAVAILABLE, CallResult, Session, ToolPool

OUTAGE = "the tool is unavailable (fault drill tool_outage)"  # what a call under the drill is answered
ENVIRONMENT = "environment"  # the name of an environment's steps in the calls and the record


class Job(NamedTuple):
    """A call to run: what the worker gets (a function's ``module:function`` or a ``Session``) and its
    arguments; the tool's name, the call's key in the record, the worker it must run in (None: any) and
    its arguments as the calls' log shows them (hidden values included)."""

    payload: str | Session
    arguments: Any
    name: str
    key: str
    slot: int | None
    shown: Any


class ToolCalls:
    def __init__(self, tools: Tools, pool: ToolPool, record: ToolRecord | None = None):
        """``tools``: the functions, stateful tools, environment and per-tool metrics by name
        (``engine.tool_workers.loader``); ``pool``: the rank's tool workers (its owner closes it); ``record``:
        the run's record of tool calls (None: nothing recorded or replayed)."""
        self.functions, self.stateful, self.environment = tools.functions, tools.stateful, tools.environment
        self.call_metrics = tools.call_metrics  # name -> a tool's own metrics of a call (tool/python/*)
        self.pool, self.record = pool, record
        self.outage: bool | None = None  # the tool_outage drill's answer for the step running (None: not asked)
        self.generation = 0  # generate calls so far: the objects of a stateful tool or environment are per call

    def begin(self, step: int) -> None:
        """A generate of ``step`` begins: the record is read for it, the drill asked once per run of a
        step (every round of it alike)."""
        self.generation += 1
        if self.record is not None:
            self.record.begin(step)
        if self.outage is None:
            self.outage = faults.tool_outage(step)

    def step_over(self) -> None:
        """The step's run is over: the next generate asks the drill again."""
        self.outage = None

    def release(self) -> None:
        """The generate is over: every conversation's objects are released (their release() / close())."""
        if self.environment is not None or self.stateful:
            self.pool.release()

    def tool_job(self, index: int, c: Conversation, step: int, turn: int, position: int, name: str, args) -> Job:
        """A well-formed call: a function called with the row's hidden values among its arguments, or a
        stateful tool's object (``index``: the conversation's place in the generate, the worker it lives
        in) asked with its earlier calls, to rebuild it where it is not held, and its create() given them."""
        hidden = c.offer.hidden.get(name, {})
        key = call_key(step, c.prompt, c.seed, turn, position, name, {**args, **hidden})
        if name not in self.stateful:
            args = {**args, **hidden}  # never shown to the model
            return Job(self.functions[name], args, name, key, None, args)
        earlier = c.history.setdefault(name, [])
        instance = f"{self.generation}:{index}:{name}"
        session = Session("tool", self.functions[name], instance, dict(hidden), tuple(earlier))
        earlier.append(args)
        return Job(session, args, name, key, index, {**args, **hidden})

    def environment_job(self, index: int, c: Conversation, step: int, turn: int, text: str) -> Job:
        """The environment's step on the model's turn ``text``: the conversation's object asked with its
        earlier actions."""
        earlier = c.history.setdefault(ENVIRONMENT, [])
        session = Session(ENVIRONMENT, self.environment, f"{self.generation}:{index}", c.env_args, tuple(earlier))
        earlier.append([text])
        key = call_key(step, c.prompt, c.seed, turn, 0, ENVIRONMENT, {"action": text})
        return Job(session, [text], ENVIRONMENT, key, index, {"action": text})

    def run(self, jobs: list[Job], stats: ToolStats) -> list[CallResult]:
        """The answers of a turn's calls: recorded ones replayed (``record``), the others run in the pool
        together and recorded. Under the ``tool_outage`` drill every call is unavailable."""
        if self.outage:
            return [CallResult(UNAVAILABLE, OUTAGE, 0.0) for _ in jobs]
        results: list[CallResult | None] = [None] * len(jobs)
        fresh = []
        for i, job in enumerate(jobs):
            old = self.record.replay(job.key) if self.record is not None else None
            if old is None:
                fresh.append(i)
            else:
                results[i] = CallResult(old.outcome, old.text, old.seconds)
                stats.replayed += 1

        def recorded(j: int, res: CallResult) -> None:  # on storage as each call ends
            if self.record is not None and res.outcome not in INFRA:
                self.record.add(jobs[fresh[j]].key, res.outcome, res.text, res.seconds)
                self.record.flush()

        t0 = time.perf_counter()
        calls = [(jobs[i].payload, jobs[i].arguments) for i in fresh]
        answered = self.pool.run(calls, recorded, [jobs[i].slot for i in fresh]) if fresh else []
        stats.seconds += time.perf_counter() - t0
        for i, res in zip(fresh, answered):
            results[i] = res
        return results  # type: ignore[return-value]

    def count(self, res: CallResult, stats: ToolStats, name: str | None = None) -> None:
        """A call's outcome counted; a tool with metrics of its own (``call_metrics``) counts it too, from
        the outcome and text alone, so that a replayed call counts as the call it replays."""
        stats.errors += res.outcome == ERROR
        stats.timeouts += res.outcome == TIMEOUT
        stats.unavailable += res.outcome == UNAVAILABLE
        if (hook := self.call_metrics.get(name)) is not None:
            for key, value in hook.of(res.outcome, res.text).items():
                stats.own[key] += value
