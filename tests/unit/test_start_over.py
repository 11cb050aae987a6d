"""A resume that finds no usable snapshot (``rlctl.run.plan_resume``): a run that never committed one
starts over from step 0, its rows moved aside and said; a run whose snapshots were committed, none
usable now, is refused with exit 11. On real local run directories, without a trainer."""

import orjson
import pytest

from rlctl import events as names
from rlctl.config import RunConfig, validate_config
from rlctl.errors import ExitCode, SnapshotError
from rlctl.metrics import EventLog, read_rows
from rlctl.run import plan_resume
from rlctl.rundir.history import ever_committed
from rlctl.rundir.snapshots import snapshot_catalog, snapshot_manager, snapshot_storage
from rlctl.storage import Storage

from helpers import Number


class Notes:
    """A Reporter that keeps what it is told."""

    def __init__(self):
        self.notes: list[str] = []

    def ready(self, step, total): ...

    def step(self, row): ...

    def note(self, text):
        self.notes.append(text)


def trained(tmp_path, steps: int) -> Storage:
    """A run directory whose run wrote the metric rows of ``steps`` steps and its start."""
    run = Storage(str(tmp_path / "run"))
    run.write_bytes(
        "metrics.jsonl", b"".join(orjson.dumps({"step": s, "loss": s / 10}) + b"\n" for s in range(1, steps + 1))
    )
    run.write_bytes("events.jsonl", orjson.dumps({"event": "start", "total_steps": 6}) + b"\n")
    return run


def commit(run: Storage, cfg: RunConfig, step: int) -> None:
    """A real committed snapshot of ``step`` (its manifest written last), and its event."""
    events = EventLog(run)
    manager = snapshot_manager(run, cfg, events)
    manager.save(step, {"counter": Number(step)}, {}, good=True)
    assert manager.wait() is True
    manager.close()
    events.close()


def plan(run: Storage, cfg: RunConfig, notes: Notes):
    """What ``rlctl resume RUN`` plans, after it tidied the checkpoint storage as it does."""
    events = EventLog(run)
    try:
        catalog = snapshot_catalog(run, cfg, events)
        catalog.remove_uncommitted()
        return plan_resume(run, cfg, catalog, "latest", {}, notes, events)
    finally:
        events.close()


def config(every: int = 4) -> RunConfig:
    return validate_config({"trainer": {"total_steps": 6}, "checkpoint": {"every": every, "writer": "thread"}}, {})


@pytest.mark.parametrize("every", [4, 0])
def test_a_run_that_never_committed_a_snapshot_starts_over_and_moves_its_rows_aside(tmp_path, every):
    """Killed before its first commit (every 4), or one that never snapshots (every 0): the plan starts
    over (no snapshot to try), every row moves to metrics.abandoned.jsonl tagged as a resume from step 0,
    a started_over event counts them, and a warning says so."""
    run, notes = trained(tmp_path, 3), Notes()
    resume = plan(run, config(every), notes)
    assert resume is not None and resume.names == () and resume.from_step == 0
    assert read_rows(run, "metrics.jsonl") == []
    moved = read_rows(run, "metrics.abandoned.jsonl")
    assert [(r["step"], r["loss"]) for r in moved] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert {r["abandoned"]["event"] for r in moved} == {"resume"}
    assert all(r["abandoned"]["from_step"] == 0 and r["abandoned"]["started_over"] is True for r in moved)
    started = [e for e in read_rows(run, "events.jsonl") if e["event"] == names.STARTED_OVER]
    assert [(e["trained"], e["abandoned_metric_rows"]) for e in started] == [(3, 3)]
    assert notes.notes == [
        "warning: no snapshot was ever committed; starting the run over from step 0 (it trained 3 step(s); "
        "3 metric row(s) moved to metrics.abandoned.jsonl)"
    ]


