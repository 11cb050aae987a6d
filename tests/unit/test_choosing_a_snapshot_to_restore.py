"""Choosing snapshots (``rlctl.rundir.selection``): one selection for resume's --from, export's --step and a
rollback, the resume plan that travels to every rank, and the one turn (``Recovery.turn_to``) that tries
the candidates in order and turns the run away from the steps after the one restored; on real local
storage with small Statefuls."""

import contextlib
import pickle
from types import SimpleNamespace

import orjson
import pytest

from rlctl.checkpoint.catalog import parse_step_spec
from rlctl.checkpoint.snapshots import SnapshotManager
from rlctl.config import RunConfig
from rlctl.engine.recovery import Recovery
from rlctl.errors import SnapshotError
from rlctl.metrics import encode_row, read_rows
from rlctl.rundir.handle import RunDir
from rlctl.rundir.selection import ResumePlan, rollback_candidates, select
from rlctl.storage import Storage

from helpers import Number

SCORE = "val/score/mean"


def save(manager, step, score=None, good=True):
    meta = {"val": {"step": step, "metrics": {SCORE: score}}} if score is not None else None
    manager.save(step, {"counter": Number(step)}, {}, good=good, meta=meta)
    assert manager.wait() is True


def break_(storage, step):
    storage.write_bytes(f"step-{step:06d}/state.pt", b"")  # the wrong size: not usable


@pytest.fixture
def manager(tmp_path):
    m = SnapshotManager(Storage(str(tmp_path / "run" / "checkpoints")))
    yield m
    m.close()


def test_a_bad_spec_names_the_option_typed():
    assert parse_step_spec("step-7", "--step") == parse_step_spec("7") == 7
    with pytest.raises(SnapshotError, match=r"^--step expects latest, last-good, best, step-N or N; got 'x'$"):
        parse_step_spec("x", "--step")
    with pytest.raises(SnapshotError, match=r"^--from expects"):
        parse_step_spec("x", "--from")


def test_select_latest_keeps_every_candidate_and_says_what_it_skips(manager):
    for step in (1, 2, 3):
        save(manager, step, good=step != 2)
    break_(manager.storage, 3)
    chosen = select(manager.catalog, "latest", "--from")
    assert [c.step for c in chosen.candidates] == [3, 2, 1] and [c.step for c in chosen.usable] == [2, 1]
    assert chosen.first().step == 2
    notes = []
    chosen.skip(notes.append, before=chosen.first())
    assert len(notes) == 1 and notes[0].startswith("warning: skipping snapshot step-000003: file state.pt has 0 bytes")
    good = select(manager.catalog, "last-good", "--step")
    assert [c.step for c in good.candidates] == [3, 1] and good.first().step == 1


def test_select_refuses_what_cannot_be_used_with_the_sentences_of_resume(manager):
    with pytest.raises(SnapshotError, match=r"^no good snapshot in "):
        select(manager.catalog, "last-good", "--from")
    save(manager, 1, good=False)
    save(manager, 2)
    break_(manager.storage, 2)
    with pytest.raises(SnapshotError, match=r"^snapshot step-000002 is not usable: file state.pt has 0 bytes"):
        select(manager.catalog, "step-2", "--step")
    with pytest.raises(SnapshotError, match=r"no snapshot of step 5 .*\(usable steps: 1\)"):
        select(manager.catalog, "5", "--from")
    chosen = select(manager.catalog, "last-good", "--step")  # step 2 is the only good one: broken
    with pytest.raises(SnapshotError, match=r"^no usable snapshot for --step last-good in .* \(step-000002: file"):
        chosen.first()


def test_best_is_the_first_usable_of_the_best_alone(manager):
    for step, score in ((1, 0.3), (2, 0.9), (3, 0.5)):
        save(manager, step, score)
    break_(manager.storage, 2)
    chosen = select(manager.catalog, "best", "--from")
    assert [c.step for c in chosen.candidates] == [2, 3]  # never 1 after it
    break_(manager.storage, 3)
    break_(manager.storage, 1)
    with pytest.raises(SnapshotError, match=r"records val/score/mean is usable \(the best, step-000002: file"):
        select(manager.catalog, "best", "--from")


def test_a_rollback_tries_the_best_then_the_newest_good_old_enough(manager):
    for step, score, good in ((1, 0.9, True), (2, None, True), (3, 0.5, True), (4, None, False), (5, None, True)):
        save(manager, step, score, good)
    assert [i.step for i in rollback_candidates(manager.catalog, 5, 2, None)] == [3, 2, 1]
    assert [i.step for i in rollback_candidates(manager.catalog, 5, 0, (SCORE, "max"))] == [1, 3, 5, 2]
    assert [i.step for i in rollback_candidates(manager.catalog, 5, 0, (SCORE, "min"))] == [3, 1, 5, 2]


def test_the_plan_travels_as_data_and_pickled_and_finds_its_snapshots(manager):
    for step in (2, 4):
        save(manager, step)
    plan = ResumePlan.of(select(manager.catalog, "latest", "--from"), {"actor.lr": {"from": 1e-6, "to": 2e-6}})
    assert plan == ResumePlan("latest", ("step-000004", "step-000002"), 4, {"actor.lr": {"from": 1e-6, "to": 2e-6}})
    assert ResumePlan.from_data(orjson.loads(orjson.dumps(plan.as_data()))) == plan
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert [i.step for i in plan.snapshots(manager.catalog)] == [4, 2]
    manager.abandon_after(0, "gone")
    with pytest.raises(SnapshotError, match=r"the snapshots to resume from \(step-000004, step-000002\) are no longer"):
        plan.snapshots(manager.catalog)
    assert ResumePlan("latest").snapshots(manager.catalog) == []  # none planned: the run starts over


