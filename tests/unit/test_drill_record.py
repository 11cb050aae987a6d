"""The record of fault drills (rlctl/faults.py): a drill at a step fires once, each firing is an event,
and the run config's drills that events.jsonl says fired are not armed again; RLCTL_FAULTS's are the
process's."""

import time

import pytest

from rlctl import events, faults
from rlctl.errors import ConfigError


@pytest.fixture
def fired(monkeypatch):
    """The events the drills emit; RLCTL_FAULTS unset, and no drill armed after the test."""
    monkeypatch.delenv("RLCTL_FAULTS", raising=False)
    out: list[dict] = []
    yield out
    faults.configure(None)


def test_a_drill_is_written_as_it_is_read():
    for item in ("crash@3", "sleep@7=30", "metric@6=val/score/mean:0.0", "stale_rollout", "build_delay=2"):
        (drill,) = faults.parse(item)
        assert str(drill) == item


def test_a_drill_fires_once_and_is_recorded_before_it_acts(fired):
    faults.configure("nan_log_prob@5=1,sleep@2=0.01", emit=fired.append)
    assert faults.once("nan_log_prob", 4) is None
    assert faults.once("nan_log_prob", 5) == "1"
    assert faults.once("nan_log_prob", 5) is None  # a rollback replays step 5: clean
    faults.after_step(2, 0, lambda: False)
    assert fired == [
        {"event": events.DRILL_FIRED, "drill": "nan_log_prob@5=1", "step": 5, "source": "faults"},
        {"event": events.DRILL_FIRED, "drill": "sleep@2=0.01", "step": 2, "source": "faults"},
    ]
    faults.after_step(2, 0, lambda: False)
    assert len(fired) == 2


def test_a_crash_drill_raises_once_on_its_rank_and_every_rank_records_it_fired(fired):
    faults.configure("crash@3", emit=fired.append)
    with pytest.raises(RuntimeError, match="rank 0 crashed after step 3"):
        faults.after_step(3, 0, lambda: False)
    faults.after_step(3, 0, lambda: False)  # the replay of step 3 after a rollback
    faults.configure("crash@3=1")
    faults.after_step(3, 0, lambda: False)  # rank 0 of a drill for rank 1: fired, no crash
    faults.after_step(3, 0, lambda: False)
    assert [e["drill"] for e in fired] == ["crash@3"]


def test_a_sleep_drill_without_a_step_acts_after_every_step_and_is_never_recorded(fired):
    faults.configure("sleep=0.1", emit=fired.append)
    t0 = time.monotonic()
    for step in (1, 2, 2):
        faults.after_step(step, 0, lambda: False)
    assert time.monotonic() - t0 >= 0.3 and fired == []


def test_two_drills_of_one_name_at_one_step_both_fire(fired):
    faults.configure("metric@4=a:1.0,metric@4=b:2.0", emit=fired.append)
    assert [faults.once("metric", 4), faults.once("metric", 4), faults.once("metric", 4)] == ["a:1.0", "b:2.0", None]


def test_the_config_drills_that_fired_in_the_run_are_not_armed_again(fired):
    log = [
        {"event": events.START},
        {"event": events.DRILL_FIRED, "drill": "crash@3", "step": 3, "source": "faults"},
        {"event": events.DRILL_FIRED, "drill": "metric@4=a:1.0", "step": 4, "source": "faults"},
    ]
    faults.configure("crash@3,metric@4=a:1.0,metric@4=a:2.0", faults.fired_in(log), fired.append)
    faults.after_step(3, 0, lambda: False)  # a resume replays step 3: no crash
    assert faults.once("metric", 4) == "a:2.0"  # the other drill of step 4 had not fired
    assert faults.once("metric", 4) is None
    assert [e["drill"] for e in fired] == ["metric@4=a:2.0"]


def test_rlctl_faults_arms_its_drills_for_the_process_whatever_the_run_recorded(fired, monkeypatch):
    monkeypatch.setenv("RLCTL_FAULTS", "nan_log_prob@5")
    log = [{"event": events.DRILL_FIRED, "drill": "nan_log_prob@5", "step": 5, "source": "RLCTL_FAULTS"}]
    faults.configure(None, faults.fired_in(log), fired.append)
    assert faults.once("nan_log_prob", 5) == ""
    assert faults.once("nan_log_prob", 5) is None
    assert fired == [{"event": events.DRILL_FIRED, "drill": "nan_log_prob@5", "step": 5, "source": "RLCTL_FAULTS"}]


def test_a_damaged_record_is_skipped_and_disarms_nothing_it_does_not_name():
    damaged = [
        {"event": events.DRILL_FIRED},
        {"event": events.DRILL_FIRED, "drill": 7},
        {"event": events.DRILL_FIRED, "drill": "nope@3"},
        {"event": events.DRILL_FIRED, "drill": "crash@x"},
        {"event": events.DRILL_FIRED, "drill": "crash@3,crash@4"},
        {"event": events.DRILL_FIRED, "drill": ""},
        {"event": "other", "drill": "crash@5"},
        ["not", "an", "object"],
        None,
        {"event": events.DRILL_FIRED, "drill": " sleep@2=1 "},
    ]
    assert faults.fired_in(damaged) == {faults.Fault("sleep", 2, "1")}


def test_a_tool_outage_is_read_with_its_length_in_steps():
    assert faults.parse("tool_outage@3=2,tool_outage") == [
        faults.Fault("tool_outage", 3, "2"),
        faults.Fault("tool_outage", None, None),
    ]
    assert str(faults.parse("tool_outage@3=2")[0]) == "tool_outage@3=2"
    for bad in ("tool_outage@3=0", "tool_outage@3=x", "tool_outage@3=-1", "tool_outages@3"):
        with pytest.raises(ConfigError, match="tool_outage"):
            faults.parse(bad)


def test_a_tool_outage_lasts_its_step_runs_from_the_first_run_of_its_step_and_is_recorded_once(fired):
    """tool_outage@3=2: down from the first run of step 3 for two runs of steps, whatever steps they are
    (a rollback's replay of step 3 counts); a validation (step -1) while it lasts is down too and takes
    no run from it; then up for good, even at step 3 again."""
    faults.configure("tool_outage@3=2", emit=fired.append)
    assert [faults.tool_outage(1), faults.tool_outage(2), faults.tool_outage(-1)] == [False, False, False]
    assert faults.tool_outage(3) and faults.tool_outage(-1)  # the first run of step 3; a validation after it
    assert faults.tool_outage(3)  # step 3 again, after a rollback: the second run of the outage
    assert [faults.tool_outage(-1), faults.tool_outage(3), faults.tool_outage(4)] == [False, False, False]
    assert fired == [{"event": events.DRILL_FIRED, "drill": "tool_outage@3=2", "step": 3, "source": "faults"}]


def test_a_tool_outage_without_a_step_is_for_good_and_one_that_fired_is_over_at_a_resume(fired):
    faults.configure("tool_outage", emit=fired.append)
    assert all(faults.tool_outage(step) for step in (1, 2, 2, -1, 9)) and fired == []
    log = [{"event": events.DRILL_FIRED, "drill": "tool_outage@3", "step": 3, "source": "faults"}]
    faults.configure("tool_outage@3", faults.fired_in(log), fired.append)  # the resume
    assert not faults.tool_outage(3) and fired == []
