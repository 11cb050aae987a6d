"""Reading a snapshot's manifest and checking its files against it.

A manifest is read back from storage that anyone may have damaged, so every field read is checked
first: garbage, a truncated file or a field of the wrong shape raises ``UnreadableManifest`` with a
sentence saying what is wrong, never a KeyError. Checksums stream: a file is hashed as it is read,
from a local disk or straight from object storage (``Storage.sha256``), never copied whole.
"""

from __future__ import annotations

import hashlib
import os
import re
import reprlib
from typing import Any

import orjson

from rlctl.checkpoint.layout import MANIFEST
from rlctl.numbers import is_number
from rlctl.storage import Storage

FORMAT = 1
CHUNK = 8 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class UnreadableManifest(ValueError):
    """A manifest that exists but cannot be read as one: its message says why."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def file_problem(rel: Any, meta: Any) -> str | None:
    """What is wrong with one entry of a manifest's (or a rank's list's) ``files``, or None."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
        return f"it lists a file named {rel!r}"
    if not isinstance(meta, dict):
        return f"its entry for {rel} is not an object"
    if not _is_int(meta.get("size")) or meta["size"] < 0:
        return f"its size of {rel} is {meta.get('size')!r}, not a byte count"
    if not isinstance(meta.get("sha256"), str) or not _SHA256.match(meta["sha256"]):
        return f"its sha256 of {rel} is {meta.get('sha256')!r}, not a sha256"
    return None


def files_problem(files: Any) -> str | None:
    """What is wrong with a ``files`` mapping (path -> {"size", "sha256"}), or None."""
    if not isinstance(files, dict):
        return "its 'files' is not an object"
    return next((p for rel, meta in files.items() if (p := file_problem(rel, meta)) is not None), None)


def parse_manifest(raw: bytes) -> dict[str, Any]:
    """The manifest in ``raw``. Raises UnreadableManifest when it is not one; a manifest of another
    format is returned as it is (the caller says it is not usable, and leaves it alone)."""
    try:
        manifest = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UnreadableManifest(f"{MANIFEST} is not valid JSON (truncated or overwritten?)") from None
    if not isinstance(manifest, dict):
        raise UnreadableManifest(f"{MANIFEST} holds a JSON {type(manifest).__name__}, not an object")
    if not _is_int(manifest.get("format")):
        raise UnreadableManifest(f"{MANIFEST} has no format number (format: {manifest.get('format')!r})")
    if manifest["format"] != FORMAT:
        return manifest
    problem = shape_problem(manifest)
    if problem is not None:
        raise UnreadableManifest(f"{MANIFEST} is damaged: {problem}")
    return manifest


def shape_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a format-1 manifest, or None."""
    for key in ("step", "world_size", "total_bytes"):
        if not _is_int(manifest.get(key)):
            return f"its '{key}' is {manifest.get(key)!r}, not a whole number"
    if not isinstance(manifest.get("good"), bool):
        return f"its 'good' is {manifest.get('good')!r}, not true or false"
    if not isinstance(manifest.get("created", ""), str):
        return f"its 'created' is {manifest.get('created')!r}, not a time"
    if "val" in manifest and (problem := val_problem(manifest["val"])) is not None:
        return problem
    return files_problem(manifest.get("files"))


def val_problem(val: Any) -> str | None:
    """What is wrong with a manifest's ``val`` (the run's last validation when the snapshot was taken:
    ``{"step": <the step validated>, "metrics": {name: number}}``), or None. A metric may be null: a
    validation that gave NaN or an infinity, which JSON cannot hold, records no value."""
    if not isinstance(val, dict):
        return f"its 'val' is a {type(val).__name__}, not an object"
    if not _is_int(val.get("step")) or val["step"] < 0:
        return f"its val step is {reprlib.repr(val.get('step'))}, not a step number"
    metrics = val.get("metrics")
    if not isinstance(metrics, dict):
        return f"its val metrics are a {type(metrics).__name__}, not an object"
    for name, value in metrics.items():
        if value is not None and not is_number(value):
            return f"its val metric {name} is {reprlib.repr(value)}, not a number"
    return None


def parse_rank_list(raw: bytes, rank: int) -> dict[str, Any]:
    """A rank's list of its snapshot files (``{"rank", "files"}`` or ``{"rank", "error"}``); raises
    RuntimeError with a sentence when it is not one."""
    try:
        listed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise RuntimeError(f"rank {rank}'s list of its snapshot files is not valid JSON") from None
    if not isinstance(listed, dict):
        raise RuntimeError(f"rank {rank}'s list of its snapshot files is not an object")
    if "error" in listed:
        return listed
    if (problem := files_problem(listed.get("files"))) is not None:
        raise RuntimeError(f"rank {rank}'s list of its snapshot files is damaged: {problem}")
    return listed


# -- checksums ---------------------------------------------------------------------------------------
def sha256_file(path: str, chunk: int = CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def stored_checksum_problem(storage: Storage, name: str, manifest: dict[str, Any]) -> str | None:
    """The first file of snapshot ``name`` on ``storage`` unlike its sha256 in the manifest, said. Each
    file is hashed as it streams from storage (no local copy, on any backend)."""
    for rel, meta in manifest.get("files", {}).items():
        if storage.sha256(name, *rel.split("/")) != meta["sha256"]:
            return f"file {rel} does not match its sha256 (corrupt)"
    return None


def checksum_problem(local_dir: str, manifest: dict[str, Any], only: list[str] | None = None) -> str | None:
    """The first file (of ``only``, or of all) missing or unlike its sha256 in the manifest, said."""
    wanted = None if only is None else set(only)
    for rel, meta in manifest.get("files", {}).items():
        if wanted is not None and rel not in wanted:
            continue
        path = os.path.join(local_dir, *rel.split("/"))
        if not os.path.exists(path):
            return f"file {rel} is missing"
        if sha256_file(path) != meta["sha256"]:
            return f"file {rel} does not match its sha256 (corrupt)"
    return None
