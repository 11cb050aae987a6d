"""Every `rlctl inspect --check` exit code produced by a real run in that state (the installed `rlctl`,
real DeepSpeed, real signals). The golden outputs of inspect and runs: tests/cli/test_inspect_output.py."""

import os
import signal
import time

from rlctl.inspect import CHECK_CODES

from helpers import REPO, SMALL, drills, invoke, metrics_of, spawn, start_args, wait_for


def test_every_check_code_from_a_real_run_state(tmp_path):
    """Four real runs give every --check state: a rolled-back NaN (warning, and healthy once the firing is
    older than the window), a policy halt, a live run (healthy, then stale, then crashed under SIGKILL) and
    a preemption."""

    def check(run, *extra, env=None):
        r = invoke("inspect", str(run), "--check", *extra, env=env)
        assert r.stdout.count("\n") == 1, r.stdout  # one line
        return r.returncode, r.stdout

    nan = tmp_path / "nan"
    r = invoke(
        "start",
        *start_args(nan, steps=6, every=2),
        *SMALL,
        "--set",
        "policies=[policies/default.yaml]",
        *drills("nan_log_prob@3"),
        cwd=REPO,
    )
    assert r.returncode == 0
    assert check(nan)[0] == CHECK_CODES["warning"] == 41
    code, line = check(nan, "--window", "2")  # the firing is older than the window: a healthy completed run
    assert code == CHECK_CODES["healthy"] == 0 and line.startswith("OK ") and "completed at step 6/6" in line

    halt = {"rules": [{"name": "kl", "when": "actor/ppo_kl > 1.0", "actions": [{"type": "halt"}]}]}
    config = {"checkpoint": {"every": 2}, "trainer": {"total_steps": 6}, "policies": [halt]}
    halted = tmp_path / "halted"
    r = invoke("start", *start_args(halted, config=config), *SMALL, *drills("metric@3=actor/ppo_kl:9"), cwd=REPO)
    assert r.returncode == 20
    code, line = check(halted)
    assert code == CHECK_CODES["halted"] == 42 and "by policy rule 'kl'" in line

    live = tmp_path / "live"
    proc = spawn("start", *start_args(live, steps=4, every=1), *SMALL, faults="sleep@2=120")
    wait_for(lambda: (live / "metrics.jsonl").exists() and any(r["step"] == 2 for r in metrics_of(live)), proc)
    assert check(live, "--stale-after", "1h")[0] == 0  # running, recently stepped
    time.sleep(2.5)
    code, line = check(live, "--stale-after", "2s")
    assert code == CHECK_CODES["stale"] == 44 and "no new step for" in line
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    code, line = check(live)
    assert code == CHECK_CODES["crashed"] == 43 and line.startswith("CRASHED")

    pre = tmp_path / "pre"
    proc = spawn("start", *start_args(pre, steps=4), *SMALL, faults="sleep@1=120")
    wait_for(lambda: (pre / "metrics.jsonl").exists() and metrics_of(pre), proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75
    assert check(pre)[0] == CHECK_CODES["preempted"] == 45
    assert os.path.exists(pre / "checkpoints" / "step-000001" / "manifest.json")
