"""Retention's rules, each alone and together, on the catalog's infos (no storage): which steps each
keeps, and which usable snapshots a retention purges."""

import pytest

from rlctl.checkpoint.catalog import SnapshotInfo
from rlctl.checkpoint.layout import step_name
from rlctl.checkpoint.manifest import FORMAT
from rlctl.checkpoint.retention import (
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepNewest,
    Protect,
    Retention,
    RollbackReach,
    kept,
)

SCORE = "val/score/mean"


def info(step, good=True, score=None, val_step=None, problem=None, committed=True):
    """A snapshot's info as the catalog reads it: committed (or not), good or not, usable unless it
    has a ``problem``, recording ``score`` for a validation of ``val_step`` (default: its own step)."""
    manifest = {"format": FORMAT, "step": step, "good": good}
    if score is not None:
        manifest["val"] = {"step": step if val_step is None else val_step, "metrics": {SCORE: score}}
    return SnapshotInfo(step, step_name(step), manifest if committed else None, problem)


BROKEN = "file state.pt is missing"


def test_keep_last_keeps_the_newest_usable_ones():
    infos = [info(1), info(2), info(3, problem=BROKEN), info(4), info(5, committed=False, problem="no manifest")]
    assert KeepLast(2).keep(infos) == {2, 4}
    assert KeepLast(1).keep(infos) == {4}
    assert KeepLast(9).keep(infos) == {1, 2, 4}
    assert KeepLast(1).keep([]) == set()


def test_keep_newest_keeps_the_newest_and_the_newest_good():
    assert KeepNewest().keep([info(1), info(2), info(3, good=False), info(4, good=False)]) == {2, 4}
    assert KeepNewest().keep([info(1), info(2, problem=BROKEN), info(3, good=False, problem=BROKEN)]) == {1}
    assert KeepNewest().keep([info(1, good=False)]) == {1}
    assert KeepNewest().keep([]) == set()


def test_keep_every_keeps_the_usable_multiples():
    infos = [info(5), info(10), info(15), info(20, problem=BROKEN), info(30, good=False)]
    assert KeepEvery(10).keep(infos) == {10, 30}
    assert KeepEvery(0).keep(infos) == set()


def test_keep_best_keeps_the_k_best_usable_good_validated_ones():
    infos = [
        info(1, score=0.9, val_step=0),  # carried from an earlier validation: never ranks
        info(2, score=0.5),
        info(3, score=0.8),
        info(4, score=0.95, good=False),  # bad: never among the best
        info(5, score=0.99, problem=BROKEN),  # damaged: never purged, but not kept as a best either
        info(6, score=0.8),  # a tie goes to the earlier step
        info(7),
    ]
    assert KeepBest(SCORE, "max", 1).keep(infos) == {3}
    assert KeepBest(SCORE, "max", 2).keep(infos) == {3, 6}
    assert KeepBest(SCORE, "min", 1).keep(infos) == {2}
    assert KeepBest("val/other", "max", 3).keep(infos) == set()
    with pytest.raises(ValueError, match="k >= 1"):
        KeepBest(SCORE, "max", 0)


def test_protect_keeps_its_steps_whatever_they_are():
    assert Protect(frozenset({3, 99})).keep([info(3), info(4)]) == {3, 99}
    assert Protect().keep([info(3)]) == set()


def test_rollback_reach_keeps_the_newest_good_snapshot_a_rollback_that_far_needs():
    infos = [info(2), info(4), info(6, good=False), info(8), info(10)]
    assert RollbackReach(11, 3).keep(infos) == {8}
    assert RollbackReach(11, 5).keep(infos) == {4}  # 6 is not good
    assert RollbackReach(11, 10).keep(infos) == set()  # nothing that far back
    assert RollbackReach(11, 0).keep(infos) == set()  # no policy steps back
    assert RollbackReach(11, 3).keep([info(8, problem=BROKEN)]) == {8}  # good by its manifest: kept


def test_kept_is_the_union_of_the_rules():
    infos = [info(s) for s in (1, 2, 3, 4)]
    assert kept(infos, [KeepLast(1), Protect(frozenset({1}))]) == {1, 4}
    assert kept(infos, []) == set()


def test_retention_purges_the_usable_ones_no_rule_keeps():
    infos = [info(10), info(15), info(20), info(25), info(30, good=False), info(35, good=False)]
    infos.append(info(36, good=False))
    r = Retention(keep_last=2, keep_every=10)
    # keep_last: 35, 36; keep_every 10: 10, 20, 30; newest good: 25; 15 goes
    assert [i.step for i in r.purgeable(infos)] == [15]
    r.protected.add(10)
    r.keep_every = 0
    assert [i.step for i in r.purgeable([*infos, info(37, good=False)])] == [15, 20, 30, 35]


def test_retention_without_keep_last_purges_nothing_and_never_what_is_not_usable():
    infos = [info(1), info(2, problem=BROKEN), info(3, committed=False, problem="no manifest"), info(4), info(5)]
    assert Retention().purgeable(infos) == []
    assert [i.step for i in Retention(keep_last=1).purgeable(infos)] == [1, 4]


def test_retention_keeps_the_best_and_each_rollback_best():
    infos = [info(1, score=0.9), info(2, score=0.1), info(3, score=0.5), info(4, score=0.3), info(5)]
    r = Retention(keep_last=1, best=KeepBest(SCORE, "max", 1), rollback_best=(KeepBest(SCORE, "min", 1),))
    assert [i.step for i in r.purgeable(infos)] == [3, 4]
