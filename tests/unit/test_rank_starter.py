"""rlctl.ranks.starter: local ranks forked from a process that imported what they import, in a fresh
interpreter of their own (a pytest worker runs threads: no starter is forked there). The ranks' own code
is a stand-in here; the runs of several local ranks
in tests/e2e go through the real one, bit for bit against one rank and across kills."""

import json
import os
import subprocess
import sys
import textwrap

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
