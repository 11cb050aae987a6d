"""The ranks' rendezvous: how a rank joins its process group, and the store server its peers meet at.

The rendezvous (``init_distributed``) binds no port that was probed earlier, so runs that share a machine
cannot take each other's: a world of one needs no port at all (an in-memory store); the ranks rlctl starts
itself (local processes, Ray actors) meet at a store whose server was bound once, on a port the kernel
chose (``bind_rendezvous``: by the supervisor, or by rank 0's Ray actor), and every rank connects to it as
a client (``RLCTL_RENDEZVOUS=store``); under another launcher, rank 0 binds MASTER_PORT as torch's env://
rendezvous does. A MASTER_PORT set by the user that another process holds is a ConfigError naming it.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from rlctl.errors import ConfigError

RENDEZVOUS = "RLCTL_RENDEZVOUS"  # "store": a store server listens at MASTER_ADDR:MASTER_PORT already
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")  # a launcher sets these too


def init_distributed(backend: str, device: torch.device | None = None) -> None:
    """Join this process's group (module docstring: the rendezvous): in memory for a world of one, at
    the store rlctl bound for its own ranks, else by the launcher's env:// (rank 0 binds MASTER_PORT).
    ``device``: the rank's device (CUDA binds its communicator to it, as DeepSpeed does)."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # The shared-memory comm op is a JIT C++ build (about a minute) that a single process never needs.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    timeout = _group_timeout()
    store = _rendezvous_store(timeout)
    if store is not None:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        bound = {"device_id": device} if device is not None and device.type == "cuda" and world > 1 else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **bound)
    try:
        deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
    except dist.DistNetworkError as exc:
        raise _taken(exc, os.environ.get("MASTER_PORT"), "the launcher's rank 0") from None


def _group_timeout() -> timedelta:
    """The process group's timeout: DeepSpeed's (DEEPSPEED_TIMEOUT minutes, 10 by default)."""
    from deepspeed.constants import default_pg_timeout

    return default_pg_timeout


def _rendezvous_store(timeout: timedelta):
    """The store this rank meets the others at, or None for torch's env:// rendezvous (a launcher's)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return dist.HashStore()
    if os.environ.get(RENDEZVOUS) == "store":
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    return None


def user_master_port() -> int | None:
    """MASTER_PORT when the user set it (not a launcher, which sets RANK and WORLD_SIZE with it)."""
    value = os.environ.get("MASTER_PORT")
    if value is None or any(v in os.environ for v in LAUNCHER_VARS):
        return None
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT is {value!r} (set in the environment); a port is a number from 1 to 65535")
    return port


BIND_TRIES = 5  # binds of a store server on a port the kernel chooses, before the error is raised


def bind_rendezvous(world: int, port: int | None = None):
    """A store server for ``world`` ranks, listening on every interface: on ``port`` (a MASTER_PORT the
    user set: a ConfigError naming it when another process holds it), else on a port the kernel chooses,
    tried again with a fresh one a bounded number of times should the bind fail. Its ``.port`` is what
    the ranks connect to (``RLCTL_RENDEZVOUS=store``); it serves while the object lives."""
    import torch.distributed as dist

    if port is not None:
        try:
            return _store_server(world, port)
        except dist.DistNetworkError as exc:
            raise _taken(exc, port, "rlctl") from None
    failure = None
    for _ in range(BIND_TRIES):
        try:
            return _store_server(world, 0)
        except dist.DistNetworkError as exc:
            failure = exc
    raise failure


def _store_server(world: int, port: int):
    import torch.distributed as dist

    return dist.TCPStore("0.0.0.0", port, world, is_master=True, wait_for_workers=False, timeout=_group_timeout())


def _taken(exc: Exception, port: int | str | None, binder: str) -> Exception:
    """A ConfigError naming MASTER_PORT when ``exc`` says another process holds it, else ``exc``."""
    if "EADDRINUSE" not in str(exc):
        return exc
    return ConfigError(
        f"MASTER_PORT is {port} (set in the environment), but another process on this machine already "
        f"listens there, so {binder} cannot bind it for the ranks' rendezvous; unset MASTER_PORT (rlctl "
        "then lets the system choose a free port) or set one that is free"
    )
