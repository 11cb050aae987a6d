"""A run is read one way (rlctl.rundir.record): the history across turns, the files read and their
warnings, the last outcome and the status, the one number check, both summaries from one reading, one
sentence for a directory that is no run, and `inspect --check --policy` replaying as `policy replay` does."""

import json
import math

import orjson
import pytest
import yaml
from click.testing import CliRunner

from rlctl import events
from rlctl.cli import cli
from rlctl.config import RunConfig
from rlctl.errors import ConfigError
from rlctl.metrics import dumps_row
from rlctl.numbers import is_number, is_step
from rlctl.rundir.record import read_run
from rlctl.rundir.summary import run_summary, state_summary
from rlctl.storage import Storage


def row(step, t, kl=0.0, **extra):
    return {"step": step, "timestamp": t, "critic/score/mean": step / 10, "actor/ppo_kl": kl, **extra}


def tag(event):
    return {"event": event, "time": "2026-01-01T00:00:00Z"}


# Written in this order: s1 s2 s3 (KL: rollback to 2) s3' s4 (crash; resumed from the snapshot of 3) s4'
KEPT = [row(1, 1.0), row(2, 2.0), row(3, 4.0), row(4, 6.0)]
ABANDONED = [
    {**row(3, 3.0, kl=5.0), "abandoned": tag("rollback")},
    {**row(4, 5.0, kl=0.7), "abandoned": tag("resume")},
]
EVENTS = [
    {"event": "start", "total_steps": 4},
    {"event": "policy", "rule": "kl", "step": 3},
    {"event": "rollback", "rule": "kl", "from_step": 3, "to_step": 2},
    {"event": "snapshot_committed", "step": 3},
    {"event": "crashed", "step": 4},
    {"event": "resume", "step": 3},
    {"event": "completed", "step": 4},
]


def make_run(path, events=EVENTS, kept=KEPT, abandoned=ABANDONED, tail=b""):
    run = Storage(str(path))
    cfg = RunConfig.model_validate({"trainer": {"total_steps": 4}})
    run.write_bytes("config.yaml", cfg.to_yaml().encode())
    run.write_bytes("metrics.jsonl", b"".join(dumps_row(r) for r in kept) + tail)
    run.write_bytes("metrics.abandoned.jsonl", b"".join(dumps_row(r) for r in abandoned))
    run.write_bytes("events.jsonl", b"".join(orjson.dumps(e) + b"\n" for e in events))
    return str(path)


def invoke(*args):
    return CliRunner().invoke(cli, list(args))


def test_the_history_holds_every_row_in_write_order_with_its_turn(tmp_path):
    record = read_run(make_run(tmp_path / "r"))
    assert [(h.step, h.turned and h.turned["event"]) for h in record.history] == [
        (1, None),
        (2, None),
        (3, "rollback"),
        (3, None),
        (4, "resume"),
        (4, None),
    ]
    assert "abandoned" not in record.history[2].row  # the tag is the turn, not a metric
    assert record.step == 4 and record.total_steps == 4


def test_each_file_is_read_once_and_warned_about_only_when_read(tmp_path):
    url = make_run(tmp_path / "r", tail=b"garbage\n")
    (tmp_path / "r" / "events.jsonl").write_bytes(b"not json\n")
    record = read_run(url)
    assert record.rows[-1]["step"] == 4 and record.bad_lines == [5]
    assert record.warnings() == [
        f"warning: skipped 1 unreadable line of {url}/metrics.jsonl (line 5): a crash mid-write, or an edit by hand"
    ]
    assert record.events == [] and len(record.warnings()) == 2
    (tmp_path / "r" / "metrics.jsonl").write_bytes(b"")
    assert record.rows[-1]["step"] == 4  # read once


