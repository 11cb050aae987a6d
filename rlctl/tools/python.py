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
"""

from __future__ import annotations

from rlctl.sandbox import Result, current, execute, limit_sentence
from rlctl.tools import ToolError

PART_CHARS = 4000


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
