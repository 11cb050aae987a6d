"""Experiment trackers, fed for real and read back with each tracker's own reader: TensorBoard's
EventAccumulator, the records of W&B's offline .wandb files, MlflowClient. A rollback (and a resume)
must leave one value per step, the new one; events show up as ``events/<kind>`` scalars; a resume
continues the same tracker runs; a failing tracker warns once and training goes on; the run's RNG
state is untouched."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from rlctl.errors import ConfigError
from rlctl.trackers import PIP, REQUIRES, Trackers, missing

from helpers import mlflow_runs, steps_of, tb_scalars, wandb_ids, wandb_run

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("_offline", "rolled")

ALL = ["tensorboard", "wandb", "mlflow"]


@pytest.fixture(scope="module", autouse=True)
def _offline(tmp_path_factory):
    """No user settings, no remote tracker, nothing written outside the test's directories."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "MLFLOW_TRACKING_URI"):
            mp.delenv(var, raising=False)
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(var, str(home / var.lower()))
        mp.setenv("WANDB_SILENT", "true")
        yield


class Run:
    """A run's metrics.jsonl as the trainer keeps it: rows appended, cut back at a turn."""

    def __init__(self, run_dir, names=ALL, name="demo"):
        self.rows: list[dict] = []
        self.trackers = Trackers(
            names,
            str(run_dir),
            run_name=name,
            config={"algorithm": {"kl_coef": 0.1}, "trainer": {"total_steps": 6, "loggers": names}},
            history=lambda: list(self.rows),
        )

    def row(self, step, loss, later=0.0):
        row = {"step": step, "timestamp": 1.7e9 + step + later, "actor/pg_loss": loss, "val/score/mean@4": loss / 2}
        row |= {"rollout/bad": "NaN", "flag": True, "note": "text"}
        self.rows.append(row)
        self.trackers.log_row(row)

    def turn(self, event, to_step):
        self.rows = [r for r in self.rows if r["step"] <= to_step]
        self.trackers.log_event(event)


OLD = {s: 0.5 * s for s in range(1, 7)}
NEW = {s: -0.25 * s for s in range(4, 7)}


def _process_state():
    return (
        random.getstate(),
        np.random.get_state()[1].copy(),
        torch.get_rng_state().clone(),
        signal.getsignal(signal.SIGTERM),
        signal.getsignal(signal.SIGINT),
        sys.excepthook,
        sys.exit,
    )


@pytest.fixture(scope="module")
def rolled(tmp_path_factory):
    """Rows 1..6 in all three trackers, a rollback at 6 to step 3, rows 4..6 with other values."""
    run_dir = tmp_path_factory.mktemp("rolled") / "run"
    before = _process_state()
    run = Run(run_dir)
    run.trackers.log_event({"event": "start", "total_steps": 6})  # no step yet: held until step 1
    for step in range(1, 7):
        run.row(step, OLD[step])
    run.trackers.log_event({"event": "snapshot_committed", "step": 3})  # reported late, after step 6
    run.trackers.log_event({"event": "policy", "step": 6, "rule": "kl_spike", "value": 5.0})
    run.turn({"event": "rollback", "rule": "kl_spike", "from_step": 6, "to_step": 3}, 3)
    for step in range(4, 7):
        run.row(step, NEW[step])
    run.trackers.close()
    return run_dir, before, _process_state()


# -- TensorBoard ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tensorboard_keeps_one_value_per_step_the_new_one_after_a_rollback(rolled):
    scalars = tb_scalars(rolled[0])
    assert scalars["actor/pg_loss"] == [(s, OLD[s]) for s in (1, 2, 3)] + [(s, NEW[s]) for s in (4, 5, 6)]
    assert [s for s, _ in scalars["val/score/mean@4"]] == [1, 2, 3, 4, 5, 6]
    assert all(np.isnan(v) for _, v in scalars["rollout/bad"])
    assert "flag" not in scalars and "note" not in scalars and "timestamp" not in scalars
    assert scalars["events/rollback"] == [(3, 1.0)]
    assert scalars["events/start"] == [(1, 1.0)]
    assert scalars["events/snapshot_committed"] == [(3, 1.0)]
    assert scalars.get("events/policy", []) == []  # step 6 of the abandoned branch: purged with it


