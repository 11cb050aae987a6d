"""rlctl.ranks.starter: local ranks forked from a process that imported what they import, in a fresh
interpreter of their own (a pytest worker runs threads: no starter is forked there). The ranks' own code
is a stand-in here; the runs of several local ranks
in tests/e2e go through the real one, bit for bit against one rank and across kills."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    import rlctl.ranks.starter as starter

    starter.PRELOAD = ("json",)  # (the real list costs seconds; what it imports is not the point here)

    def stand_in():
        rank = int(sys.argv[2])
        with open(f"{sys.argv[1]}.{rank}", "w") as fh:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "comm": open("/proc/self/comm").read().strip(),
                       "mark": os.environ.get("MARK"), "cleared": os.environ.get("RANK")}, fh)
        if rank == 2:
            time.sleep(60)
        sys.exit(rank + 3)

    os.environ["RANK"] = "7"  # (a launcher's around the driver: ranks must not inherit it)
    out = {}
    with starter.rank_starter(True, stand_in):
        s = starter.current()
        env = {k: v for k, v in os.environ.items() if k != "RANK"}
        ranks = [s.spawn(sys.argv[1], r, env, frozenset({"RANK"})) for r in range(3)]
        out["starter_comm"] = open(f"/proc/{s.pid}/comm").read().strip()  # (named as it starts serving)
        out["other_env_refused"] = s.spawn(sys.argv[1], 3, {**env, "OMP_NUM_THREADS": "4"}, frozenset()) is None
        for _ in range(200):
            if ranks[0].poll() is not None and ranks[1].poll() is not None and os.path.exists(f"{sys.argv[1]}.2"):
                break
            time.sleep(0.05)
        ranks[2].kill()
        for _ in range(200):
            if ranks[2].poll() is not None:
                break
            time.sleep(0.05)
        out["codes"] = [r.poll() for r in ranks]
        out["pids"] = [r.pid for r in ranks]
        out["starter"] = s.pid
    threading.Thread(target=time.sleep, args=(1,)).start()
    with starter.rank_starter(True, stand_in):
        out["with_a_thread"] = starter.current()
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_ranks_are_forked_as_their_own_processes_and_their_exits_reported(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MARK": "m"}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "rank")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["starter_comm"] == "rlctl-ranks"
    assert out["codes"] == [3, 4, -9]  # each rank's own exit, a kill as Popen reports it
    for rank, pid in enumerate(out["pids"]):
        seen = json.loads((tmp_path / f"rank.{rank}").read_text())
        assert seen == {"pid": pid, "ppid": out["starter"], "comm": f"rlctl-rank-{rank}", "mark": "m", "cleared": None}
    assert out["other_env_refused"] is True  # a rank whose environment differs is exec'd instead
    assert out["with_a_thread"] is None  # a process running two threads forks no starter
    assert not os.path.exists(f"/proc/{out['starter']}")  # ended with its block


STUCK = textwrap.dedent(
    """
    import os, sys, time
    import rlctl.ranks.starter as starter

    sys.path.insert(0, sys.argv[2])
    starter.PRELOAD = ("slow",)  # an import of 3 s, where the driver waits at most 1 s
    starter.START_TIMEOUT_S = 1.0

    def stand_in():
        open(f"{sys.argv[1]}.{sys.argv[2]}", "w").close()

    with starter.rank_starter(True, stand_in):
        s = starter.current()
        t0 = time.monotonic()
        forked = s.spawn(sys.argv[1], 0, dict(os.environ), frozenset())
        waited = time.monotonic() - t0
        gone = not os.path.exists(f"/proc/{s.pid}") or open(f"/proc/{s.pid}/stat").read().split()[2] == "Z"
        again = s.spawn(sys.argv[1], 1, dict(os.environ), frozenset())
    time.sleep(3)
    print(forked is None, again is None, 1 <= waited < 3, gone)  # (its deadline, then the kill and the reap)
    """
)


@pytest.mark.slow
def test_a_starter_that_does_not_answer_in_time_is_ended_and_its_ranks_are_execd(tmp_path):
    """The rank the driver gave up waiting for is exec'd by the driver: the starter must not fork it later."""
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(3)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", STUCK, str(tmp_path / "rank"), str(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True", "True"]
    assert not list(tmp_path.glob("rank.*"))  # no rank ran in the starter, then or later


INTERRUPTED = textwrap.dedent(
    """
    import os, select, signal, sys, time
    import rlctl.ranks.starter as starter

    starter.PRELOAD = ("json",)
    starter.START_TIMEOUT_S = 5.0
    driver, polls, ranks = os.getpid(), [], []
    signal.signal(signal.SIGUSR1, lambda *_: polls.extend(r.poll() for r in ranks))  # (as the StopForwarder)

    class Select:  # a stop lands as spawn's wait for the starter's answer ends (before it reads the answer)
        @staticmethod
        def select(r, w, x, timeout=None):
            ready = select.select(r, w, x, timeout)
            if os.getpid() == driver and ready[0] and timeout:
                os.kill(driver, signal.SIGUSR1)
            return ready

    starter.select = Select

    def stand_in():  # (alive while the next rank is forked, on a loaded machine too: no exit comes first)
        time.sleep(3)
        sys.exit(int(sys.argv[2]) + 5)

    with starter.rank_starter(True, stand_in):
        s = starter.current()
        for rank in range(2):
            ranks.append(s.spawn(sys.argv[1], rank, dict(os.environ), frozenset()))
        while any(r is not None and r.poll() is None for r in ranks):
            time.sleep(0.05)
        print([r is not None for r in ranks], [r and r.poll() for r in ranks], len(polls))
    """
)


@pytest.mark.slow
def test_a_stop_signal_that_polls_the_ranks_while_the_driver_waits_for_an_answer_takes_nothing_from_it():
    """The driver's StopForwarder polls the ranks from a signal handler, which may land while ``spawn``
    waits for the starter's answer: the answer is still spawn's, and every exit code is kept."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, "spec"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[True,", "True]", "[5,", "6]", "1"]  # (the handler polled rank 0 once)
