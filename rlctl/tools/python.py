"""The built-in python tool: the model's code run in the sandbox (``rlctl.sandbox``), under the run's
``rollout.multi_turn.sandbox`` limits.

```yaml
rollout:
  multi_turn:
    tools:
      - function: rlctl.tools.python:python      # each call on its own
      # - {stateful: rlctl.tools.python:Python, name: python}   # variables kept between a conversation's calls
```

The answer is what the code printed (stdout, then stderr under ``stderr:``), each part cut to
``PART_CHARS`` characters, then the last expression's value (``value: repr``). Code that raised, or hit
a limit, is the model's error (outcome ``error``): it reads what was printed, then a short traceback of
its own code's frames, or the limit's sentence ("The code was stopped: it ran past the wall-time limit
of 5 s."). The rollout then cuts the answer to ``max_tool_response_tokens``.

The stateful ``Python`` keeps a conversation's cells: each call runs the earlier cells again first,
silently, in a fresh jail, then the new one, so its variables are there and every process of a call
is still gone when the call ends (a cell that hit a limit is not run again). ``random`` is seeded, so
the cells run again draw the same numbers; code whose results depend on the clock or on the machine
may find other values than it printed the first time.

Its metrics (``CallMetrics``, found by the rollout on both tools as ``call_metrics``) are read from each
call's outcome and answer, so a replayed call counts as the call it replays: ``tool/python/calls``,
``tool/python/errors`` (the code raised or hit a limit), ``tool/python/timeouts`` (stopped by a clock: the
wall-time or CPU-time limit, or ``tool_timeout_s``) and ``tool/python/limit/<kind>`` (each limit of
``rlctl.sandbox``'s ``LIMIT_WORDS``), each summed over the ranks.
"""

from __future__ import annotations

from rlctl.sandbox import Result, current, execute, limit_sentence
from rlctl.sandbox.execution import LIMIT_WORDS
from rlctl.tools import ToolError

PART_CHARS = 4000
SUM = "sum"  # rlctl.engine.dist.SUM (this floor imports no torch): counts add up over the ranks
STOPPED = "The code was stopped: "  # limit_sentence's start
CLOCKS = ("wall_time", "cpu_time")


def _cut(text: str) -> str:
    return text if len(text) <= PART_CHARS else f"{text[:PART_CHARS]}... ({len(text) - PART_CHARS} more characters)"


def answer(result: Result) -> str:
    """The text the model reads; a ToolError carrying it when the code raised or hit a limit."""
    parts = [_cut(result.stdout)] if result.stdout else []
    if result.stderr.strip():
        parts.append("stderr:\n" + _cut(result.stderr))
    if result.value is not None:
        parts.append(f"value: {result.value}")
    if result.limit is not None:
        raise ToolError("\n".join([*parts, limit_sentence(result.limit, current())]))
    if result.error is not None:
        raise ToolError("\n".join([*parts, result.error.rstrip()]))
    return "\n".join(parts) if parts else "(no output)"


class CallMetrics:
    """``tool/python/*`` of the built-in tool's calls, from what each call ended in (a pool's outcome:
    ok, error, timeout, unavailable) and the text answered."""

    reductions = {
        "tool/python/calls": SUM,
        "tool/python/errors": SUM,
        "tool/python/timeouts": SUM,
        **{f"tool/python/limit/{kind}": SUM for kind in LIMIT_WORDS},
    }

    @staticmethod
    def limit_of(text: str) -> str | None:
        """The limit an answer says the code hit (its last line, ``limit_sentence``'s), or None."""
        last = text.rstrip().rpartition("\n")[2]
        if not last.startswith(STOPPED):
            return None
        said = last.removeprefix(STOPPED)
        return next((kind for kind, words in LIMIT_WORDS.items() if said.startswith(words.partition("{")[0])), None)

    @classmethod
    def of(cls, outcome: str, text: str) -> dict[str, float]:
        """One call's counts (every key of ``reductions``)."""
        row = dict.fromkeys(cls.reductions, 0.0)
        row["tool/python/calls"] = 1.0
        limit = cls.limit_of(text) if outcome == "error" else None
        row["tool/python/errors"] = float(outcome == "error")
        row["tool/python/timeouts"] = float(outcome == "timeout" or limit in CLOCKS)
        if limit is not None:
            row[f"tool/python/limit/{limit}"] = 1.0
        return row


def python(code: str) -> str:
    """Run Python code and read what it printed and the value of its last expression.

    Args:
        code: Python source. print() what you want to read; the value of a last line that is an expression is shown too.
    """
    return answer(execute(code, current()))


class Python:
    """A Python session kept for one conversation: variables defined in one call are there in the next."""

    def create(self) -> None:
        self.cells: list[str] = []

    def call(self, code: str) -> str:
        """Run Python code in this conversation's session and read what it printed and the value of its last expression.

        Args:
            code: Python source; the variables of earlier calls are defined. print() what you want to read.
        """
        result = execute(code, current(), tuple(self.cells))
        if result.limit is None:
            self.cells.append(code)
        return answer(result)

    def release(self) -> None:
        self.cells = []


python.call_metrics = Python.call_metrics = CallMetrics  # type: ignore[attr-defined]  # the rollout's hook
