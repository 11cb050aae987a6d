"""A run SIGKILLed before its first snapshot commits is no dead end: `rlctl resume` starts it over from
step 0 (it is seeded, so it trains the same steps again, to the same metrics), its rows moved to
metrics.abandoned.jsonl and said; a run whose committed snapshots are gone keeps exit 11. The installed
`rlctl` in subprocesses, real DeepSpeed, real SIGKILLs."""

import shutil
import signal

import pytest

from rlctl.errors import ExitCode

from helpers import (
    SMALL,
    completed_hash,
    events_of,
    has_step,
    invoke,
    metrics_of,
    run_cli,
    spawn,
    stable,
    start_args,
    wait_for,
)

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("reference",)

RUN = [*SMALL, "--set", "trainer.total_steps=6", "--set", "checkpoint.every=4"]  # the first commit: step 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run, never interrupted."""
    run = tmp_path_factory.mktemp("reference") / "run"
    r = run_cli("start", *start_args(run), *RUN)
    assert r.returncode == 0, r.stderr
    return run


def kill_when(proc, ready) -> None:
    wait_for(ready, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_run_killed_at_each_step_before_its_first_commit_resumes_as_if_never_killed(reference, tmp_path):
    """SIGKILL after step 1 (the start), after step 2 and after step 3 (each a resume that started the
    run over), and after step 4 with its snapshot written but its commit held: each resume starts over
    from step 0, and the last one completes the run with the reference's weights and metrics. Every
    attempt's rows are in metrics.abandoned.jsonl, equal to the reference's first steps."""
    run = tmp_path / "run"
    kill_when(spawn("start", *start_args(run), *RUN, faults="sleep@1=120"), has_step(run, 1))
    for k in (2, 3):
        kill_when(spawn("resume", str(run), faults=f"sleep@{k}=120"), has_step(run, k))
    step4 = run / "checkpoints" / "step-000004"
    kill_when(spawn("resume", str(run), faults="commit_delay@4=120"), lambda: (step4 / "state.pt").exists())
    assert not (step4 / "manifest.json").exists()

    r = run_cli("resume", str(run))
    assert r.returncode == 0, r.stderr
    assert "warning: no snapshot was ever committed; starting the run over from step 0" in r.stderr

    started = events_of(run, "started_over")
    trained = [e["trained"] for e in started]
    assert trained[:3] == [1, 2, 3] and trained[3] >= 4  # (steps 5 and 6 may run while the commit is held)
    assert [e["abandoned_metric_rows"] for e in started] == trained
    assert [e["step"] for e in events_of(run, "resume")] == [0, 0, 0, 0]
    assert [e["step"] for e in events_of(run, "snapshot_committed")] == [4, 6]

    abandoned = metrics_of(run, "metrics.abandoned.jsonl")
    assert [r["step"] for r in abandoned] == [s for n in trained for s in range(1, n + 1)]
    assert all(r["abandoned"]["event"] == "resume" and r["abandoned"]["started_over"] for r in abandoned)
    first = stable(metrics_of(reference))
    attempts, at = [], 0
    for n in trained:
        attempts.append(stable(abandoned[at : at + n]))
        at += n
    assert attempts == [first[:n] for n in trained]  # each attempt trained the reference's steps
    assert stable(metrics_of(run)) == first
    assert completed_hash(run) == completed_hash(reference)


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_run_whose_committed_snapshots_are_unusable_keeps_exit_11(reference, tmp_path, damage):
    """Its snapshots were committed, then deleted or cut short: starting it over would throw away what it
    kept, so the resume is refused (exit 11) and nothing moves."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for snapshot in sorted((run / "checkpoints").glob("step-*")):
        if damage == "deleted":
            shutil.rmtree(snapshot)
        else:
            (snapshot / "state.pt").write_bytes(b"")
    rows = (run / "metrics.jsonl").read_bytes()
    r = invoke("resume", str(run))
    assert r.returncode == ExitCode.SNAPSHOT == 11, r.stderr
    assert "though the run committed snapshots before and trained 6 step(s)" in r.stderr
    assert (run / "metrics.jsonl").read_bytes() == rows and not (run / "metrics.abandoned.jsonl").exists()
    assert events_of(run, "started_over") == []