def test_two_turns_of_one_second_keep_both_branches_apart(manager):
    """A turn's tag is its time to the second: two resumes that turn away from step 4's snapshot within one
    second (a fast resume of a tiny run does) kept it under the same folder, and the second move failed
    ("directory not empty", exit 12). The second goes beside the first, and nothing is lost."""
    save(manager, 2)
    for _ in range(3):
        save(manager, 4)
        assert manager.abandon_after(2, "2026-11-29T073646Z") == [4]
    assert sorted(manager.storage.listdir("abandoned")) == [
        "2026-11-29T073646Z",
        "2026-11-29T073646Z-2",
        "2026-11-29T073646Z-3",
    ]
    for tag in manager.storage.listdir("abandoned"):
        assert manager.storage.exists(f"abandoned/{tag}/step-000004/manifest.json")


# -- the one turn ------------------------------------------------------------------------------------------
class Host:
    """The trainer as recovery sees it: one rank, a restore that fails for the steps in ``broken``."""

    def __init__(self, tmp_path, manager, broken=()):
        self.cfg, self.run, self.snapshots = RunConfig(), RunDir(Storage(str(tmp_path / "run"))), manager
        self.dist = SimpleNamespace(is_main=True, world=1, barrier=lambda: None)
        self.state, self.kl_ctrl, self.guard = SimpleNamespace(step=9), SimpleNamespace(value=0.5), None
        self.broken, self.restored, self.events, self.knobs_applied = set(broken), [], [], 0

    def emit(self, event):
        self.events.append(event)

    def restore(self, info, rollback=False, keep_knobs=()):
        if info.step in self.broken:
            raise SnapshotError(f"snapshot {info.name} is not usable: broken")
        self.restored.append((info.step, rollback, set(keep_knobs)))
        self.state.step = info.step

    def apply_knobs(self):
        self.knobs_applied += 1

    def metrics_closed(self):
        return contextlib.nullcontext()


def trained(tmp_path, manager, steps=9):
    run = Storage(str(tmp_path / "run"))
    run.write_bytes(
        "metrics.jsonl", b"".join(orjson.dumps(encode_row({"step": s})) + b"\n" for s in range(1, steps + 1))
    )
    for step in (3, 6, 9):
        save(manager, step)
    return run


def test_turn_to_tries_each_candidate_then_turns_away_from_later_steps(tmp_path, manager):
    run = trained(tmp_path, manager)
    host, unusable = Host(tmp_path, manager, broken={9}), []
    candidates = manager.catalog.scan()[::-1]
    info, tag, moved = Recovery(host).turn_to(
        candidates,
        lambda step: {"event": "rollback", "to_step": step, "time": "T"},
        lambda i, e: unusable.append(i.step),
    )
    assert info.step == 6 and host.restored == [(6, False, set())] and unusable == [9]
    assert tag == {"event": "rollback", "to_step": 6, "time": "T"}
    assert moved == {"abandoned_metric_rows": 3, "abandoned_snapshots": [9]}
    assert [r["step"] for r in read_rows(run, "metrics.jsonl")] == list(range(1, 7))
    assert [i.step for i in manager.catalog.scan()] == [3, 6]
    host.broken = {3, 6}
    assert Recovery(host).turn_to(manager.catalog.scan()[::-1], dict, lambda i, e: None) == (None, {}, {})
    assert [i.step for i in manager.catalog.scan()] == [3, 6]  # none loaded: nothing turned


def test_a_resume_falls_back_records_its_config_and_its_event(tmp_path, manager):
    run = trained(tmp_path, manager)
    host, notes = Host(tmp_path, manager, broken={9}), []
    changes = {"algorithm.kl_coef": {"from": 0.001, "to": 0.01}}
    host.cfg.algorithm.kl_coef = 0.01
    Recovery(host).resume(ResumePlan("latest", ("step-000009", "step-000006"), 9, changes), notes.append)
    assert notes == ["warning: snapshot step-000009 is not usable: broken; trying an older snapshot"]
    assert host.restored == [(6, False, {"algorithm.kl_coef"})]
    assert host.kl_ctrl.value == 0.01 and host.knobs_applied == 1  # the user's coefficient, even if adaptive
    assert "kl_coef: 0.01\n" in run.read_bytes("config.yaml").decode()  # the config records the run's knobs
    (event,) = host.events
    assert event["event"] == "resume" and event["from"] == "latest" and event["step"] == 6
    assert event["snapshot"] == "step-000006" and event["location"] == manager.storage.url_of("step-000006")
    assert event["replays_exactly"] is False and event["changes"] == changes
    assert event["abandoned_metric_rows"] == 3 and event["abandoned_snapshots"] == [9]


def test_a_resume_of_one_snapshot_never_falls_back_and_one_of_none_starts_over(tmp_path, manager):
    run = trained(tmp_path, manager)
    host = Host(tmp_path, manager, broken={6})
    with pytest.raises(SnapshotError, match="snapshot step-000006 is not usable: broken"):
        Recovery(host).resume(ResumePlan(6, ("step-000006",), 6), lambda note: None)
    assert host.events == [] and len(manager.catalog.scan()) == 3
    host.broken = {6, 9}
    with pytest.raises(SnapshotError, match="every candidate failed its checks"):
        Recovery(host).resume(ResumePlan("latest", ("step-000009", "step-000006"), 9), lambda note: None)
    Recovery(host).resume(ResumePlan("latest"), lambda note: None)
    (event,) = host.events
    assert event["step"] == 0 and event["snapshot"] is None and event["replays_exactly"] is True
    assert event["abandoned_metric_rows"] == 9 and event["abandoned_snapshots"] == [3, 6, 9]
    assert host.restored == [] and host.knobs_applied == 0 and list(read_rows(run, "metrics.jsonl")) == []
