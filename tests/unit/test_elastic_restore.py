"""Restoring a snapshot of 2 ranks into 1 and 3 (an elastic resume), on the checkpoint floor alone: which
files each rank fetches, whose state file it takes, and that a directory-Stateful loads the other world's
files through its ``load_resharded`` (the engines: ``tests/e2e/test_elastic_resume.py``)."""

import os
import threading
import uuid

import pytest
import torch

from rlctl.checkpoint.collectives import Local
from rlctl.checkpoint.elastic import files_to_restore, source_rank
from rlctl.checkpoint.snapshots import SnapshotManager
from rlctl.errors import SnapshotError
from rlctl.storage import Storage

from helpers import Number

FILES = [
    "actor/mp_rank_00_model_states.pt",
    "actor/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "actor/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "config.yaml",
    "ranks/rank-1.json",
    "state.pt",
    "state.rank-1.pt",
]


def zero_rank(rel):
    name = rel.rsplit("/", 1)[-1]
    return int(name.split("_")[3]) if name.startswith("zero_pp_rank_") else None


def test_another_world_reads_every_engine_file_and_one_state_file():
    engine = [f for f in FILES if f.startswith("actor/")]
    # the same world: the shared files and the rank's own
    assert files_to_restore(FILES, 1, 2, 2, zero_rank) == [
        "actor/mp_rank_00_model_states.pt",
        "actor/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "config.yaml",
        "ranks/rank-1.json",
        "state.rank-1.pt",
    ]
    # another: every engine file; rank 0's state (the old world's rank 0), rank 1's own, a new rank 2 rank 0's
    assert files_to_restore(FILES, 0, 2, 1, zero_rank) == [*engine, "config.yaml", "state.pt"]
    assert files_to_restore(FILES, 1, 2, 3, zero_rank) == [*engine, "config.yaml", "state.rank-1.pt"]
    assert files_to_restore(FILES, 2, 2, 3, zero_rank) == [*engine, "config.yaml", "state.pt"]
    assert [source_rank(r, 2) for r in range(4)] == [0, 1, 0, 0]


class Shards:
    """A directory-Stateful partitioned like a ZeRO engine: each rank has its own shard file written by the
    snapshot writer; it loads the shards of another world only through ``load_resharded`` (every shard)."""

    def __init__(self, rank=0, world=1):
        self.rank, self.world, self.loaded = rank, world, None

    def save_to_dir(self, path, defer=None):
        defer(os.path.join(path, f"zero_pp_rank_{self.rank}_shard.pt"), {"shard": self.rank})  # (as DeepSpeed's are)

    def file_rank(self, rel):
        return zero_rank(rel)

    def load_from_dir(self, path):
        self.loaded = ("same world", [shard(path, self.rank)])

    def load_resharded(self, path, saved_world):
        self.loaded = ("resharded", [shard(path, r) for r in range(saved_world)])


def shard(path, rank):
    return torch.load(os.path.join(path, f"zero_pp_rank_{rank}_shard.pt"), weights_only=True)["shard"]


class Plain:
    """A directory-Stateful with no ``load_resharded``."""

    def load_from_dir(self, path):
        raise AssertionError("never loaded from another world")


def two_rank_snapshot(storage):
    meet = threading.Barrier(2)
    managers = [
        SnapshotManager(storage, world_size=2, rank=r, collectives=Local(meet.wait), writer="thread") for r in (0, 1)
    ]

    def save(r):
        managers[r].save(1, {"counter": Number(10 + r)}, {"engine": Shards(r, 2)}, good=True)
        managers[r].wait()

    threads = [threading.Thread(target=save, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.parametrize("url", ["local", "memory"])
def test_a_two_rank_snapshot_restores_on_one_and_three_ranks(tmp_path, url):
    storage = Storage(str(tmp_path / "ckpt") if url == "local" else f"memory://test-{uuid.uuid4().hex}/ckpt")
    two_rank_snapshot(storage)
    assert SnapshotManager(storage, world_size=3).catalog.scan()[0].problem == "written by 2 rank(s); this run has 3"

    for world in (1, 3):
        for rank in range(world):  # (no collective is needed to restore a snapshot every rank finds whole)
            m = SnapshotManager(storage, world_size=world, rank=rank, elastic=True)
            (info,) = m.catalog.scan()
            assert info.usable
            counter, engine = Number(), Shards(rank, world)
            m.restore(info, {"counter": counter}, {"engine": engine})
            assert engine.loaded == ("resharded", [0, 1])
            assert counter.value == (11 if rank == 1 else 10)  # its own state, or rank 0's
        with pytest.raises(SnapshotError, match="Plain cannot load a snapshot of 2 rank"):
            m.restore(info, {"counter": Number()}, {"engine": Plain()})

    m = SnapshotManager(storage, world_size=2, rank=1, elastic=True)  # the same world: as before
    engine = Shards(1, 2)
    m.restore(m.catalog.scan()[0], {"counter": Number()}, {"engine": engine})
    assert engine.loaded == ("same world", [1])
