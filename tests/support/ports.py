"""Ports for third-party test servers (Ray's GCS and agents, slurmctld, slurmd, the storage emulators)
that are given a port number and bind it themselves, later: the port is probed free now, and another
process may take it in between. It is therefore chosen outside the kernel's ephemeral range, where no
process's port-0 bind (the rendezvous of rlctl's ranks, every outgoing connection) can land on it, and at
random, so that two test workers choosing at once rarely choose the same one (above Ray's worker ports); a start that still fails
on its port is retried by its caller (``RayNodes``' head, ``conftest._server``)."""

import random
import socket

_RANDOM = random.SystemRandom()  # (tests seed the random module)
# Ray's workers take ports 10002-19999 by default, and Ray refuses a fixed port of its own in that range
RAY_WORKER_PORTS_END = 19999


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = map(int, fh.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


def server_port() -> int:
    """A TCP port free now (on every interface), outside the ephemeral range (module docstring)."""
    low, high = _ephemeral()
    span = (RAY_WORKER_PORTS_END + 1, low - 1) if low > RAY_WORKER_PORTS_END + 2000 else (high + 1, 65535)
    for _ in range(200):
        port = _RANDOM.randint(*span)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port in {span[0]}-{span[1]}")
