"""Best snapshots: the last validation a manifest records, retention's keep_best, ``best()``, the spec
"best" and the validation column of ``rlctl checkpoints``, on real local storage with small Statefuls."""

import csv
import io
import json

import orjson
import pytest
from click.testing import CliRunner

from rlctl.checkpoint.catalog import BestRule, parse_step_spec
from rlctl.checkpoint.retention import KeepBest, Retention
from rlctl.checkpoint.snapshots import SnapshotManager
from rlctl.cli import cli
from rlctl.config import RunConfig
from rlctl.errors import SnapshotError
from rlctl.rundir.snapshots import snapshot_catalog, snapshot_manager
from rlctl.storage import Storage

from helpers import Number

SCORE = "val/score/mean"
LENGTH = "val/response_length/mean"


def save(manager, step, score=None, val_step=None, good=True, **more):
    """A snapshot of ``step`` whose manifest records a validation of ``val_step`` (default: ``step``)
    with val/score/mean ``score`` (and ``more`` metrics, by their names with / as __); none when
    neither is given."""
    metrics = {SCORE: score} if score is not None else {}
    metrics.update({k.replace("__", "/"): v for k, v in more.items()})
    meta = {"val": {"step": step if val_step is None else val_step, "metrics": metrics}} if metrics else None
    manager.save(step, {"counter": Number(step)}, {}, good=good, meta=meta)
    assert manager.wait() is True


@pytest.fixture
def storage(tmp_path):
    return Storage(str(tmp_path / "ckpt"))


def steps(infos):
    return [i.step for i in infos]


@pytest.mark.slow
def test_a_manifest_records_the_last_validation_and_it_reads_back(storage):
    m = SnapshotManager(storage)
    save(m, 1)
    save(m, 2, 0.25, val_step=2, val__response_length__mean=7)
    save(m, 3, None, val_step=2, val__openai__gsm8k__score__mean=None)  # NaN reaches JSON as null
    plain, scored, nan = m.catalog.scan()
    assert (plain.val_step, plain.val_metric(SCORE)) == (None, None) and "val" not in plain.manifest
    assert (scored.val_step, scored.val_metric(SCORE), scored.val_metric(LENGTH)) == (2, 0.25, 7.0)
    assert isinstance(scored.val_metric(LENGTH), float) and scored.val_metric("val/other") is None
    assert nan.usable and nan.val_step == 2 and nan.val_metric("val/openai/gsm8k/score/mean") is None
    assert orjson.loads(storage.read_bytes("step-000002", "manifest.json"))["val"] == {
        "step": 2,
        "metrics": {SCORE: 0.25, LENGTH: 7},
    }


@pytest.mark.slow
def test_retention_keeps_the_k_best_while_keep_last_evicts_the_others(storage):
    m = SnapshotManager(storage, retention=Retention(keep_last=1, best=KeepBest(SCORE, "max", 2)))
    for step, score in [(1, 0.1), (2, 0.9), (3, 0.3), (4, 0.7), (5, 0.2)]:
        save(m, step, score)
    save(m, 6, 0.4, good=False)  # a bad snapshot is never one of the best, whatever it scored
    save(m, 7, 0.95, good=False)
    save(m, 8, good=False)  # validated nowhere: only keep_last keeps it
    # best two good: 2 (0.9), 4 (0.7); newest good: 5; newest: 8
    assert steps(m.catalog.scan()) == [2, 4, 5, 8]
    low = SnapshotManager(storage, retention=Retention(keep_last=1, best=KeepBest(SCORE, "min", 1)))
    save(low, 9, 0.5)
    assert steps(low.catalog.scan()) == [5, 9]  # 5 (0.2) is the lowest; 2, 4 and 8 go


