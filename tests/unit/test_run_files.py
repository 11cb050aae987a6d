"""The pieces of a run's lifecycle that need no training: reading back JSONL files that may be malformed,
a log opened after a truncated line, the stop requests' modes, a run directory that may be started
again, and the one-line note of a failed snapshot."""

import signal

import orjson
import pytest

from rlctl.config import RunConfig
from rlctl.errors import ConfigError
from rlctl.metrics import BadLines, EventLog, parse_rows, read_rows, split_after_step
from rlctl.ranks.report import snapshot_failed_note
from rlctl.ranks.stops import Stopped, StopRequests, on_stop_signals
from rlctl.rundir.directory import claim_run_dir, load_run_config, refuse_used_run_dir
from rlctl.rundir.record import ended_since, standing
from rlctl.storage import Storage


def test_parse_rows_skips_and_reports_what_is_not_a_row():
    data = b'{"step": 1}\nnot json\n[1]\n7\n{"x": 1}\n{"step": "2"}\n{"step": true}\n\n{"step": 3, "v": "NaN"}\n{"st'
    bad = BadLines("m.jsonl")
    rows = list(parse_rows(data, bad, require_step=True))
    assert [r["step"] for r in rows] == [1, 3] and rows[1]["v"] != rows[1]["v"]  # NaN decoded
    assert bad.lines == [2, 3, 4, 5, 6, 7, 10]
    assert bad.warning() == (
        "warning: skipped 7 unreadable lines of m.jsonl (lines 2, 3, 4, 5, 6, ...): a crash mid-write, or an edit by hand"
    )
    events = list(parse_rows(b'{"event": "start"}\n[1]\n'))  # events need no step
    assert events == [{"event": "start"}]
    assert BadLines("x").warning() is None


def test_split_after_step_keeps_whole_lines():
    kept, moved = split_after_step(b'{"step": 1}\n{"step": 2}', 2)
    assert kept == b'{"step": 1}\n{"step": 2}\n' and moved == []
    kept, moved = split_after_step(b'{"step": 1}\n[2]\n{"step": 3}\n', 2)
    assert kept == b'{"step": 1}\n' and moved == [b"[2]\n", b'{"step": 3}\n']


def test_a_log_opened_after_a_truncated_line_starts_on_its_own_line(tmp_path):
    (tmp_path / "events.jsonl").write_bytes(b'{"event": "start"}\n{"event": "snapsh')
    log = EventLog(Storage(str(tmp_path)))
    log.emit({"event": "resume"})
    log.close()
    rows = read_rows(Storage(str(tmp_path)), "events.jsonl")
    assert [r["event"] for r in rows] == ["start", "resume"]


def test_a_fenced_log_writes_nothing_once_the_fence_raises(tmp_path):
    lost = []

    def fence():
        if lost:
            raise ConfigError("lost")

    log = EventLog(Storage(str(tmp_path)), fence=fence)
    log.emit({"event": "a"})
    lost.append(1)
    with pytest.raises(ConfigError):
        log.emit({"event": "b"})
    log.close()
    assert [r["event"] for r in read_rows(Storage(str(tmp_path)), "events.jsonl")] == ["a"]


class FakeTrainer:
    def __init__(self):
        self.stops = []

    def request_stop(self, reason):
        self.stops.append(reason)


def test_stop_requests_raise_at_once_then_are_kept_then_go_to_the_trainer():
    stops = StopRequests()
    with stops.at_once():
        with pytest.raises(Stopped) as caught:
            stops.request("SIGTERM")
        assert caught.value.signal_name == "SIGTERM"
        stops.request("SIGUSR1")  # a second one while the first unwinds is kept, not raised
        stops.keep()
    trainer = FakeTrainer()
    with stops.running(trainer):
        assert trainer.stops == ["SIGUSR1"]
        stops.request("SIGTERM")
    assert trainer.stops == ["SIGUSR1", "SIGTERM"]
    stops.request("SIGTERM")  # after training: kept, nothing raised
    with stops.at_once():
        stops.keep()
        stops.request("SIGTERM")  # a trainer exists: never raised again


