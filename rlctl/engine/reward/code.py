"""Code-execution rewards: a completion's code run against its row's tests in the sandbox
(``rlctl.sandbox``), the tests of a batch in parallel across a pool of threads (each test its own jail).

```yaml
reward:
  function: rlctl.engine.reward.code:tests_passed
  kwargs: {all_or_nothing: false, workers: 2, sandbox: {wall_time_s: 5}}
```

A row's ``tests`` column holds ``{"cases": [{"input": STDIN, "output": STDOUT},
...], "asserts": ["assert f(2) == 4", ...]}``, either list optional. A case passes when the program,
given its input, prints its output (lines compared with their trailing spaces and the last newlines
dropped); an assert passes when the completion's code and then the assert run without raising. The code
is the completion's last fenced block (```python ... ``` or ``` ... ```), else the whole completion. The
score is the fraction of the row's tests passed, or 1/0 with ``all_or_nothing`` (a row without tests
scores 0). A test that hangs, raises or hits a limit fails; it never stalls the step (``wall_time_s``).
Validation scores the same way, so ``val/score/best@N`` is pass@N with ``all_or_nothing``.

Its metrics (``ScoreMetrics``, the reward sources' hook ``score_metrics``) count the tests a training
step's scoring ran: ``reward/code/tests``, ``reward/code/pass_frac``, ``reward/code/timeouts`` (tests stopped
at the wall-time or CPU-time limit) and ``reward/code/sandbox_s`` (seconds of the tests' jails, summed).
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import ValidationError

from rlctl.config.sandbox import SandboxConfig
from rlctl.engine.dist import MEAN, SUM
from rlctl.errors import ConfigError, InputError
from rlctl.sandbox import Limits, Result, SandboxUnavailable, check, execute

REDUCTIONS = {
    "reward/code/tests": SUM,
    "reward/code/pass_frac": MEAN,  # every rank scores an equal share
    "reward/code/timeouts": SUM,
    "reward/code/sandbox_s": SUM,
}
CLOCKS = ("wall_time", "cpu_time")
FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.DOTALL)


def code_of(completion: str) -> str:
    """The completion's last fenced code block, else the completion."""
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _same_output(printed: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip("\n").split("\n")]

    return lines(printed) == lines(expected)


class ScoreMetrics:
    """The tests run since the last ``take``, counted as they end (thread-safe)."""

    reductions = REDUCTIONS

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0, 0, 0, 0.0]  # tests, passed, timeouts, seconds

    def add(self, passed: bool, result: Result | None) -> None:
        """A test's end (``result``: its run; None when its code did not compile and nothing ran)."""
        with self._lock:
            self._counts[0] += 1
            self._counts[1] += passed
            if result is not None:
                self._counts[2] += result.limit in CLOCKS
                self._counts[3] += result.seconds

    def take(self) -> dict[str, float]:
        """The counts since the last take (every key of ``reductions``), and a fresh start."""
        with self._lock:
            (tests, passed, timeouts, seconds), self._counts = self._counts, [0, 0, 0, 0.0]
        return {
            "reward/code/tests": float(tests),
            "reward/code/pass_frac": passed / tests if tests else 0.0,
            "reward/code/timeouts": float(timeouts),
            "reward/code/sandbox_s": seconds,
        }


COUNTS = ScoreMetrics()


def _passes(job: tuple[str, str, dict | str], limits: Limits) -> bool:
    kind, code, test = job
    result = None
    if kind == "case":
        result = execute(code, limits, stdin=str(test.get("input", "")))
        passed = result.ok and _same_output(result.stdout, str(test.get("output", "")))
    elif _compiles(code):
        result = execute(str(test), limits, cells=(code,))
        passed = result.ok
    else:
        passed = False
    COUNTS.add(passed, result)
    return passed


def _compiles(code: str) -> bool:
    """Whether the code compiles (it runs as an earlier, silent cell before the assert: check it apart)."""
    try:
        compile(code, "<completion>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def _jobs(index: int, completion: str, tests: Any) -> list[tuple[int, tuple[str, str, Any]]]:
    if tests is None:
        return []
    if isinstance(tests, str):  # a column of JSON text
        try:
            tests = json.loads(tests)
        except ValueError:
            raise InputError(f"the tests of completion {index} are not JSON: {tests[:80]!r}") from None
    if not isinstance(tests, dict) or set(tests) - {"cases", "asserts"}:
        raise InputError(f"the tests of completion {index} must be {{'cases': [...], 'asserts': [...]}}, got {tests!r}")
    code = code_of(completion)
    jobs = [(index, ("case", code, case)) for case in tests.get("cases") or []]
    return jobs + [(index, ("assert", code, test)) for test in tests.get("asserts") or []]


def check_kwargs(kwargs: dict[str, Any], key: str) -> None:
    """The preflight's check of this reward's ``kwargs`` (at ``key``): their sandbox's values, and the jail
    started once; a ConfigError naming the key and the fix otherwise."""
    limits = _limits(kwargs.get("sandbox"), key)
    try:
        check(limits, f"{key}.sandbox")
    except SandboxUnavailable as exc:
        raise ConfigError(str(exc)) from None


def _limits(sandbox: Any, key: str) -> Limits:
    try:
        return SandboxConfig.model_validate(sandbox or {}).limits()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"'{key}.sandbox.{where}': {first['msg']}") from None


def tests_passed(
    prompts: list[str],
    completions: list[str],
    tests: list[Any] | None = None,
    all_or_nothing: bool = False,
    workers: int = 2,
    sandbox: dict[str, Any] | None = None,
    **columns: Any,
) -> list[float]:
    """Each completion's share of its row's tests passed (1 or 0 with ``all_or_nothing``)."""
    limits = _limits(sandbox, "reward.kwargs")
    rows = tests if tests is not None else [None] * len(completions)
    jobs = [job for i, (c, t) in enumerate(zip(completions, rows, strict=True)) for job in _jobs(i, c, t)]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        passed = list(pool.map(lambda job: _passes(job[1], limits), jobs))
    totals, wins = [0] * len(completions), [0] * len(completions)
    for (index, _), ok in zip(jobs, passed, strict=True):
        totals[index] += 1
        wins[index] += ok
    if all_or_nothing:
        return [float(t > 0 and w == t) for t, w in zip(totals, wins, strict=True)]
    return [w / t if t else 0.0 for t, w in zip(totals, wins, strict=True)]


tests_passed.check_kwargs = check_kwargs  # type: ignore[attr-defined]  # the preflight's hook (sources.py)
tests_passed.score_metrics = COUNTS  # type: ignore[attr-defined]  # the reward sources' hook (recording)