@pytest.mark.slow
def test_tensorboard_shows_events_as_text(rolled):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(rolled[0] / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("events")]
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}
    assert texts[3].startswith("rollback at step 3:") and '"rule": "kl_spike"' in texts[3]


# -- W&B ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_wandb_turns_away_the_first_run_and_replays_history_into_a_branch(rolled):
    run_dir = rolled[0]
    branch = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    assert branch["branch"] == 2
    (first,) = set(wandb_ids(run_dir)) - {branch["run_id"]}

    history, runs, summary = wandb_run(run_dir, first)
    assert {s: h["actor/pg_loss"] for s, h in history.items()} == OLD
    assert summary["rlctl/turned_away_at_step"] == 3
    assert "turned-away-at-3" in runs[-1].tags
    assert runs[0].display_name == "demo" and runs[0].run_group == "demo"
    assert history[1]["events/start"] == 1 and history[1]["_timestamp"] == 1.7e9 + 1

    history, runs, _ = wandb_run(run_dir, branch["run_id"])
    assert {s: h["actor/pg_loss"] for s, h in history.items()} == {**OLD, **NEW}
    assert history[3]["events/rollback"] == 1 and "kl_spike" in history[3]["events/rollback/text"]
    assert history[2]["_timestamp"] == 1.7e9 + 2  # a replayed row keeps its time
    assert runs[0].display_name == "demo-branch-2" and runs[0].run_group == "demo"
    assert all(isinstance(v, float) and np.isnan(v) for v in [h["rollout/bad"] for h in history.values()])


# -- MLflow ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_mlflow_ends_the_turned_away_run_and_the_branch_has_one_value_per_step(rolled):
    client, (first, branch) = mlflow_runs(rolled[0])
    assert first.data.tags["rlctl.turned_away_at_step"] == "3"
    assert branch.data.tags["rlctl.branch"] == "2" and branch.data.tags["rlctl.parent_run_id"] == first.info.run_id
    assert branch.info.run_name == "demo-branch-2" and branch.info.status == "FINISHED"
    assert steps_of(client, first.info.run_id, "actor/pg_loss") == sorted(OLD.items())
    assert steps_of(client, branch.info.run_id, "actor/pg_loss") == sorted({**OLD, **NEW}.items())
    assert [s for s, _ in steps_of(client, branch.info.run_id, "val/score/mean_at_4")] == [1, 2, 3, 4, 5, 6]
    assert steps_of(client, branch.info.run_id, "events/rollback") == [(3, 1.0)]
    assert branch.data.params["algorithm.kl_coef"] == "0.1"
    assert json.loads((rolled[0] / "trackers.json").read_text())["mlflow"]["run_id"] == branch.info.run_id
    texts = [a.path for a in client.list_artifacts(branch.info.run_id, "events")]
    assert texts == ["events/00000003-rollback.txt"]


@pytest.mark.slow
def test_trackers_leave_the_rng_state_and_signal_handlers_as_they_were(rolled):
    _, before, after = rolled
    assert before[0] == after[0]
    assert np.array_equal(before[1], after[1])
    assert torch.equal(before[2], after[2])
    assert before[3:] == after[3:]


