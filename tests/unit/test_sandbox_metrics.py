"""The sandbox's metrics: ``tool/python/*`` counted from the built-in tool's calls as the tool workers
answer them (good code, code that raises, escape attempts each counted as the limit of its kind), and
``reward/code/*`` from the code rewards' tests (good, wrong, hanging), through the reward sources'
``recording`` as a training step reads them; every key catalogued and reduced as declared."""

import pytest

from rlctl.config.reward import RewardConfig
from rlctl.engine.dist import MEAN, SUM
from rlctl.engine.reward.sources import load_reward, metrics_of, recording
from rlctl.engine.tool_workers.pool import ToolPool
from rlctl.policies.catalogue import known_metric
from rlctl.sandbox import Limits, SandboxUnavailable, check
from rlctl.tools.python import CallMetrics, Python, python

try:
    check(Limits(), "sandbox")
    problem = None
except SandboxUnavailable as exc:
    problem = str(exc)
needs_jail = pytest.mark.skipif(problem is not None, reason=f"no bubblewrap jail on this machine: {problem}")

LIMITS = Limits(wall_time_s=10.0, cpu_time_s=1, memory_mb=256, processes=8, output_kb=16)  # (a loaded jail: seconds)
BOMB = """
import os, time
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
"""
CODE = {
    "good": "print(6 * 7)",
    "raises": "1 / 0",
    "reads the home directory": "open('/root/.bashrc').read()",
    "sleeps": "import time; time.sleep(60)",
    "spins": "while True: pass",
    "allocates": "x = bytearray(1 << 30)",
    "forks": BOMB,
    "prints": "print('x' * (8 << 20))",
}


def _summed(results) -> dict[str, float]:
    total = dict.fromkeys(CallMetrics.reductions, 0.0)
    for r in results:
        for key, value in CallMetrics.of(r.outcome, r.text).items():
            total[key] += value
    return total


@pytest.mark.slow
@needs_jail
def test_the_python_tools_calls_errors_timeouts_and_limits_by_kind():
    with ToolPool(workers=2, timeout_s=30.0, sandbox=LIMITS) as pool:
        results = pool.run([("rlctl.tools.python:python", {"code": code}) for code in CODE.values()])
    by = dict(zip(CODE, results, strict=True))
    limits = {name: CallMetrics.limit_of(r.text) for name, r in by.items()}
    assert limits["sleeps"] == "wall_time"
    assert limits["spins"] in ("cpu_time", "wall_time")  # its CPU second may not come within 10 s on a loaded machine
    assert limits["allocates"] == "memory" and limits["prints"] == "output"
    assert limits["forks"] in ("processes", "wall_time", "cpu_time")  # processes where a pids cgroup can be made
    assert [limits[k] for k in ("good", "raises", "reads the home directory")] == [None, None, None]
    total = _summed(results)
    assert total["tool/python/calls"] == 8 and total["tool/python/errors"] == 7
    assert total["tool/python/timeouts"] == sum(limit in ("wall_time", "cpu_time") for limit in limits.values()) >= 2
    for kind in ("wall_time", "cpu_time", "memory", "processes", "output"):
        expected = sum(limit == kind for limit in limits.values())
        assert total[f"tool/python/limit/{kind}"] == expected, kind


def test_a_pool_timeout_counts_and_printed_words_are_not_a_limit():
    assert CallMetrics.of("timeout", "the tool did not answer within 10 s")["tool/python/timeouts"] == 1
    told = "The code was stopped: it ran past the wall-time limit of 5 s."
    assert CallMetrics.of("ok", told)["tool/python/limit/wall_time"] == 0  # the code printed it, and ended well
    assert CallMetrics.of("error", "x\n" + told)["tool/python/limit/wall_time"] == 1
    assert CallMetrics.of("error", told + "\nZeroDivisionError: division by zero")["tool/python/errors"] == 1
    assert CallMetrics.limit_of(told + "\nZeroDivisionError: division by zero") is None
    assert python.call_metrics is CallMetrics and Python.call_metrics is CallMetrics
    assert set(CallMetrics.reductions.values()) == {SUM}
    assert all(known_metric(key) for key in CallMetrics.reductions)


ADD = {"asserts": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}
ECHO = {"cases": [{"input": "4\n", "output": "8\n"}]}


@pytest.mark.slow
@needs_jail
def test_the_code_rewards_tests_pass_fraction_timeouts_and_sandbox_seconds():
    cfg = RewardConfig(
        function="rlctl.engine.reward.code:tests_passed",
        kwargs={"workers": 2, "sandbox": {"wall_time_s": 30, "cpu_time_s": 1}},  # (the hang ends on its CPU second)
    )
    fn = load_reward(cfg)
    how = metrics_of(fn)
    assert how == {
        "reward/code/tests": SUM,
        "reward/code/pass_frac": MEAN,
        "reward/code/timeouts": SUM,
        "reward/code/sandbox_s": SUM,
    }
    assert all(known_metric(key) for key in how)
    fn([""], ["```python\ndef add(a, b):\n    return a + b\n```"], tests=[ADD])  # validation: not the step's
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",  # good: 2 of 2
        "```python\ndef add(a, b):\n    return a - b\n```",  # wrong: 1 of 2 (add(-1, 1) fails too: -2)
        "```python\nprint(int(input()) * 2)\n```",  # good case
        "```python\nwhile True:\n    pass\n```",  # hangs: fails at its CPU second (a timeout)
        "```python\ndef add(a, b) return\n```",  # does not compile: 2 tests failed, none run
    ]
    with recording(fn) as row:
        scores = fn([""] * 5, completions, tests=[ADD, ADD, ECHO, ECHO, ADD])
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert row["reward/code/tests"] == 8 and row["reward/code/pass_frac"] == pytest.approx(3 / 8)
    assert row["reward/code/timeouts"] == 1
    assert 1.0 <= row["reward/code/sandbox_s"] < 60  # the hang's CPU second, and five quick jails (loaded: slower)
