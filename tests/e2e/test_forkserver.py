"""The tests' fork server (tests/support/forkserver.py) gives the process the console script gives: a run
forked by it and the same run of the installed `rlctl` end with the same outputs, rows and weights."""

import os

from helpers import SMALL, completed_hash, metrics_of, spawn, stable


def _start(run, fork: bool):
    args = ["start", "--run-dir", str(run), *SMALL, "--set", "trainer.total_steps=3", "--set", "checkpoint.every=2"]
    proc = spawn(*args, fork=fork)
    out, err = proc.communicate(timeout=600)
    return proc, out, err


def test_a_forked_run_is_the_console_scripts_run(tmp_path):
    forked, out_f, err_f = _start(tmp_path / "forked", fork=True)
    script, out_s, err_s = _start(tmp_path / "script", fork=False)
    assert type(forked).__name__ == "Forked" and type(script).__name__ == "Popen"
    assert forked.pid != os.getpid()
    assert forked.returncode == script.returncode == 0, (err_f, err_s)
    assert out_f == f"{tmp_path / 'forked'}\n" and out_s == f"{tmp_path / 'script'}\n"
    assert completed_hash(tmp_path / "forked") == completed_hash(tmp_path / "script")
    assert stable(metrics_of(tmp_path / "forked")) == stable(metrics_of(tmp_path / "script"))
    for err in (err_f, err_s):
        assert "snapshots   2 committed" in err and "Traceback" not in err