# -- resume -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_resume_continues_the_same_runs_and_purges_or_skips_the_redone_steps(tmp_path):
    run_dir = tmp_path / "run"
    run = Run(run_dir)
    for step in range(1, 6):  # preempted after step 5; the last snapshot is step 3
        run.row(step, OLD[step])
    run.trackers.log_event({"event": "preempted", "signal": "SIGTERM"})
    run.trackers.close()
    ids = json.loads((run_dir / "trackers.json").read_text())

    resumed = Run(run_dir)  # a new process: bit-exact resume from step 3
    resumed.rows = [r for r in run.rows if r["step"] <= 3]
    resumed.trackers.log_event({"event": "start", "total_steps": 6})
    resumed.trackers.log_event({"event": "resume", "step": 3, "changes": {}})
    for step in range(4, 7):
        resumed.row(step, OLD[step], later=1000.0)  # the same values, at a later time
    resumed.trackers.close()

    assert json.loads((run_dir / "trackers.json").read_text()) == ids
    scalars = tb_scalars(run_dir)
    assert scalars["actor/pg_loss"] == sorted(OLD.items())
    assert scalars["events/resume"] == [(3, 1.0)]
    assert wandb_ids(run_dir) == [ids["wandb"]["run_id"]] and len(os.listdir(run_dir / "wandb")) >= 3
    history, _, _ = wandb_run(run_dir, ids["wandb"]["run_id"])
    assert {s: h["actor/pg_loss"] for s, h in history.items()} == OLD
    client, (only,) = mlflow_runs(run_dir)
    assert only.info.run_id == ids["mlflow"]["run_id"] and only.info.status == "FINISHED"
    assert steps_of(client, only.info.run_id, "actor/pg_loss") == sorted(OLD.items())

    changed = Run(run_dir)  # a resume from step 5 with a changed knob: the runs branch
    changed.rows = [r for r in resumed.rows if r["step"] <= 5]
    changed.trackers.log_event({"event": "resume", "step": 5, "changes": {"algorithm.kl_coef": {"to": 0.2}}})
    changed.row(6, NEW[6])
    changed.trackers.close()
    client, (old, branch) = mlflow_runs(run_dir)
    assert old.data.tags["rlctl.turned_away_at_step"] == "5" and branch.data.tags["rlctl.branch"] == "2"
    assert steps_of(client, branch.info.run_id, "actor/pg_loss") == sorted({**OLD, 6: NEW[6]}.items())
    assert tb_scalars(run_dir)["actor/pg_loss"] == sorted({**OLD, 6: NEW[6]}.items())
    ids2 = json.loads((run_dir / "trackers.json").read_text())
    assert ids2["wandb"]["branch"] == 2 and ids2["wandb"]["run_id"] != ids["wandb"]["run_id"]
    history, _, _ = wandb_run(run_dir, ids2["wandb"]["run_id"])
    assert {s: h["actor/pg_loss"] for s, h in history.items()} == {**OLD, 6: NEW[6]}

    acted = Run(run_dir)  # no change asked for, but a policy acted after step 4: the re-done steps differ
    acted.rows = [r for r in changed.rows if r["step"] <= 4]
    acted.trackers.log_event({"event": "resume", "step": 4, "changes": {}, "replays_exactly": False})
    acted.row(5, -1.0)
    acted.trackers.close()
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["branch"] == 3
    client, runs = mlflow_runs(run_dir)
    assert steps_of(client, runs[-1].info.run_id, "actor/pg_loss")[-1] == (5, -1.0)


# -- failures, laziness, missing packages -----------------------------------------------------------------


def test_a_tracker_that_fails_warns_once_and_training_goes_on(tmp_path, capfd):
    run = Run(tmp_path / "run", names=["tensorboard"])
    run.row(1, 1.0)
    run.row(2, 2.0)
    tb = tmp_path / "run" / "tensorboard"
    for f in tb.iterdir():
        f.unlink()
    tb.rmdir()
    tb.write_text("not a directory")  # the next writer cannot be made
    run.turn({"event": "rollback", "rule": "r", "from_step": 2, "to_step": 1}, 1)
    run.row(2, 3.0)
    run.trackers.log_event({"event": "completed", "step": 2})
    run.trackers.close()
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "TensorBoard stops receiving metrics" in warnings[0]
    assert "metrics.jsonl keeps every row" in warnings[0]


