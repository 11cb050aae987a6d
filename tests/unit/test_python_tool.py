"""The built-in python tool through the tool workers, as a run calls it: printed output, the last value,
a short traceback as the model's error, a limit as the model's error, the stateful session's variables
kept between a conversation's calls (and rebuilt where its object is not held), and the preflight's
located error when the jail cannot start."""

import pytest

from rlctl.config.multi_turn import MultiTurnConfig
from rlctl.engine.tool_workers.loader import load_tools
from rlctl.engine.tool_workers.pool import ERROR, INFRA, OK, Session, ToolPool
from rlctl.errors import ConfigError
from rlctl.sandbox import Limits, SandboxUnavailable, check

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("pool",)

try:
    check(Limits(), "sandbox")
    problem = None
except SandboxUnavailable as exc:
    problem = str(exc)
pytestmark = pytest.mark.skipif(problem is not None, reason=f"no bubblewrap jail on this machine: {problem}")

LIMITS = Limits(wall_time_s=30.0, cpu_time_s=1)  # (a jail starts in seconds on a loaded machine)


@pytest.fixture(scope="module")
def pool():
    with ToolPool(workers=2, timeout_s=60.0, sandbox=LIMITS) as p:
        yield p


def test_output_value_and_traceback(pool):
    printed, failed, silent = pool.run(
        [
            ("rlctl.tools.python:python", {"code": "print('a')\nsum(range(10))"}),
            ("rlctl.tools.python:python", {"code": "print('before')\nint('x')"}),
            ("rlctl.tools.python:python", {"code": "x = 1"}),
        ]
    )
    assert (printed.outcome, printed.text) == (OK, "a\n\nvalue: 45")
    assert failed.outcome == ERROR and failed.outcome not in INFRA
    assert failed.text.startswith('before\n\nTraceback (most recent call last):\n  File "<cell>", line 2')
    assert failed.text.endswith("ValueError: invalid literal for int() with base 10: 'x'")
    assert (silent.outcome, silent.text) == (OK, "(no output)")


@pytest.mark.slow
def test_a_limit_is_the_models_error_in_the_runs_own_limits():
    with ToolPool(workers=1, timeout_s=10.0, sandbox=Limits(wall_time_s=2.0, cpu_time_s=1)) as pool:
        (r,) = pool.run([("rlctl.tools.python:python", {"code": "import time; time.sleep(60)"})])
    assert (r.outcome, r.text) == (ERROR, "The code was stopped: it ran past the wall-time limit of 2 s.")


def test_a_conversations_variables_are_kept_and_rebuilt_where_its_object_is_not_held(pool):
    spec = "rlctl.tools.python:Python"
    first = Session("tool", spec, "c1", {}, ())
    (a,) = pool.run([(first, {"code": "import random\nx = 20\nr = random.random()"})], slots=[0])
    (b,) = pool.run([(Session("tool", spec, "c1", {}, ({"code": "x = 20"},)), {"code": "x + 22"})], slots=[0])
    assert (a.outcome, b.outcome, b.text) == (OK, OK, "value: 42")
    (other,) = pool.run([(Session("tool", spec, "c2", {}, ()), {"code": "x"})], slots=[0])
    assert other.outcome == ERROR and other.text.endswith("NameError: name 'x' is not defined")
    # a worker that never held c1 (a resumed step) runs its earlier calls first: the same values
    history = ({"code": "import random\nx = 20\nr = random.random()"},)
    (c,) = pool.run([(Session("tool", spec, "c1", {}, history), {"code": "x, r"})], slots=[1])
    (d,) = pool.run(
        [(Session("tool", spec, "c1", {}, history[:0]), {"code": "import random\nrandom.seed(0)\nrandom.random()"})],
        slots=[1],
    )
    assert c.outcome == OK and c.text.startswith("value: (20, ") and c.text[len("value: (20, ") : -1] == d.text[7:]
    pool.release()


def test_the_preflight_names_the_fix_when_the_jail_cannot_start():
    mt = MultiTurnConfig(tools=[{"function": "rlctl.tools.python:python"}], sandbox={"binary": "no-such-bwrap"})
    with pytest.raises(ConfigError) as exc:
        load_tools(mt)
    assert str(exc.value).startswith("'rollout.multi_turn.sandbox.binary': 'no-such-bwrap' is not on PATH")
    assert load_tools(MultiTurnConfig(tools=[{"function": "rlctl.tools.python:python"}])).schemas["python"]
    with pytest.raises(ValueError, match=r"sandbox.wall_time_s \(10\) must be under tool_timeout_s \(10\)"):
        MultiTurnConfig(tools=[{"function": "rlctl.tools.python:python"}], sandbox={"wall_time_s": 10})
