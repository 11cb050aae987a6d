"""Whether the Ray nodes that hold a run's ranks are still there, as the driver sees them.

A node is lost when Ray declares it dead (its GCS health checks: about 15 s after a raylet dies with
Ray's defaults) or when a rank's actor on it has answered none of the driver's pings (one every
``PING_S``) for ``cluster.node_loss_timeout`` seconds: a node cut off by the network, or a cluster whose
health checks are slower than the run should wait. An actor that died on a node still alive is a crash,
not a lost node. The survivors of a lost node may wait in a collective with a dead peer for the whole
process-group timeout, so the driver does not wait for them: the supervisor kills them at once.
"""

from __future__ import annotations

import math
import time
from typing import Any

from rlctl.errors import ExitCode

PING_S = 2.0  # between a rank actor's answer and the next ping
NODES_S = 1.0  # how long Ray's list of alive nodes is reused
CRASHED = "crashed"  # a verdict: the actor died on a node that is alive


class NodeWatch:
    """The Ray nodes alive now, asked of Ray's GCS at most once a ``NODES_S``, and the nodes found lost
    ({id: why}), for all of a run's ranks."""

    def __init__(self) -> None:
        self.lost: dict[str, str] = {}
        self._alive: set[str] | None = None
        self._at = -math.inf

    def alive(self, node_id: str, fresh: bool = False) -> bool:
        """Whether Ray holds ``node_id`` alive (``fresh``: asked now); True while Ray cannot be asked."""
        import ray

        now = time.monotonic()
        if fresh or now - self._at >= NODES_S:
            self._at = now
            try:
                self._alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            except Exception:  # the GCS is busy or away: the pings still bound the wait
                pass
        return self._alive is None or node_id in self._alive


class Reach:
    """One rank's actor as the driver reaches it: one ping in flight at a time, the time of the last
    answer, and the verdict on its node (``verdict``)."""

    def __init__(self, actor, node: dict[str, str], watch: NodeWatch, timeout: float):
        self.actor, self.node, self.watch, self.timeout = actor, node, watch, timeout
        self.seen = time.monotonic()  # the last answer (the actor has just told where it runs)
        self.died: BaseException | None = None  # a ping's ActorDiedError: the actor is dead
        self.killed = False  # by the driver: no more pings (their errors would say nothing of the node)
        self._ping = None
        self._sent = -math.inf

    def verdict(self, failure: BaseException | None) -> str | None:
        """None while the rank may still be there; ``CRASHED`` when its actor died (``failure``: the error
        its ``run`` call ended with, if any) on a node that Ray holds alive; else why its node is lost."""
        from ray.exceptions import ActorDiedError

        node = self.node["id"]
        if node in self.watch.lost:  # (found by another rank on it)
            return self.watch.lost[node]
        self._ping_now()
        died = failure if isinstance(failure, ActorDiedError) else self.died
        where = f"Ray node {self.node['ip']} (id {node[:12]})"
        silent = time.monotonic() - self.seen
        if not self.watch.alive(node, fresh=died is not None):
            self.watch.lost[node] = f"{where} was declared dead by Ray"
        elif died is not None:
            return CRASHED
        elif silent > self.timeout:
            self.watch.lost[node] = f"{where} did not answer for {silent:.0f} s (cluster.node_loss_timeout)"
        return self.watch.lost.get(node)

    def _ping_now(self) -> None:
        """Collect the ping in flight if it was answered; send the next ``PING_S`` after the last."""
        import ray
        from ray.exceptions import ActorDiedError

        now = time.monotonic()
        if self._ping is not None and not self.killed and ray.wait([self._ping], timeout=0)[0]:
            try:
                ray.get(self._ping)
                self.seen = now
            except ActorDiedError as exc:
                self.died = exc
            except Exception:  # unavailable (out of reach for now): the silence goes on
                pass
            self._ping, self._sent = None, now
        if self.killed:
            return
        if self._ping is None and self.died is None and now - self._sent >= PING_S:
            self._ping, self._sent = self.actor.ping.remote(), now

    def lost(self, rank: int, cause: str) -> dict[str, Any]:
        """The rank's result once its node is lost."""
        return {
            "code": int(ExitCode.NODE_LOST),
            "message": f"{cause}, with rank {rank} on it",
            "summary": None,
            "rank": rank,
            "node": {**self.node, "cause": cause},
        }
