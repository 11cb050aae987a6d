"""Restoring a snapshot written by another number of ranks (an elastic resume): which files a rank reads
and whose state it takes.

The directory-Statefuls (the engines) convert their files to the new world size as they load them (their
``load_resharded(path, saved_world)``), so every rank reads all of theirs, every old rank's partitions
included. Of the per-rank state files a rank
reads one: its own where the old world had its rank, else rank 0's. Every Stateful but the RNG holds the
same state on every rank (the trainer's counters, the data cursor, the KL controller, the policy state),
so those carry over exactly; a new rank's Python, NumPy and torch generators continue rank 0's streams
(every rank seeds them alike at start; rollouts draw no number from them: their seeds come from the
seed, step, prompt and sample). The files of ranks that no longer exist are not read.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlctl.checkpoint.layout import FileRank, files_of_rank, is_rank_file, state_file
from rlctl.errors import SnapshotError


def source_rank(rank: int, saved_world: int) -> int:
    """The rank whose state file rank ``rank`` restores from a snapshot of ``saved_world`` ranks."""
    return rank if rank < saved_world else 0


def files_to_restore(
    files: Iterable[str], rank: int, saved_world: int, world: int, file_rank: FileRank | None = None
) -> list[str]:
    """The files of a snapshot written by ``saved_world`` ranks that rank ``rank`` of ``world`` reads:
    ``files_of_rank``'s in the same world; in another, every file but the per-rank ones, and the state
    file of its ``source_rank``."""
    if saved_world == world:
        return files_of_rank(files, rank, file_rank)
    own = state_file(source_rank(rank, saved_world))
    return [rel for rel in files if rel == own or not is_rank_file(rel)]


def load_dir(obj, path: str, saved_world: int, world: int) -> None:
    """Load the directory-Stateful ``obj`` from ``path``, written by ``saved_world`` ranks: as it is in the
    same world; in another, by its ``load_resharded(path, saved_world)`` (a SnapshotError when it has none)."""
    if saved_world == world:
        obj.load_from_dir(path)
        return
    load = getattr(obj, "load_resharded", None)
    if load is None:
        raise SnapshotError(
            f"{type(obj).__name__} cannot load a snapshot of {saved_world} rank(s) into {world}: it has no load_resharded"
        )
    load(path, saved_world)