def test_an_uncommitted_snapshot_directory_is_no_commit(tmp_path):
    """Killed between its first snapshot's files and its manifest: the directory is removed, the run starts over."""
    run, cfg = trained(tmp_path, 4), config()
    snapshot_storage(run, cfg).write_bytes("step-000004/state.pt", b"half")
    assert not ever_committed(run, snapshot_storage(run, cfg))
    resume = plan(run, cfg, Notes())
    assert resume is not None and resume.names == ()
    assert not snapshot_storage(run, cfg).exists("step-000004")
    assert len(read_rows(run, "metrics.abandoned.jsonl")) == 4


def test_a_run_whose_committed_snapshot_is_gone_keeps_exit_11(tmp_path):
    """Its snapshot was committed (events.jsonl says so), then deleted: refused, and nothing moves."""
    run, cfg = trained(tmp_path, 5), config()
    commit(run, cfg, 4)
    snapshot_storage(run, cfg).rm("step-000004", recursive=True)
    rows = run.read_bytes("metrics.jsonl")
    with pytest.raises(SnapshotError) as refused:
        plan(run, cfg, Notes())
    assert refused.value.exit_code == ExitCode.SNAPSHOT == 11
    assert "though the run committed snapshots before and trained 5 step(s)" in refused.value.message
    assert run.read_bytes("metrics.jsonl") == rows and not run.exists("metrics.abandoned.jsonl")
    assert not any(e["event"] == names.STARTED_OVER for e in read_rows(run, "events.jsonl"))


def test_a_committed_snapshot_that_is_not_usable_keeps_exit_11(tmp_path):
    """Committed, then a file of it cut short: it is still there, committed and unusable: refused."""
    run, cfg = trained(tmp_path, 5), config()
    commit(run, cfg, 4)
    run.write_bytes("events.jsonl", orjson.dumps({"event": "start", "total_steps": 6}) + b"\n")  # no commit event
    snapshot_storage(run, cfg).write_bytes("step-000004/state.pt", b"")
    notes = Notes()
    with pytest.raises(SnapshotError, match="though the run committed snapshots before"):
        plan(run, cfg, notes)
    assert notes.notes and notes.notes[0].startswith(
        "warning: skipping snapshot step-000004: file state.pt has 0 bytes"
    )


def test_a_quarantined_snapshot_was_committed(tmp_path):
    """A manifest that cannot be read is moved to quarantine/ (never deleted): a commit happened, so 11."""
    run, cfg = trained(tmp_path, 5), config()
    snapshot_storage(run, cfg).write_bytes("step-000004/manifest.json", b"{not json")
    with pytest.raises(SnapshotError, match="though the run committed snapshots before"):
        plan(run, cfg, Notes())
    assert snapshot_storage(run, cfg).listdir("quarantine")


def test_ever_committed_reads_the_catalog_the_quarantine_and_the_events(tmp_path):
    run, cfg = trained(tmp_path, 2), config()
    checkpoints = snapshot_storage(run, cfg)
    assert not ever_committed(run, checkpoints)
    run.append_bytes("events.jsonl", orjson.dumps({"event": "snapshot_failed", "step": 4}) + b"\n")
    assert not ever_committed(run, checkpoints)  # a failed snapshot is no commit
    run.append_bytes("events.jsonl", orjson.dumps({"event": "snapshot_committed", "step": 4}) + b"\n")
    assert ever_committed(run, checkpoints)


def test_a_run_that_never_trained_starts_over_quietly(tmp_path):
    """No row at all (stopped while it was built): it starts over, with nothing to move and no warning."""
    run = Storage(str(tmp_path / "run"))
    run.write_bytes("events.jsonl", orjson.dumps({"event": "start", "total_steps": 6}) + b"\n")
    notes = Notes()
    resume = plan(run, config(), notes)
    assert resume is not None and resume.names == ()
    assert notes.notes == ["no snapshot yet: the run never trained a step; starting it over"]
    assert not any(e["event"] == names.STARTED_OVER for e in read_rows(run, "events.jsonl"))