def test_an_event_from_another_thread_is_delivered_by_the_loop_s_next_call(tmp_path):
    run = Run(tmp_path / "run", names=["tensorboard"])
    run.row(1, 1.0)
    commit = {"event": "snapshot_committed", "step": 1}
    worker = threading.Thread(target=run.trackers.log_event, args=(commit,))
    worker.start()
    worker.join()
    assert "events/snapshot_committed" not in tb_scalars(tmp_path / "run")
    run.row(2, 2.0)
    assert tb_scalars(tmp_path / "run")["events/snapshot_committed"] == [(1, 1.0)]
    run.trackers.close()


def test_nothing_is_imported_before_the_first_row_or_event(tmp_path):
    code = (
        "import sys; from rlctl.trackers import Trackers\n"
        f"t = Trackers(['tensorboard', 'wandb', 'mlflow'], {str(tmp_path)!r}, run_name='x', config={{}}, history=list)\n"
        "t.log_event({'event': 'start'})\n"  # no step yet: held back
        "heavy = [m for m in ('wandb', 'mlflow', 'tensorboard', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert os.listdir(tmp_path) == []


def test_a_tracker_whose_package_is_gone_warns_once_with_the_pip_command(tmp_path):
    code = (
        "import sys; sys.modules['wandb'] = None\n"  # what an uninstalled package looks like to import
        "from rlctl.trackers import Trackers\n"
        f"t = Trackers(['wandb'], {str(tmp_path)!r}, run_name='x', config={{}}, history=list)\n"
        "for step in (1, 2, 3): t.log_row({'step': step, 'loss': 0.5})\n"
        "t.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    (warning,) = done.stderr.splitlines()
    assert warning.startswith("warning: W&B stops receiving metrics") and "pip install 'rlctl[wandb]'" in warning


def test_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(REQUIRES, "fancy", ("rlctl_no_such_tracker_module",))
    monkeypatch.setitem(PIP, "fancy", "pip install 'rlctl[fancy]'")
    assert missing(ALL) == []
    (sentence,) = missing(["tensorboard", "fancy"])
    assert "rlctl_no_such_tracker_module" in sentence and sentence.endswith("pip install 'rlctl[fancy]'")
    assert "known: tensorboard, wandb, mlflow" in missing(["tensorbord"])[0]


def test_trackers_refuse_an_unknown_name_and_a_remote_run_dir(tmp_path):
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'"):
        Trackers(["tensorbord"], str(tmp_path), run_name="x", config={}, history=list)
    with pytest.raises(ConfigError, match="local run directory"):
        Trackers(["wandb"], "s3://bucket/run", run_name="x", config={}, history=list)


def test_trackers_json_is_written_whole(tmp_path):
    from rlctl.trackers.run_ids import TrackerIds

    ids = TrackerIds(str(tmp_path))
    ids.put("wandb", {"run_id": "a", "branch": 1})
    ids.put("mlflow", {"run_id": "b", "branch": 1})
    assert sorted(os.listdir(tmp_path)) == ["trackers.json"]
    assert TrackerIds(str(tmp_path)).get("wandb") == {"run_id": "a", "branch": 1}
    (tmp_path / "trackers.json").write_text("{not json")
    assert TrackerIds(str(tmp_path)).get("wandb") is None


def test_a_row_gives_numbers_only():
    from rlctl.trackers.base import metric_values

    values = metric_values({"step": 3, "timestamp": 1.0, "a": 1, "b": "Infinity", "c": "-Infinity", "d": True})
    assert values == {"a": 1.0, "b": float("inf"), "c": float("-inf")}


@pytest.mark.slow
def test_deepspeed_is_imported_without_mlflow_which_a_run_can_still_import_later():
    """DeepSpeed's autotuner imports MLflow when it is installed (2 s at every start of every rank);
    rlctl hides it for that import only, so a run that logs to MLflow still imports it."""
    code = (
        "import sys\n"
        "from rlctl.engine.runtime import import_deepspeed\n"
        "import_deepspeed()\n"
        "assert 'deepspeed' in sys.modules and 'mlflow' not in sys.modules, sorted(sys.modules)\n"
        "import mlflow\n"
        "assert mlflow.MlflowClient\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
