"""The training process's side of a snapshot written by the writer process (rlctl.checkpoint.writer):
the job pickled with torch's multiprocessing reductions, so that only handles of shared memory cross.

- Host tensors' storages are moved into shared memory the first time, in place (they stay there for the
  rest of the run), unless a thread of this process reads the live state meanwhile (``LIVE_READS``).
- Device tensors are copied into host buffers in shared memory, one per storage (``HostCopies``), lent by
  a pool that keeps them from one snapshot to the next (``HostBuffers``): on CUDA page-locked and filled
  on a side stream that waits for the training stream, so the copies overlap one another and the pickling.
- Too little shared memory is found before anything moves (``NoSharedMemory``): the caller writes the
  job in a thread instead.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlctl.checkpoint.job import WriteJob

SHM_DIR = "/dev/shm"
_SHM_MARGIN = 64 << 20  # free shared memory left over after moving a storage there


class NoSharedMemory(RuntimeError):
    """The state cannot be moved into shared memory (too little of it): the job is written in a thread."""


def _pickler_class(copies: HostCopies):
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    def reduce(t: torch.Tensor):
        data = t.detach() if t.device.type == "cpu" else copies.of(t)  # the writer never sees a device
        storage = data.untyped_storage()
        if not storage.is_shared() and storage.nbytes():
            _check_room(storage.nbytes())
        rebuild, args = reduce_tensor(data)  # (autograd does not cross processes: the data does)
        state = torch._utils._get_obj_state(t)
        if type(t) is torch.Tensor and not t.requires_grad and not state:
            return rebuild, args
        return _rebuild_like, (rebuild, args, type(t), t.requires_grad, state)

    class JobPickler(ForkingPickler):
        _extra_reducers = {
            **ForkingPickler._extra_reducers,
            **{cls: reduce for cls in ForkingPickler._extra_reducers if issubclass_safe(cls, torch.Tensor)},
        }

    return JobPickler


class HostBuffers:
    """The host buffers device storages are staged into, in shared memory, kept from one snapshot to the
    next: a run's snapshots stage storages of the same sizes every time, so after the first no page is
    allocated or faulted in again and no /dev/shm file is created. On CUDA each buffer is pinned
    (page-locked where it lies, cudaHostRegister) so that the copies into it run asynchronously on a side
    stream. A buffer is lent to one job at a time (``take``) until the writer has staged it (``give_back``)."""

    def __init__(self):
        self._free: dict[tuple[str, int], list[Any]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int, device) -> Any:
        import torch

        with self._lock:
            pool = self._free.get((device.type, nbytes))
            if pool:
                return pool.pop()
        _check_room(nbytes)
        host = torch.UntypedStorage(nbytes).share_memory_()
        if device.type == "cuda":
            _pin(host)
        return host

    def free_bytes(self) -> int:
        """The bytes of the buffers waiting for a job (what a snapshot needs no new room for)."""
        with self._lock:
            return sum(kind_size[1] * len(pool) for kind_size, pool in self._free.items())

    def clear(self) -> None:
        """Free the buffers waiting for a job (a run ended; those lent to a job in flight stay lent)."""
        with self._lock:
            self._free = {}

    def give_back(self, lent: Sequence[tuple[str, Any]]) -> None:
        with self._lock:
            for kind, host in lent:
                self._free.setdefault((kind, host.nbytes()), []).append(host)


def _pin(host) -> None:
    """Page-lock ``host`` where it lies (in shared memory, where the writer maps it); left pageable, its
    copies then synchronous, where the driver refuses."""
    import torch

    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes(), 0)


HOST_BUFFERS = HostBuffers()


class HostCopies:
    """One job's host copies of the device storages its tensors view: one copy per storage (views of one
    storage stay views of one copy: a ZeRO-3 restore relies on that), in buffers lent by ``buffers``. On
    CUDA they are copied on a side stream of the device that first waits for the work the training stream
    has queued. ``wait`` before the job is sent; ``release`` once the writer no longer reads them."""

    def __init__(self, buffers: HostBuffers | None = None):
        self._buffers = buffers if buffers is not None else HOST_BUFFERS
        self._copies: dict[tuple[str, int, int], Any] = {}
        self._lent: list[tuple[str, Any]] = []
        self._streams: dict[Any, Any] = {}

    def of(self, t):
        """``t`` (on any device) as a view of the host copy of its storage."""
        import torch

        source = t.untyped_storage()
        key = _storage_key(source) if source.nbytes() else None
        host = self._copies.get(key) if key is not None else None  # (empty storages all sit at address 0)
        if host is None:
            host = self._buffers.take(source.nbytes(), t.device)
            self._lent.append((t.device.type, host))
            self._copy(host, source, t.device)
            if key is not None:
                self._copies[key] = host
        return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())

    def _copy(self, host, source, device) -> None:
        if device.type != "cuda":
            host.copy_(source)
            return
        import torch

        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # what training has queued so far
        with torch.cuda.stream(stream):
            host.copy_(source, non_blocking=True)

    def wait(self) -> None:
        """Until every copy has landed in host memory."""
        for stream in self._streams.values():
            stream.synchronize()

    def release(self) -> None:
        """Give the buffers back for the next job (once the writer has staged them, or failed)."""
        lent, self._lent, self._copies = self._lent, [], {}
        self._buffers.give_back(lent)


def _rebuild_like(rebuild, args, cls, requires_grad: bool, state):
    """A tensor as torch.save sees the one it stands for: its class, requires_grad and attributes (so
    the writer's files are byte for byte those written in the training process)."""
    import torch

    t = rebuild(*args)
    if cls is torch.nn.Parameter:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    else:
        t = t if cls is torch.Tensor else t.as_subclass(cls)
        t.requires_grad_(requires_grad)
    return torch._utils._set_obj_state(t, state) if state else t


def issubclass_safe(cls: Any, base: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, base)


def _storage_key(storage) -> tuple[str, int, int]:
    """What tells one storage from another while a job is pickled: its device, address and size."""
    return str(storage.device), storage.data_ptr(), storage.nbytes()


def _to_share(obj: Any, found: dict) -> dict:
    """The bytes of each storage of the tensors in ``obj`` (nested lists, tuples and dicts) that is not
    in shared memory yet, by storage (``found``, filled)."""
    import torch

    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if obj.device.type != "cpu" or not storage.is_shared():
            found[_storage_key(storage)] = storage.nbytes()
    elif isinstance(obj, dict):
        for value in obj.values():
            _to_share(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _to_share(value, found)
    return found


def _check_room(nbytes: int) -> None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        raise NoSharedMemory(f"{SHM_DIR} is not available ({exc.strerror})") from exc
    free = st.f_bavail * st.f_frsize
    if free < nbytes + _SHM_MARGIN:
        raise NoSharedMemory(f"{SHM_DIR} has {free / 2**20:.0f} MiB free; the snapshot's state needs more")


class LiveReads:
    """The threads of this process that read live state (a snapshot written in a thread, until it is
    staged), which no storage may move into shared memory under: a move frees the storage's old memory,
    and torch.save hands the file a view of that memory, which such a thread may be writing and hashing
    with the GIL released. ``pickle_job`` moves storages only ``while_none``."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0

    def begin(self) -> Callable[[], None]:
        """A thread starts reading live state (it waits for a move under way); returns what ends it."""
        with self._cond:
            self._readers += 1
        ended = []

        def end() -> None:
            with self._cond:
                if not ended:
                    ended.append(True)
                    self._readers -= 1
                    self._cond.notify_all()

        return end

    @contextlib.contextmanager
    def while_none(self):
        """Wait until no thread reads live state, and let none begin until the block ends."""
        with self._cond:
            self._cond.wait_for(lambda: self._readers == 0)
            yield


LIVE_READS = LiveReads()


@dataclass
class Payload:
    """A job pickled for the writer, and the host copies of device storages it names (``copies``: given
    back when the writer has staged them)."""

    data: bytes
    copies: HostCopies


def pickle_job(job: WriteJob) -> Payload:
    """The job as the writer receives it (call on the training thread: moving a tensor's storage into
    shared memory swaps its memory under anything that computes with it; a snapshot another manager of
    this process writes in a thread is waited for until staged, ``LIVE_READS``). Raises NoSharedMemory:
    before any storage moves when the state dicts' tensors would not fit together (each storage pickled
    is registered for the writer to fetch, and stays so if pickling stops half-way)."""
    moving = _to_share(job.deferred, {})
    _check_room(sum(moving.values()) - HOST_BUFFERS.free_bytes())
    buf, copies = io.BytesIO(), HostCopies()
    try:
        with LIVE_READS.while_none() if moving else contextlib.nullcontext():
            _pickler_class(copies)(buf, pickle.HIGHEST_PROTOCOL).dump(job)
        copies.wait()  # (the copies of device storages ran on a side stream meanwhile)
    except BaseException:
        copies.release()
        raise
    return Payload(buf.getvalue(), copies)
