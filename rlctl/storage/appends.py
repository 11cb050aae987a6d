"""An append to an object that sends the new bytes, not the object: O(1) per flush of a long run's logs.

``appender(fs, path, data)`` returns one append as a callable that ``Storage.append_bytes`` hands to its
retry loop; each call is one try, and a try after a failed one finds out what the failed one did (the
object's size against the size this append began from), so that an answer lost on the way back never
appends the bytes twice. One process appends to a file (the lease holder).

- GCS (gcsfs opens "ab" as "wb"): the new bytes go up as a temporary object beside the file
  (``.NAME.append-<hex>``), one compose request makes the file the file followed by them (2 of the 32
  sources a compose takes; GCS sets no limit on the components of a composite object), and the temporary
  is deleted. A reader sees the file before or after, never between. A process killed between the
  compose and the delete leaves its temporary (tiny, named as ours).
- Azure (adlfs appends only to an append blob): the file is kept an append blob, and the bytes go up as
  Append Block requests of at most 4 MiB, each at the position it expects (If-Append-Position-Equal).
  A file that is a block blob (written whole: by an older rlctl, or rewritten by a resume that set rows
  aside) is made an append blob again at its first append, as is one whose next blocks would pass the
  50,000 blocks an append blob may hold (a flush every 10 s reaches it after 5.8 days; made again, it holds
  one block per 4 MiB): both read and send the file once, and meanwhile a reader sees it shorter.
  An append of more than 4 MiB is seen a block at a time.
- S3 and the rest: the filesystem's own "ab". s3fs sends a file of 5 MiB or more as a multipart upload
  whose first part is copied server-side from the object (UploadPartCopy) and whose last is the new
  bytes; below 5 MiB (the least a part other than the last may hold) it reads and rewrites the object.
"""

from __future__ import annotations

import contextlib
import posixpath
import uuid
from collections.abc import Callable
from typing import Any

from rlctl.storage.clients import AZURE, GCS

AZURE_BLOCK = 4 << 20  # the most one Append Block request carries
AZURE_BLOCKS = 50_000  # the most blocks an append blob holds
AZURE_FILE = {"is_directory": "false"}  # the metadata adlfs gives every file it writes


def appender(fs: Any, path: str, data: bytes) -> Callable[[], None]:
    """One append of ``data`` to ``path`` on ``fs`` (an object store), as a callable to try and retry."""
    protocols = _protocols(fs)
    if protocols & GCS:
        return GcsAppend(fs, path, data)
    if protocols & AZURE:
        return AzureAppend(fs, path, data)
    return lambda: _open_append(fs, path, data)


def write_whole(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` over the object at ``path`` (not exclusively), whichever kind of blob it is. The Azure
    SDK sends more than 64 MiB as staged blocks, which Azure refuses onto an append blob (InvalidBlobType,
    raised by adlfs as FileExistsError): such a blob (a log that a resume rewrites) is deleted first, and a
    reader sees no file from then until the write commits. One request (64 MiB or less) replaces any blob."""
    try:
        fs.pipe_file(path, data)
    except FileExistsError:
        if not _protocols(fs) & AZURE:
            raise
        fs.rm_file(path)
        fs.pipe_file(path, data)


def _protocols(fs: Any) -> set[str]:
    return set(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else {fs.protocol}


def _open_append(fs: Any, path: str, data: bytes) -> None:
    with fs.open(path, "ab") as fh:
        fh.write(data)


class GcsAppend:
    """An append on GCS: the new bytes composed onto the object server-side."""

    def __init__(self, fs: Any, path: str, data: bytes):
        self.fs, self.path, self.data = fs, path, data
        head, name = posixpath.split(path)
        self.temporary = posixpath.join(head, f".{name}.append-{uuid.uuid4().hex}")
        self.start: int | None = None  # the file's size before this append (0: absent), once a try read it

    def __call__(self) -> None:
        size = self._size()
        if self.start is None:
            self.start = size or 0
        elif size == self.start + len(self.data):  # an earlier try's compose (or create) landed
            self._remove_temporary()
            return
        if size is None:  # (the bytes are the whole file: one upload)
            self.fs.pipe_file(self.path, self.data)
            return
        self.fs.pipe_file(self.temporary, self.data)
        self.fs.merge(self.path, [self.path, self.temporary])
        self.fs.invalidate_cache(self.path)
        self._remove_temporary()

    def _size(self) -> int | None:
        self.fs.invalidate_cache(self.path)
        try:
            return int(self.fs.info(self.path)["size"])
        except FileNotFoundError:
            return None

    def _remove_temporary(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.temporary)


class AzureAppend:
    """An append on Azure: Append Block requests onto an append blob."""

    def __init__(self, fs: Any, path: str, data: bytes):
        self.fs, self.path, self.data = fs, path, data
        self.container, self.blob, _ = fs.split_path(path)
        # what to send and from which offset of the blob: the new bytes after what the blob held, or
        # (a blob made again) what it held and the new bytes from 0; None until a try has looked
        self.plan: tuple[bytes, int] | None = None
        self.made = False  # whether this append's Put Blob of an empty append blob was answered

    def __call__(self) -> None:
        from fsspec.asyn import sync

        sync(self.fs.loop, self._append)
        self.fs.invalidate_cache(self.path)

    async def _append(self) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        timeouts = getattr(self.fs, "_timeout_kwargs", {})
        async with self.fs.service_client.get_blob_client(container=self.container, blob=self.blob) as bc:
            try:
                props = await bc.get_blob_properties(**timeouts)
            except ResourceNotFoundError:
                props = None
            if self.plan is None:
                self.plan = await self._first_plan(bc, props, timeouts)
            body, origin = self.plan
            size = props.size if props is not None and _is_append_blob(props) else None
            if size is not None and self.made and not origin <= size <= origin + len(body):
                # another writer changed the blob since this append looked: append to what it holds now
                self.plan, self.made = None, False
                await self._append()
                return
            if size is None or (origin == 0 and not self.made):
                await bc.create_append_blob(metadata=AZURE_FILE, **timeouts)  # (Put Blob: empties what is there)
                self.made, size = True, 0
            for at in range(size - origin, len(body), AZURE_BLOCK):
                chunk = body[at : at + AZURE_BLOCK]
                await bc.append_block(chunk, length=len(chunk), appendpos_condition=origin + at, **timeouts)

    async def _first_plan(self, bc: Any, props: Any, timeouts: dict[str, Any]) -> tuple[bytes, int]:
        if props is None:
            return self.data, 0
        blocks = -(-len(self.data) // AZURE_BLOCK)
        if _is_append_blob(props) and (props.append_blob_committed_block_count or 0) + blocks <= AZURE_BLOCKS:
            self.made = True  # (nothing to make)
            return self.data, props.size
        held = await (await bc.download_blob(**timeouts)).readall()
        return held + self.data, 0


def _is_append_blob(props: Any) -> bool:
    return str(getattr(props.blob_type, "value", props.blob_type)) == "AppendBlob"