def test_only_validated_steps_rank_and_ties_go_to_the_earlier_step(storage):
    m = SnapshotManager(storage)
    save(m, 1, 0.9, val_step=0)  # carried from the validation before training: never ranks
    save(m, 2, 0.5)  # its own weights gave 0.5
    save(m, 3, 0.9, val_step=2)  # carried: 3's weights were never validated
    save(m, 5, 0.5)
    save(m, 6, 0.1, val_step=6)
    assert steps(m.catalog.best(SCORE, "max")) == [2, 5, 6]
    assert steps(m.catalog.best(SCORE, "min")) == [6, 2, 5]
    kept = SnapshotManager(storage, retention=Retention(keep_last=1, best=KeepBest(SCORE, "max", 1)))
    save(kept, 7, 0.2)
    assert steps(kept.catalog.scan()) == [2, 7]


@pytest.mark.slow
def test_best_is_the_usable_good_snapshots_that_record_the_metric(storage):
    m = SnapshotManager(storage)
    save(m, 1, 0.3, val__response_length__mean=40)
    save(m, 2, 0.8, val__response_length__mean=20)
    save(m, 3, 0.9, good=False, val__response_length__mean=10)
    save(m, 4, 0.7, val__response_length__mean=30)
    save(m, 5, 0.99)  # damaged below
    save(m, 6)
    storage.rm("step-000005/state.pt")
    assert steps(m.catalog.best(SCORE, "max")) == [2, 4, 1]
    assert steps(m.catalog.best(SCORE, "min")) == [1, 4, 2]
    assert steps(m.catalog.best(LENGTH, "min")) == [2, 4, 1]
    assert m.catalog.best("val/nothing", "max") == []
    with pytest.raises(ValueError, match="mode max or min"):
        m.catalog.best(SCORE, "highest")


def test_the_spec_best_ranks_by_keep_best_else_the_highest_val_score(storage):
    assert parse_step_spec("best") == "best"
    m = SnapshotManager(storage)
    save(m, 1, 0.3, val__response_length__mean=40)
    save(m, 2, 0.8, val__response_length__mean=20)
    save(m, 3, 0.9)  # the best, but damaged below: it stays first, with the reason, for the caller to say
    save(m, 4, 0.5, val__response_length__mean=30)
    storage.write_bytes("step-000003/state.pt", b"")
    best = m.catalog.candidates("best")
    assert [(i.step, i.usable) for i in best] == [(3, False), (2, True), (4, True), (1, True)]
    assert "state.pt has 0 bytes" in best[0].problem and m.catalog.best_rule == BestRule(SCORE, "max")
    shortest = SnapshotManager(storage, retention=Retention(best=KeepBest(LENGTH, "min", 1)))
    assert steps(shortest.catalog.candidates("best")) == [2, 4, 1]


@pytest.mark.slow
def test_best_when_no_snapshot_records_the_metric_is_one_sentence(storage):
    m = SnapshotManager(storage, retention=Retention(best=KeepBest("val/gsm8k/score/mean", "max", 1)))
    save(m, 1, 0.5)
    save(m, 2, good=False, val__gsm8k__score__mean=0.9)  # only a bad snapshot records it
    with pytest.raises(SnapshotError) as caught:
        m.catalog.candidates("best")
    message = caught.value.message
    assert "val/gsm8k/score/mean" in message and storage.url in message and message.count(". ") == 0
    assert steps(SnapshotManager(storage).catalog.candidates("best")) == [1]  # the default metric: recorded


BAD_VAL = {
    "not an object": ([0.5], "its 'val' is a list, not an object"),
    "metrics a list": ({"step": 2, "metrics": [0.5]}, "its val metrics are a list, not an object"),
    "no metrics": ({"step": 2}, "its val metrics are a NoneType, not an object"),
    "a string value": ({"step": 2, "metrics": {SCORE: "0.5"}}, f"its val metric {SCORE} is '0.5', not a number"),
    "a boolean value": ({"step": 2, "metrics": {SCORE: True}}, f"its val metric {SCORE} is True, not a number"),
    "step a string": ({"step": "2", "metrics": {}}, "its val step is '2', not a step number"),
    "step negative": ({"step": -1, "metrics": {}}, "its val step is -1, not a step number"),
}


