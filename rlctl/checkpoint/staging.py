"""What a rank hands the snapshot writer: its directory-Statefuls' files (written at once, or deferred
to the writer) and its other Statefuls' state_dicts serialized, with rank 0's extra files."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any, Protocol

from rlctl.checkpoint.layout import FileRank, state_file
from rlctl.stateful import Stateful

Defer = Callable[[str, Any], None]


class DirStateful(Protocol):
    """State too big or too structured for a state_dict: saved into, and loaded from, a directory.

    ``save_to_dir`` may write files at once, or hand an object to ``defer(path, obj)``: the snapshot
    writer then serializes it into ``path`` with ``torch.save`` (in its own process, or in the manager's
    background thread). Whoever defers promises that the tensors ``obj`` holds do not change until
    ``SnapshotManager.wait_staged()`` returns (the actor waits there before its next optimizer step)."""

    def save_to_dir(self, path: str, defer: Defer | None = None) -> None: ...

    def load_from_dir(self, path: str) -> None: ...

    # Optional: the rank that alone reads a file of the directory (path relative to it), None when
    # every rank reads it. Without it, every rank fetches and checks every file of the directory.
    # def file_rank(self, rel: str) -> int | None: ...

    # Optional: load a directory written by ``saved_world`` ranks into a world of another size (an
    # elastic resume, ``rlctl.checkpoint.elastic``). Without it, such a snapshot does not load.
    # def load_resharded(self, path: str, saved_world: int) -> None: ...


def dir_file_rank(dirs: dict[str, DirStateful]) -> FileRank:
    """``file_rank`` over a snapshot's paths, asking the directory-Stateful each path lies under."""

    def file_rank(rel: str) -> int | None:
        key, _, inner = rel.partition("/")
        ask = getattr(dirs.get(key), "file_rank", None)
        return ask(inner) if ask is not None and inner else None

    return file_rank


def stage_files(
    stage: str,
    rank: int,
    states: dict[str, Stateful],
    dirs: dict[str, DirStateful],
    extra_files: dict[str, bytes] | None,
) -> tuple[list[tuple[str, Any]], dict[str, bytes]]:
    """Every directory-Stateful saved into ``stage`` (its files deferred), rank ``rank``'s states
    serialized and (rank 0) the extra files: the deferred (path, object) pairs and the blobs (by path
    relative to ``stage``), for the writer to write."""
    import torch

    deferred: list[tuple[str, Any]] = []
    for key, obj in dirs.items():
        obj.save_to_dir(os.path.join(stage, key), lambda path, state: deferred.append((path, state)))
    buf = io.BytesIO()
    torch.save({key: obj.state_dict() for key, obj in states.items()}, buf)
    blobs = {state_file(rank): buf.getvalue()}
    if rank == 0:
        blobs.update(extra_files or {})
    return deferred, blobs