@pytest.mark.parametrize(
    ("kinds", "status"),
    [
        (["start", "completed"], "completed"),
        (["start", "policy", "halted"], "halted"),
        (["start", "preempted"], "preempted"),
        (["start", "interrupted"], "interrupted"),
        (["start", "crashed", "node_lost"], "node_lost"),  # a survivor's crash, then the driver's verdict
        (["start", "completed", "resume"], "crashed"),  # a resume that never said how it ended
        (["start", "crashed"], "crashed"),
        ([], "crashed"),
    ],
)
def test_the_last_outcome_gives_the_status(tmp_path, kinds, status):
    record = read_run(make_run(tmp_path / "r", events=[{"event": k} for k in kinds]))
    assert record.status() == status
    assert (record.last_outcome() or {}).get("event") == next((k for k in reversed(kinds) if k != "policy"), None)


def test_the_terminal_events_are_named_once():
    assert {"completed", "halted", "preempted", "crashed", "interrupted", "node_lost"} == events.ENDED
    assert events.ROLLBACK == "rollback" and events.SNAPSHOT_COMMITTED == "snapshot_committed"


@pytest.mark.parametrize(
    ("value", "number", "finite"),
    [(1, True, True), (0.5, True, True), (math.nan, True, False), (-math.inf, True, False), (True, False, False)]
    + [(False, False, False), ("1", False, False), (None, False, False)],
)
def test_a_bool_is_no_number(value, number, finite):
    assert is_number(value) is number and is_number(value, finite=True) is finite


def test_a_step_is_a_whole_number_of_zero_or_more():
    assert is_step(0) and is_step(7)
    assert not any(is_step(v) for v in (-1, 1.0, True, "3", None))


def test_both_summaries_come_from_one_reading(tmp_path):
    url = make_run(tmp_path / "r")
    state = state_summary(read_run(url))
    end = run_summary(Storage(url))
    assert (state["run"], state["step"], state["status"]) == (end["run_dir"], end["steps"], "completed")
    assert state["rollbacks"] == len(end["rollbacks"]) == 1
    assert end["rollbacks"] == [{"rule": "kl", "from_step": 3, "to_step": 2}]
    assert end["snapshots"] == 1 and state["policy_firings"] == 1
    assert end["reward_end"] == pytest.approx(0.25) and state["metrics"]["critic/score/mean"]["latest"] == 0.4


def test_a_directory_that_is_no_run_is_one_sentence_everywhere(tmp_path):
    (tmp_path / "empty").mkdir()
    where = str(tmp_path / "empty")
    said = set()
    for args in (
        ["inspect", where],
        ["policy", "replay", where, "--policy", "warn-only"],
        ["policy", "calibrate", where],
    ):
        r = invoke(*args)
        assert type(r.exception) is ConfigError, r.output
        said.add(r.exception.message)
    assert said == {f"{where} is not an rlctl run directory (it has no config.yaml)"}


WATCH = [{"name": "kl-watch", "when": "actor/ppo_kl > 0.5", "actions": [{"type": "warn"}]}]


def test_check_with_a_policy_replays_the_whole_history_as_policy_replay_does(tmp_path):
    """The watch rule fires only on rows the run turned away from (by a rollback, then a resume): the
    check names the last firing that policy replay lists, not the last of the run's own events."""
    url = make_run(tmp_path / "r")
    policy = tmp_path / "watch.yaml"
    policy.write_text(yaml.safe_dump({"rules": WATCH}))
    replayed = invoke("policy", "replay", url, "--policy", str(policy), "--format", "json")
    assert replayed.exit_code == 0, replayed.output
    firings = json.loads(replayed.stdout)
    assert [(f["step"], f["turned_away"]) for f in firings] == [(3, "rollback"), (4, "resume")]
    check = invoke("inspect", url, "--check", "--policy", str(policy))
    assert check.exit_code == 41, check.output
    assert check.stdout == f"WARNING {url} at step 4/4: rule 'kl-watch' fired at step 4\n"
    assert invoke("inspect", url, "--check", "--window", "1", "--policy", str(policy)).exit_code == 41
    plain = invoke("inspect", url, "--check", "--window", "1")  # the run's own firing is out of the window
    assert plain.exit_code == 0 and plain.stdout.startswith("OK ")