@pytest.mark.parametrize("val", list(BAD_VAL), ids=list(BAD_VAL))
def test_a_malformed_val_makes_the_manifest_unreadable_and_quarantined(storage, val):
    bad, reason = BAD_VAL[val]
    events = []
    m = SnapshotManager(storage, on_event=events.append)
    save(m, 1, 0.1)
    save(m, 2, 0.9)
    manifest = orjson.loads(storage.read_bytes("step-000002", "manifest.json"))
    storage.write_bytes("step-000002/manifest.json", orjson.dumps({**manifest, "val": bad}))
    info = m.catalog.scan()[1]
    assert info.unreadable and not info.usable and info.problem == f"manifest.json is damaged: {reason}"
    assert steps(m.catalog.best(SCORE, "max")) == [1] and steps(m.catalog.candidates("best")) == [1]
    m.catalog.remove_uncommitted()
    (moved,) = storage.listdir("quarantine")
    assert moved.startswith("step-000002.") and [e["event"] for e in events][-1] == "snapshot_quarantined"


def test_saving_a_malformed_val_is_refused_before_anything_is_written(storage):
    m = SnapshotManager(storage)
    with pytest.raises(ValueError, match="cannot record this validation: its val step is '3'"):
        m.save(3, {"counter": Number(3)}, {}, good=True, meta={"val": {"step": "3", "metrics": {}}})
    assert m.catalog.scan() == []


def test_the_run_config_keep_best_reaches_retention(tmp_path):
    run = Storage(str(tmp_path / "run"))
    cfg = RunConfig.model_validate(
        {"trainer": {"val_every": 1}, "checkpoint": {"keep_last": 1, "keep_best": {"metric": LENGTH, "mode": "min"}}}
    )
    m = snapshot_manager(run, cfg)
    assert m.retention.best == KeepBest(LENGTH, "min", 1) and m.retention.keep_last == 1
    assert m.catalog.best_rule == BestRule(LENGTH, "min") == snapshot_catalog(run, cfg).best_rule
    assert snapshot_manager(run, RunConfig()).retention.best is None
    assert snapshot_catalog(run, RunConfig()).keep_best is None
    assert snapshot_catalog(run, RunConfig()).best_rule == BestRule(SCORE, "max")  # the default


class Notes:
    """A Reporter that keeps what it was told to say."""

    def __init__(self):
        self.lines = []

    def ready(self, step, total): ...

    def step(self, row): ...

    def note(self, text):
        self.lines.append(text)


def test_resume_from_best_chooses_the_first_usable_of_the_best_alone(tmp_path):
    from rlctl.run import plan_resume
    from rlctl.rundir.selection import ResumePlan, select

    run, notes = Storage(str(tmp_path / "run")), Notes()
    cfg = RunConfig.model_validate(
        {"trainer": {"val_every": 1}, "checkpoint": {"keep_last": 1, "keep_best": {"k": 3}}}
    )  # (keep_last evicts)
    m = snapshot_manager(run, cfg)
    save(m, 1, 0.3)
    save(m, 2, 0.9)
    save(m, 3, 0.5)
    save(m, 4, 0.99, good=False)
    save(m, 5)
    assert steps(m.catalog.scan()) == [1, 2, 3, 5]  # the three best and the newest; keep_last 1 evicted 4
    run.write_bytes("checkpoints/step-000002/state.pt", b"")
    restore = plan_resume(run, cfg, m.catalog, "best", {}, notes, events=None)  # (events: for a start-over)
    # never 1 after it; a world of one trains (and records) the default stage 2 at stage 0
    assert restore == ResumePlan("best", ("step-000003",), 3, {}, {"zero_stage": 0})
    (skipped,) = notes.lines
    assert skipped.startswith("warning: skipping snapshot step-000002: file state.pt has 0 bytes; the manifest says")
    for name in ("step-000001", "step-000003"):
        run.write_bytes(f"checkpoints/{name}/state.pt", b"")
    with pytest.raises(SnapshotError, match=r"records val/score/mean is usable \(the best, step-000002: file state"):
        select(m.catalog, "best", "--from")
    m.catalog.keep_best = BestRule(LENGTH, "min")
    with pytest.raises(SnapshotError, match=f"records the validation metric {LENGTH}"):
        select(m.catalog, "best", "--from")


