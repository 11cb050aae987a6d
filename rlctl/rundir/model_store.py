"""RUN_DIR/model: the built-in model a run builds once and every later process of the run reuses.

It exists whole or not at all. A local run writes it into a temporary sibling and renames it into place
(one atomic step); an object store has no rename, so the directory is uploaded first and its completion
marker (``MODEL_COMPLETE``) last, and a process finds the model complete only by that marker. A
directory without the marker (written by an rlctl that wrote none, or cut off) is adopted when every
file of it loads, and otherwise moved aside (never deleted) and built again. What the model is, how it
is built and what "loads" means are the engine's (``RunDir.model_dir``'s callables)."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from rlctl.rundir.layout import MODEL, MODEL_COMPLETE, MODEL_TEMPORARY, set_aside
from rlctl.storage import Storage, fsync_path

Build = Callable[[Path], None]  # writes the whole model into an empty local directory
Problem = Callable[[Path], str | None]  # why a local model directory does not load, or None


def model_dir(run: Storage, build: Build, problem: Problem) -> Path:
    """A local directory holding the run's built-in model: RUN_DIR/model itself on a local run, else a
    temporary directory it was fetched into (or built in, then uploaded), removed at this process's exit."""
    if run.is_local:
        return _local(run, Path(run.path(MODEL)), build, problem)
    out = Path(tempfile.mkdtemp(prefix="rlctl-model-"))
    atexit.register(shutil.rmtree, out, True)
    return _remote(run, out, build, problem)


def _local(run: Storage, out: Path, build: Build, problem: Problem) -> Path:
    """RUN_DIR/model, written whole into a temporary sibling and renamed into place. Temporaries of a
    writer that was killed are removed."""
    if (out / MODEL_COMPLETE).exists():
        return out
    for stale in out.parent.glob(f"{MODEL_TEMPORARY}*"):
        shutil.rmtree(stale, ignore_errors=True)
    if out.exists():
        if _adopted(run, out, problem):
            return out
        _quarantine(run, out.name)
    tmp = out.parent / f"{MODEL_TEMPORARY}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)  # with the umask's permissions, as the directory it becomes
    try:
        build(tmp)
        _write_durably(tmp / MODEL_COMPLETE, b"")
        for f in tmp.iterdir():
            fsync_path(f)
        os.rename(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _remote(run: Storage, out: Path, build: Build, problem: Problem) -> Path:
    """The model in ``out``, fetched from RUN_DIR/model when its completion marker (written last) is
    there, else built and uploaded, the marker last."""
    if run.exists(MODEL, MODEL_COMPLETE):
        run.get_dir(str(out), MODEL)
        return out
    if run.listdir(MODEL):
        run.get_dir(str(out), MODEL)
        if _adopted(run, out, problem):
            return out
        _quarantine(run, MODEL)
        shutil.rmtree(out)
        out.mkdir()
    build(out)
    run.put_dir(str(out), MODEL)
    run.write_bytes(f"{MODEL}/{MODEL_COMPLETE}", b"")
    return out


def _adopted(run: Storage, local: Path, problem: Problem) -> bool:
    """A model directory without the completion marker: when every file of it loads, it is whole and gets
    its marker; else False (said)."""
    why = problem(local)
    if why is not None:
        print(f"warning: {run.url_of(MODEL)} is incomplete ({why}); building the model again", file=sys.stderr)
        return False
    if run.is_local:
        _write_durably(local / MODEL_COMPLETE, b"")
    else:
        run.write_bytes(f"{MODEL}/{MODEL_COMPLETE}", b"")
    return True


def _quarantine(run: Storage, name: str) -> None:
    """Move an unreadable RUN_DIR/<name> aside (nothing is deleted) and say where."""
    aside = set_aside(name)
    run.move_dir(name, aside)
    print(f"warning: moved it aside to {run.url_of(aside)}", file=sys.stderr)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
