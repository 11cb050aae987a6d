"""Restoring a snapshot: every file this rank reads checked against the manifest's sha256, the ranks
agreeing that the snapshot is usable before any loads, then every Stateful and directory loaded (a
snapshot of another world size too, ``rlctl.checkpoint.elastic``)."""

from __future__ import annotations

import os

from rlctl.checkpoint.catalog import SnapshotInfo
from rlctl.checkpoint.collectives import Collectives
from rlctl.checkpoint.elastic import files_to_restore, load_dir, source_rank
from rlctl.checkpoint.layout import state_file
from rlctl.checkpoint.manifest import checksum_problem
from rlctl.checkpoint.staging import DirStateful, dir_file_rank
from rlctl.errors import SnapshotError
from rlctl.stateful import Stateful
from rlctl.storage import Storage


def restore_snapshot(
    storage: Storage,
    collectives: Collectives,
    rank: int,
    world_size: int,
    info: SnapshotInfo,
    states: dict[str, Stateful],
    dirs: dict[str, DirStateful],
) -> None:
    """Verify the checksum of every file this rank reads, then load every Stateful. Raises
    SnapshotError when the snapshot is not usable; nothing is loaded then. With several ranks, each
    rank fetches (from object storage) and checks only the shared files and its own, so together
    they check every file once plus the shared ones N times, and they agree before any loads: a
    snapshot one rank finds broken is skipped by all of them. A snapshot of another world size (with
    ``elastic``): every engine file, and one state file (``rlctl.checkpoint.elastic``)."""
    import torch

    problem, local, cleanup = info.problem, None, (lambda: None)
    try:
        saved_world = (info.manifest or {}).get("world_size", world_size)
        if problem is None:
            files = (info.manifest or {}).get("files", {})
            mine = files_to_restore(files, rank, saved_world, world_size, dir_file_rank(dirs))
            local, cleanup = storage.local_copy(info.name, files=mine)
            problem = info.problem = checksum_problem(local, info.manifest or {}, only=mine)
        if not collectives.all(problem is None):
            raise SnapshotError(
                f"snapshot {info.name} is not usable: {problem or 'another rank found it broken (see its error)'}"
            )
        own = state_file(source_rank(rank, saved_world))
        saved = torch.load(os.path.join(local, own), weights_only=False, map_location="cpu")
        missing = sorted(set(states) - set(saved))
        if missing:
            raise SnapshotError(f"snapshot {info.name} holds no state for {', '.join(missing)}")
        for key, obj in dirs.items():
            load_dir(obj, os.path.join(local, key), saved_world, world_size)
        for key, obj in states.items():
            obj.load_state_dict(saved[key])
    finally:
        cleanup()