def test_a_real_signal_raises_stopped_in_the_main_thread():
    stops = StopRequests()
    with pytest.raises(Stopped), on_stop_signals(stops.request), stops.at_once():
        signal.raise_signal(signal.SIGUSR1)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def _config(**trainer) -> RunConfig:
    return RunConfig.model_validate({"trainer": {"total_steps": 3, **trainer}})


def test_a_run_dir_that_never_trained_may_be_started_again(tmp_path):
    run = Storage(str(tmp_path / "r"))
    assert refuse_used_run_dir(run) is False
    run.makedirs()
    assert claim_run_dir(run, _config()) is False
    (tmp_path / "r" / "metrics.jsonl").write_bytes(b"")
    (tmp_path / "r" / "model").mkdir()
    assert claim_run_dir(run, _config(lease_timeout=7.0)) is True  # the same model settings: kept
    assert load_run_config(run).trainer.lease_timeout == 7.0 and (tmp_path / "r" / "model").exists()
    assert claim_run_dir(run, RunConfig.model_validate({"seed": 5})) is True  # another model: rebuilt
    assert not (tmp_path / "r" / "model").exists()

    (tmp_path / "r" / "metrics.jsonl").write_bytes(orjson.dumps({"step": 1}) + b"\n")
    with pytest.raises(ConfigError, match="already holds a run that trained 1 step"):
        refuse_used_run_dir(run)
    (tmp_path / "r" / "metrics.jsonl").write_bytes(b"garbage\n")
    with pytest.raises(ConfigError, match="holds lines that are not metric rows"):
        refuse_used_run_dir(run)
    (tmp_path / "r" / "metrics.jsonl").unlink()
    step = tmp_path / "r" / "checkpoints" / "step-000000"
    step.mkdir(parents=True)
    (step / "manifest.json").write_bytes(b"{}")
    with pytest.raises(ConfigError, match=r"committed snapshot \(step-000000\)"):
        refuse_used_run_dir(run)
    (tmp_path / "r" / "config.yaml").write_bytes(b"[oops")
    with pytest.raises(ConfigError, match="config cannot be read"):
        refuse_used_run_dir(run)


def test_the_note_of_a_failed_snapshot():
    event = {"event": "snapshot_failed", "step": 4, "error": "no space left", "consecutive": 2, "max_failures": 3}
    assert snapshot_failed_note(event) == "warning: snapshot of step 4 failed: no space left (2 of 3)"
    assert snapshot_failed_note({"step": 4, "error": "x"}) == "warning: snapshot of step 4 failed: x"


def test_a_metrics_row_on_a_full_disk_is_a_storage_error_and_leaves_no_half_line(tmp_path):
    from rlctl.errors import StorageError
    from rlctl.metrics import JsonlLog, parse_rows

    from helpers import small_tmpfs

    with small_tmpfs(tmp_path / "disk", size="64k") as disk:
        log = JsonlLog(Storage(str(disk)), "metrics.jsonl")
        step = 0
        with pytest.raises(StorageError, match=r"^cannot write .*metrics\.jsonl: no space left on device"):
            for step in range(1, 10_000):
                log.write({"step": step, "pad": "x" * 500})
        log.close()
        raw = (disk / "metrics.jsonl").read_bytes()
        assert raw.endswith(b"\n") and len(raw) == log.tell()  # every row whole, the offset true
        assert [r["step"] for r in parse_rows(raw)] == list(range(1, step))


def test_ended_since_reads_only_the_events_after_the_offset(tmp_path):
    run = Storage(str(tmp_path))
    assert not ended_since(run, 0)  # no events.jsonl yet
    log = EventLog(run)
    log.emit({"event": "completed"})
    offset = log.tell()
    log.emit({"event": "snapshot_committed", "step": 2})
    assert ended_since(run, 0) and not ended_since(run, offset)
    log.emit({"event": "crashed", "error": "boom"})
    assert ended_since(run, offset)
    log.close()
    (tmp_path / "events.jsonl").unlink()
    (tmp_path / "events.jsonl").mkdir()  # unreadable: counted as ended, so nothing more is written
    assert ended_since(run, offset)


def test_standing_of_a_run_without_steps_or_snapshots(tmp_path):
    run = Storage(str(tmp_path))
    assert standing(run, RunConfig()) == (0, None, False)
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2}\n')
    assert standing(run, RunConfig()).trained == 2