# -- the command line ----------------------------------------------------------------------------------
def make_run(tmp_path, keep_best=None, scores=(0.25, None, 0.5)):
    """A run directory with its config and one snapshot per score (None: one without a validation)."""
    run = Storage(str(tmp_path / "run"))
    cfg = RunConfig.model_validate({"trainer": {"val_every": 1}, "checkpoint": {"keep_best": keep_best}})
    run.write_bytes("config.yaml", cfg.to_yaml().encode())
    m = snapshot_manager(run, cfg)
    for step, score in enumerate(scores, start=1):
        save(m, step, score, val_step=step - 1 if score is None else step)
    m.close()
    return run.url


def invoke(*args):
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_checkpoints_shows_the_validation_metric(tmp_path):
    url = make_run(tmp_path)
    table = invoke("checkpoints", url).splitlines()
    assert table[0].split() == ["step", "time", "size", "committed", "good", SCORE, "problem"]
    assert [line.split()[-1] for line in table[1:]] == ["0.25", "-", "0.5"]  # (no problem: the last cell)
    rows = json.loads(invoke("checkpoints", url, "--format", "json"))
    assert [(r[SCORE], r["val_step"]) for r in rows] == [(0.25, 1), (None, None), (0.5, 3)]
    assert list(rows[0])[:8] == ["step", "name", "time", "bytes", "committed", "good", "usable", "problem"]
    lines = invoke("checkpoints", url, "--format", "jsonl").splitlines()
    assert json.loads(lines[2])[SCORE] == 0.5
    (header, *body) = list(csv.reader(io.StringIO(invoke("checkpoints", url, "--format", "csv"))))
    assert header == ["step", "name", "time", "bytes", "committed", "good", "usable", "problem", SCORE, "val_step"]
    assert [(r[8], r[9]) for r in body] == [("0.25", "1"), ("", ""), ("0.5", "3")]


def test_checkpoints_names_keep_bests_metric_and_shows_none_when_nothing_asks(tmp_path):
    url = make_run(tmp_path / "a", keep_best={"metric": LENGTH, "mode": "min", "k": 1})
    assert invoke("checkpoints", url).splitlines()[0].split()[5] == LENGTH  # configured: shown, all "-"
    assert [r[LENGTH] for r in json.loads(invoke("checkpoints", url, "--format", "json"))] == [None] * 3
    url = make_run(tmp_path / "b", scores=(None, None))
    assert invoke("checkpoints", url).splitlines()[0].split() == [
        "step",
        "time",
        "size",
        "committed",
        "good",
        "problem",
    ]
    assert "val_step" not in json.loads(invoke("checkpoints", url, "--format", "json"))[0]


def test_listing_snapshots_builds_no_writing_manager(tmp_path, monkeypatch):
    url = make_run(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a read-only command built the snapshot manager")

    monkeypatch.setattr(SnapshotManager, "__init__", refuse)
    assert [r["step"] for r in json.loads(invoke("checkpoints", url, "--verify", "--format", "json"))] == [1, 2, 3]


@pytest.mark.parametrize("command", [["resume", "RUN", "--from", "bogus"], ["export", "RUN", "OUT", "--step", "bogus"]])
def test_a_bogus_snapshot_spec_is_a_usage_error_that_lists_best(tmp_path, command):
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 2
    assert "expected latest, last-good, best, step-N or N; got 'bogus'" in result.output
    help_text = CliRunner().invoke(cli, [command[0], "--help"]).output
    assert "latest, last-good, best, step-N or N" in help_text and "val/score/mean" in help_text
