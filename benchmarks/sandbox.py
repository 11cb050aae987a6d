"""What running the model's code in the sandbox costs: a call's overhead, the jail's start, and code
rewards per second.

    .venv/bin/python benchmarks/sandbox.py [--calls 20] [--completions 16] [--workers 2]

Measured in one run, each figure the median of --calls calls of the same trivial code (``x = 1 + 1; x``):

- a plain worker process: the code ``exec``'d in a warm tool worker (``ToolPool``, as rlctl runs a
  trusted tool): no new process, no isolation, the baseline;
- ``unsafe`` mode (``rlctl.sandbox.execute``, ``mode: unsafe``): a fresh interpreter per call under the
  rlimits, no jail;
- the jail (``execute``, ``mode: jail``): the same in a bubblewrap jail (namespaces, binds, a tmpfs);
- the python tool through a warm tool worker with the jail: what a rollout's call pays end to end;
- the jail's start as the preflight checks it (``rlctl.sandbox.check``: one jail that prints a word).

Then code rewards per second: ``tests_passed`` on --completions completions of 4 tests each (two
stdin/stdout cases, two asserts; half the completions right, half wrong) with --workers threads, every
test its own jail; and the same in ``unsafe`` mode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

CODE = "x = 1 + 1\nx"


def plain(code: str) -> str:
    """The baseline tool: the code run in the worker itself (no new process, no isolation)."""
    namespace: dict = {}
    exec(compile(code, "<cell>", "exec"), namespace)
    return "ok"


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def call_overheads(n: int) -> None:
    from rlctl.engine.tool_workers.pool import ToolPool
    from rlctl.sandbox import Limits, check, execute

    jail, unsafe = Limits(), Limits(mode="unsafe")
    with ToolPool(1, 30) as pool:
        pool.run([(f"{__name__}:plain", {"code": CODE})])  # the worker's start is not a call's
        worker = median_ms(lambda: pool.run([(f"{__name__}:plain", {"code": CODE})]), n)
    unsafe_ms = median_ms(lambda: execute(CODE, unsafe), n)
    jail_ms = median_ms(lambda: execute(CODE, jail), n)
    with ToolPool(1, 30, sandbox=jail) as pool:
        pool.run([("rlctl.tools.python:python", {"code": CODE})])
        tool_ms = median_ms(lambda: pool.run([("rlctl.tools.python:python", {"code": CODE})]), n)
    start_ms = median_ms(lambda: check(jail, "sandbox"), max(3, n // 4))
    print(f"plain worker process (exec in a warm tool worker): {worker:7.1f} ms a call")
    print(f"unsafe mode (a fresh interpreter, rlimits):        {unsafe_ms:7.1f} ms a call")
    print(
        f"jail (bubblewrap, a fresh interpreter, rlimits):   {jail_ms:7.1f} ms a call ({jail_ms - unsafe_ms:+.1f} ms)"
    )
    print(f"python tool via a warm tool worker, jailed:        {tool_ms:7.1f} ms a call")
    print(f"the jail's start as the preflight checks it:       {start_ms:7.1f} ms")


GOOD = "```python\ndef add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n```"
WRONG = GOOD.replace("a + b", "a - b")
TESTS = {
    "cases": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6\n"}],
    "asserts": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"],
}


def rewards_per_second(completions: int, workers: int) -> None:
    from rlctl.engine.reward.code import tests_passed

    batch = [GOOD if i % 2 == 0 else WRONG for i in range(completions)]
    for mode in ("jail", "unsafe"):
        kwargs = {"workers": workers, "sandbox": {"mode": mode}}
        tests_passed([""], batch[:1], [TESTS], **kwargs)  # warm the page cache
        t0 = time.perf_counter()
        scores = tests_passed([""] * completions, batch, [TESTS] * completions, **kwargs)
        took = time.perf_counter() - t0
        assert scores == [1.0 if i % 2 == 0 else 0.0 for i in range(completions)], scores
        print(
            f"code rewards, {mode:6s} {workers} workers: {completions / took:5.1f} completions/s, "
            f"{4 * completions / took:5.1f} tests/s ({completions} completions x 4 tests in {took:.1f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    call_overheads(args.calls)
    rewards_per_second(args.completions, args.workers)


if __name__ == "__main__":
    main()
