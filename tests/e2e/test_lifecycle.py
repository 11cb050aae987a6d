"""A run's lifecycle outside the happy path, end to end: the installed `rlctl` in subprocesses, real
DeepSpeed, real signals. Stop signals from the first instant of `start`, Ctrl-C, a start that never
trained run again into its directory, exit codes for a bad --from and for a run that cannot resume,
a failed snapshot said at once and seen by `inspect --check`."""

import os
import shutil
import signal
import socket
import time
from pathlib import Path

import orjson
import pytest
import yaml

from rlctl.errors import ExitCode
from rlctl.inspect import CHECK_CODES

from helpers import REPO, SMALL, events_of, invoke, kinds, metrics_of, run_cli, spawn, start_args, wait_for

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("preempted_while_building",)


def last_event(run_dir):
    events = events_of(run_dir)  # ([] before the file exists)
    return events[-1] if events else {}


def check(run_dir):
    r = invoke("inspect", str(run_dir), "--check")
    assert r.stdout.count("\n") == 1, r.stdout
    return r.returncode, r.stdout


def stop_when(proc, predicate, sig=signal.SIGTERM, timeout=300):
    """Send ``sig`` once ``predicate()`` holds; the exit code and stderr."""
    wait_for(predicate, proc, timeout=timeout)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def wait_caught(proc, sig, timeout=60):
    """Until ``proc`` catches ``sig`` (its handler is installed: /proc/PID/status SigCgt), so a test
    signals the first instant rlctl can answer, however loaded the machine is."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & (1 << (sig - 1)):
            return
        time.sleep(0.01)
    raise AssertionError(f"{sig!r} never caught by pid {proc.pid}")


def test_sigterm_in_the_first_instant_is_exit_75_and_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    proc = spawn("start", *start_args(run, steps=2), *SMALL)
    wait_caught(proc, signal.SIGTERM)  # the handler is in; imports and checks are under way, no run directory yet
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.PREEMPTED == 75, err
    assert err.strip().endswith("stopped by SIGTERM before the run began; run the same command again"), err
    assert "Traceback" not in err and not (run / "config.yaml").exists()


@pytest.fixture(scope="module")
def preempted_while_building(tmp_path_factory):
    """A start stopped by SIGTERM while the model is built: its run directory exists, with no step and
    no snapshot (the exit code and stderr with it). Tests that change it work on copies."""
    run = tmp_path_factory.mktemp("preempted") / "run"
    proc = spawn("start", *start_args(run, steps=2), *SMALL, faults="build_delay=60")  # a window to stop it
    code, err = stop_when(proc, lambda: "start" in kinds(run))  # (config.yaml comes just before the event)
    return run, code, err


def copy_of(run, tmp_path):
    """A copy of the run directory ``run`` (self-contained: test_copied_run.py)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_sigterm_while_the_model_is_built_is_preempted_and_resume_starts_over(preempted_while_building, tmp_path):
    """The run directory exists (the trainer is being built): exit 75, a `preempted` event, --check
    says preempted; resume starts the run over (it never trained) and completes."""
    preempted, code, err = preempted_while_building
    assert code == 75, err
    assert "stopped by SIGTERM before training began; no snapshot yet; resume will start over" in err
    assert f"rlctl resume {preempted} --from latest" in err and "Traceback" not in err
    assert kinds(preempted) == ["start", "preempted"]
    assert {"signal": "SIGTERM", "step": 0, "snapshot": None}.items() <= events_of(preempted)[-1].items()
    code, line = check(preempted)
    assert code == CHECK_CODES["preempted"] == 45 and line.startswith("PREEMPTED") and "step 0/2" in line

    run = copy_of(preempted, tmp_path)
    r = run_cli("resume", str(run))
    assert r.returncode == 0, r.stderr
    assert "the run never trained a step; starting it over" in r.stderr
    assert [row["step"] for row in metrics_of(run)] == [1, 2]
    assert kinds(run)[-2:] == ["resume", "completed"]
    assert check(run)[0] == 0


def test_a_start_that_never_trained_can_be_started_again_in_its_run_dir(preempted_while_building, tmp_path):
    run = tmp_path / "run"
    # a mistake found before any work: nothing is created, so the fixed command just runs
    r = invoke("start", *start_args(run, steps=2), *SMALL, "--set", "reward.function=no_such_module:fn", cwd=REPO)
    assert r.returncode == ExitCode.CONFIG and not run.exists(), r.stderr
    assert "cannot import module 'no_such_module'" in r.stderr and "Traceback" not in r.stderr

    # preempted while starting (exit 75): the directory exists, with no step and no snapshot
    preempted, code, err = preempted_while_building
    assert code == 75, err
    run = copy_of(preempted, tmp_path)
    r = invoke("start", *start_args(run, steps=2), *SMALL, "--set", "seed=7", cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert f"reusing {run}: its earlier start never trained a step" in r.stderr
    assert kinds(run) == ["start", "preempted", "start", "completed"] and events_of(run)[2]["reused"] is True
    assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == 7  # the new config
    assert [row["step"] for row in metrics_of(run)] == [1, 2]

    # a directory whose run trained is never started over (nor written to)
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "events.jsonl")}
    r = invoke("start", *start_args(run, steps=2), *SMALL, cwd=REPO)
    assert r.returncode == ExitCode.CONFIG and "already holds a run that trained 2 step(s)" in r.stderr
    assert {name: (run / name).read_bytes() for name in before} == before


