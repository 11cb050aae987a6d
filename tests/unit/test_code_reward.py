"""Code rewards (rlctl.engine.reward.code): known good, wrong and hanging completions scored against
stdin/stdout cases and asserts in the sandbox, in parallel; a hanging test fails within the wall time
and never stalls the step; the preflight's located errors for the reward's sandbox."""

import json
import time

import pytest

from rlctl.config.reward import RewardConfig
from rlctl.engine.reward import code as code_reward
from rlctl.engine.reward.code import code_of
from rlctl.engine.reward.sources import load_reward
from rlctl.errors import ConfigError
from rlctl.sandbox import Limits, SandboxUnavailable, check

try:
    check(Limits(), "sandbox")
    problem = None
except SandboxUnavailable as exc:
    problem = str(exc)
needs_jail = pytest.mark.skipif(problem is not None, reason=f"no bubblewrap jail on this machine: {problem}")

CASES = {"cases": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]}
ASSERTS = {"asserts": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]}
GOOD_MAIN = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG_MAIN = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
HANGS = "```python\nwhile True:\n    pass\n```"
GOOD_ADD = "```python\ndef add(a, b):\n    return a + b\n```"
HALF_ADD = "```python\ndef add(a, b):\n    return int(a) + int(b)\n```"


@pytest.mark.slow
@needs_jail
def test_pass_fractions_all_or_nothing_and_a_hang_that_fails_in_time():
    completions = [GOOD_MAIN, WRONG_MAIN, HANGS, GOOD_ADD, HALF_ADD, "no code", GOOD_ADD]
    tests = [CASES, CASES, CASES, ASSERTS, json.dumps(ASSERTS), ASSERTS, None]
    kwargs = {"workers": 2, "sandbox": {"wall_time_s": 30, "cpu_time_s": 1}}  # (hangs end on their CPU second)
    started = time.monotonic()
    scores = code_reward.tests_passed([""] * 7, completions, tests, **kwargs)
    took = time.monotonic() - started
    assert scores == [1.0, 0.0, 0.0, 1.0, pytest.approx(2 / 3), 0.0, 0.0]
    assert took < 60  # two hanging cases of a CPU second each, beside 12 quick ones on 2 threads (loaded: slower)
    assert code_reward.tests_passed([""] * 2, [GOOD_ADD, HALF_ADD], [ASSERTS, ASSERTS], all_or_nothing=True) == [
        1.0,
        0.0,
    ]


def test_the_code_is_the_last_fenced_block():
    assert code_of("a\n```py\nx = 1\n```\nthen\n```\ny = 2\n```") == "y = 2\n"
    assert code_of("print(1)") == "print(1)"


def test_the_preflight_locates_a_bad_sandbox_and_a_jail_that_cannot_start():
    bad = RewardConfig(function="rlctl.engine.reward.code:tests_passed", kwargs={"sandbox": {"wall_time_s": -1}})
    with pytest.raises(ConfigError, match=r"^'reward.kwargs.sandbox.wall_time_s': Input should be greater than 0"):
        load_reward(bad)
    missing = {"function": "rlctl.engine.reward.code:tests_passed", "kwargs": {"sandbox": {"binary": "no-bwrap"}}}
    with pytest.raises(ConfigError, match=r"^'reward.sources\[0\].kwargs.sandbox.binary': 'no-bwrap' is not on PATH"):
        load_reward(RewardConfig(sources=[missing]))
