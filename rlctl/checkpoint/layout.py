"""Every name of a snapshot, defined once: what the manager writes, the writer lists and the catalog reads.

Under the checkpoint directory (RUN_DIR/checkpoints unless ``checkpoint.dir`` says otherwise)::

    step-000500/
      <name>/...          each directory-Stateful in its own format (the engines: weights, optimizer ...)
      state.pt            rank 0's other Statefuls' state_dicts (trainer, data cursor, RNG, KL controller ...)
      state.rank-N.pt     rank N's (several ranks)
      ranks/rank-N.json   rank N's list of its files, with size and sha256 (several ranks)
      <extra files>       the resolved config, the model's HF config and tokenizer
      manifest.json       written last, created exclusively: the only proof the snapshot exists
    abandoned/<tag>/step-000700/   snapshots of a branch a resume turned away from (never deleted)
    quarantine/step-000600.<time>/  a snapshot whose manifest could not be read (never deleted)

A snapshot staged off the storage (object storage) is staged in a temporary directory named
``rlctl-step-000500-...``. Every file of a step directory is read by every rank, except the per-rank
files above (each read by its own rank alone) and those a directory-Stateful says belong to one rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
QUARANTINE = "quarantine"
ABANDONED = "abandoned"

_STEP = "step-{step}"
_RANK_STATE = "state.rank-{rank}.pt"
_RANK_LIST = "ranks/rank-{rank}.json"


def _pattern(*templates: str) -> re.Pattern[str]:
    """A regex matching any of ``templates``, each field (``{step}``, ``{rank}``) a run of digits."""
    fields = (re.escape("{step}"), re.escape("{rank}"))
    alternatives = []
    for template in templates:
        pattern = re.escape(template)
        for f in fields:
            pattern = pattern.replace(f, r"(\d+)")
        alternatives.append(pattern)
    return re.compile(f"^(?:{'|'.join(alternatives)})$")


_STEP_DIR = _pattern(_STEP)
_RANK_FILE = _pattern(_RANK_STATE, _RANK_LIST)

FileRank = Callable[[str], "int | None"]


def step_name(step: int) -> str:
    """The directory of the snapshot of ``step``: ``step-000500``."""
    return _STEP.format(step=f"{step:06d}")


def step_of(name: str) -> int | None:
    """The step whose snapshot directory ``name`` is, or None when it is no step directory."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def state_file(rank: int) -> str:
    """The file of rank ``rank``'s Statefuls' state_dicts."""
    return STATE_FILE if rank == 0 else _RANK_STATE.format(rank=rank)


def rank_list(rank: int) -> str:
    """Rank ``rank``'s list of its files (a rank other than 0: rank 0 commits what they list)."""
    return _RANK_LIST.format(rank=rank)


def quarantine_name(name: str, stamp: str, n: int = 0) -> str:
    """Where the unreadable snapshot ``name`` is moved at time ``stamp`` (``n``: the n-th of that time)."""
    return f"{QUARANTINE}/{name}.{stamp}" + (f"-{n}" if n else "")


def abandoned_name(tag: str, name: str) -> str:
    """Where the snapshot ``name`` goes when the turn tagged ``tag`` turns away from it."""
    return f"{ABANDONED}/{tag}/{name}"


def stage_prefix(name: str) -> str:
    """The prefix of the temporary directory the snapshot ``name`` is staged in, off the storage."""
    return f"rlctl-{name}-"


def is_rank_file(rel: str) -> bool:
    """Whether ``rel`` is one of the per-rank files named here (a rank's state file or list)."""
    return rel == STATE_FILE or _RANK_FILE.match(rel) is not None


def files_of_rank(files: Iterable[str], rank: int, file_rank: FileRank | None = None) -> list[str]:
    """The files of a snapshot that rank ``rank`` reads to restore: everything except the other ranks'
    own files. The per-rank files named here (``state.pt`` is rank 0's) are told apart here; any other
    file is owned by the rank ``file_rank(path)`` names, or shared when it names none. In a world of
    one, every file."""
    out = []
    for rel in files:
        if rel == STATE_FILE:
            owner = 0
        elif m := _RANK_FILE.match(rel):
            owner = int(next(g for g in m.groups() if g is not None))
        else:
            owner = file_rank(rel) if file_rank is not None else None
        if owner is None or owner == rank:
            out.append(rel)
    return out