def test_sigterm_to_the_driver_of_two_ranks_in_its_first_seconds_is_exit_75(tmp_path):
    run = tmp_path / "run"
    # (its ranks held 5 s as they build: on a quick machine two steps could end before a poll sees the
    # start; a rank takes its stop signal once it can, after the hold. Signalled once the start is
    # recorded: between config.yaml and that event, a stop is "before the run began", with nothing to
    # resume, and the same command is run again)
    proc = spawn("start", *start_args(run, steps=2), *SMALL, "--nproc", "2", faults="build_delay=5")
    code, err = stop_when(proc, lambda: "start" in kinds(run))
    assert code == 75, err
    assert "resume will start over" in err and "Traceback" not in err
    assert kinds(run)[-1] == "preempted"
    assert check(run)[0] == CHECK_CODES["preempted"]


def test_from_banana_is_a_usage_error(tmp_path):
    r = invoke("resume", str(tmp_path), "--from", "banana")
    assert r.returncode == ExitCode.USAGE == 2
    assert "Invalid value for '--from': expected latest, last-good, best, step-N or N; got 'banana'" in r.stderr


def test_ctrl_c_is_130_and_a_run_that_trained_without_a_snapshot_starts_over(tmp_path):
    run = tmp_path / "run"
    proc = spawn("start", *start_args(run, steps=4), *SMALL, faults="sleep@2=120")
    code, err = stop_when(proc, lambda: len(metrics_of(run)) >= 2, sig=signal.SIGINT)
    assert code == ExitCode.INTERRUPTED == 130, err
    assert err.strip().endswith("Interrupted.") and "Traceback" not in err
    assert events_of(run)[-1]["event"] == "interrupted" and events_of(run)[-1]["step"] == 2
    code, line = check(run)
    assert code == CHECK_CODES["interrupted"] == 46 and line.startswith("INTERRUPTED")

    r = run_cli("resume", str(run))  # it never committed a snapshot (it takes none): it starts over, said
    assert r.returncode == 0, r.stderr
    assert "warning: no snapshot was ever committed; starting the run over from step 0 (it trained 2" in r.stderr
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3, 4]
    assert [row["step"] for row in metrics_of(run, "metrics.abandoned.jsonl")] == [1, 2]
    assert "started_over" in kinds(run) and kinds(run)[-2:] == ["resume", "completed"]


def test_a_failed_snapshot_is_said_at_once_and_check_warns(tmp_path):
    run = tmp_path / "run"
    proc = spawn(
        "start",
        *start_args(run, steps=4, every=1),
        *SMALL,
        "--set",
        "checkpoint.max_failures=5",
        faults="enospc@2,sleep@2=120",
    )
    wait_for(lambda: (run / "events.jsonl").exists() and "snapshot_failed" in kinds(run), proc)
    code, line = check(run)
    assert code == CHECK_CODES["warning"] == 41, line
    assert "snapshot of step 2 failed and none was committed since" in line
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    warning = [x for x in err.splitlines() if x.startswith("warning: snapshot of step 2 failed:")]
    assert len(warning) == 1 and warning[0].endswith("(1 of 5)") and "no space left" in warning[0], err


def steal_lease(run_dir):
    """Another writer takes the run over (as a --force takeover would): lease.json names it."""
    thief = {"owner": "thief", "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}
    (run_dir / "lease.json").write_bytes(orjson.dumps(thief))
    return thief


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_writer_that_lost_its_lease_stops_before_its_next_write(tmp_path, nproc):
    """The lease is taken over while the run trains: the heartbeat sees it, the run stops with exit 10
    before committing another snapshot or writing another event, and leaves the new owner's lease."""
    run = tmp_path / "run"
    proc = spawn(
        "start",
        *start_args(run, steps=6, every=1),
        *SMALL,
        "--nproc",
        str(nproc),
        "--set",
        "trainer.lease_heartbeat=0.2",
        faults="sleep@2=4",
    )
    wait_for(lambda: {"event": "snapshot_committed", "step": 2}.items() <= last_event(run).items(), proc)
    thief = steal_lease(run)
    events_before = kinds(run)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.LEASE_HELD == 10, err
    assert "lease" in err.splitlines()[-1] and "Traceback" not in err
    assert kinds(run) == events_before  # nothing recorded after the lease was lost
    assert not (run / "checkpoints" / "step-000003" / "manifest.json").exists()
    assert (run / "lease.json").read_bytes() == orjson.dumps(thief)  # left to its owner
