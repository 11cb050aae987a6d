"""Tool calls in worker processes: results, exceptions told to the model, a timeout that stops CPU-bound
code by killing its worker (and a fresh worker for the next call), a dead worker and ToolUnavailable as
infrastructure failures, calls running concurrently."""

import time

import pytest

from rlctl.engine.tool_workers.pool import ERROR, INFRA, OK, TIMEOUT, UNAVAILABLE, ToolPool

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("pool",)


@pytest.fixture(scope="module")
def pool():  # (a deadline no stall of a loaded machine reaches; the timeout test has a pool of its own)
    with ToolPool(workers=2, timeout_s=10.0) as p:
        yield p


def test_results_come_back_in_order(pool):
    out = pool.run(
        [
            ("toolbox:lookup", {"country": "peru"}),
            ("toolbox:add", {"a": 2, "b": 0.5}),
            ("toolbox:lookup", {"country": "x"}),
        ]
    )
    assert [(r.outcome, r.text) for r in out] == [(OK, "lima"), (OK, "2.5"), (OK, "unknown")]


def test_an_exception_is_an_error_for_the_model(pool):
    (r,) = pool.run([("toolbox:fail", {"x": 7})])
    assert r.outcome == ERROR and r.outcome not in INFRA
    assert r.text.startswith("ValueError: bad x 7 (at toolbox.py line")
    (r,) = pool.run([("toolbox:lookup", {"nation": "peru"})])  # arguments the function does not take
    assert r.outcome == ERROR and "TypeError" in r.text


@pytest.mark.slow
def test_a_timeout_kills_cpu_bound_code_and_the_next_call_gets_a_fresh_worker():
    with ToolPool(workers=2, timeout_s=1.0) as pool:
        before = {int(r.text) for r in pool.run([("toolbox:pid", {}), ("toolbox:pid", {})])}  # both started
        t0 = time.monotonic()
        slow, fast = pool.run([("toolbox:spin", {"seconds": 30}), ("toolbox:lookup", {"country": "italy"})])
        took = time.monotonic() - t0
        pids = {int(r.text) for r in pool.run([("toolbox:pid", {}), ("toolbox:pid", {})])}
    assert slow.outcome == TIMEOUT and slow.outcome in INFRA and slow.text == "the tool did not answer within 1 s"
    assert (fast.outcome, fast.text) == (OK, "rome")
    assert 1.0 <= took < 5.0  # stopped at its deadline, not after 30 s
    assert len(before) == len(pids) == 2 and len(before & pids) == 1  # a new process took the killed one's place


def test_tool_unavailable_and_a_dead_worker_are_infrastructure_failures(pool):
    down, dead, after = pool.run(
        [("toolbox:down", {}), ("toolbox:crash", {}), ("toolbox:lookup", {"country": "japan"})]
    )
    assert (down.outcome, down.text) == (UNAVAILABLE, "the lookup service is down")
    assert dead.outcome == UNAVAILABLE and dead.text == "the tool's worker process died (exit code 3)"
    assert (after.outcome, after.text) == (OK, "tokyo")
    assert {UNAVAILABLE, TIMEOUT} == INFRA


@pytest.mark.slow
def test_calls_run_concurrently(pool):
    pool.run([("toolbox:pid", {}), ("toolbox:pid", {})])  # both workers started (a start is not the tool's time)
    out = pool.run([("toolbox:span", {"seconds": 1.0}), ("toolbox:span", {"seconds": 1.0})])
    assert [r.outcome for r in out] == [OK, OK]
    (a0, a1), (b0, b1) = ([float(t) for t in r.text.split()] for r in out)
    assert b0 < a1 and a0 < b1  # two workers at once: the calls overlap (one worker would run them in turn)
