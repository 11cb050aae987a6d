"""What the ranks of a data-parallel run agree on, through torch.distributed.

Every rank runs the same loop on its share of the prompts. After each step the ranks exchange their
metric rows and reduce them the same way, so every rank holds the identical row: the rollback policies
then reach the same verdict everywhere without a broadcast, and the adaptive KL controller and the
counters stay in step. How a metric combines over ranks (``FIRST``, ``MAX``, ``MIN``, ``SUM`` or ``MEAN``)
is declared where it is produced, next to the code that computes it, and handed to ``reduce_row``.
Decisions that start on one rank (a stop signal, the end of dynamic sampling) are agreed with a
one-integer all-reduce. ``Dist`` implements ``rlctl.checkpoint.collectives.Collectives``; in a world
of one every method is a no-op.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch

FIRST = "first"  # identical on every rank
MAX = "max"  # e.g. a duration: a step takes as long as its slowest rank
MIN = "min"
SUM = "sum"  # counts, and totals such as tokens and throughput
MEAN = "mean"

Reductions = Mapping[str, str]  # metric name -> how ranks combine it


def undeclared(row: dict[str, Any], how: Reductions) -> list[str]:
    """The metrics of ``row`` that ``how`` does not say how to reduce."""
    return [key for key in row if key not in how]


def reduce_rows(rows: list[dict[str, Any]], how: Reductions) -> dict[str, Any]:
    """One row from every rank's row (same keys, rank order), each metric combined as ``how`` declares.
    Values equal on every rank (lr, the KL coefficient, the global grad norm) come out bit-identical;
    NaN anywhere stays NaN."""
    if len(rows) == 1:
        return dict(rows[0])
    keys = list(rows[0])
    for r, row in enumerate(rows[1:], 1):
        if list(row) != keys:
            diff = sorted(set(row) ^ set(keys))
            raise RuntimeError(f"rank {r} reported different metrics than rank 0: {diff}")
    out: dict[str, Any] = {}
    for key in keys:
        values = [row[key] for row in rows]
        out[key] = combine(values, how[key])
    return out


def combine(values: list[Any], how: str) -> Any:
    """One value from several (ranks, or an actor's micro-batches) as ``how`` says; NaN anywhere wins."""
    if how == FIRST or not all(isinstance(v, (int, float)) for v in values):
        return values[0]
    if all(v == values[0] for v in values) and how != SUM:
        return values[0]
    if any(isinstance(v, float) and math.isnan(v) for v in values):
        return math.nan
    if how == MAX:
        return max(values)
    if how == MIN:
        return min(values)
    if how == SUM:
        return sum(values)
    return sum(values) / len(values)


class Dist:
    """This rank's view of the process group: rank, world size, and the collectives."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self._dist = dist if dist.is_initialized() else None
        self.rank = dist.get_rank() if self._dist else 0
        self.world = dist.get_world_size() if self._dist else 1
        self.device = device
        self._group = None  # the default process group

    def own_group(self) -> Dist:
        """The same ranks over a process group of their own (gloo, CPU tensors): its collectives, made in
        another thread (the generator of an overlapped rollout), never interleave with this one's, which
        a process group requires. Every rank calls it, at the same point; in a world of one, ``self``."""
        if not self.active:
            return self
        other = copy.copy(self)
        other._group, other.device = self._dist.new_group(backend="gloo"), torch.device("cpu")
        return other

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.active:
            self._dist.barrier(group=self._group)

    def _reduce_int(self, value: int, op) -> int:
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._dist.all_reduce(t, op=op, group=self._group)
        return int(t.item())

    def sum(self, value: int) -> int:
        """The sum over every rank."""
        return self._reduce_int(value, self._dist.ReduceOp.SUM if self.active else None)

    def max(self, value: int) -> int:
        """The largest over every rank."""
        return self._reduce_int(value, self._dist.ReduceOp.MAX if self.active else None)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on at least one."""
        return bool(self._reduce_int(int(flag), self._dist.ReduceOp.MAX if self.active else None))

    def all(self, flag: bool) -> bool:
        """True on every rank when it is true on all of them."""
        return bool(self._reduce_int(int(flag), self._dist.ReduceOp.MIN if self.active else None))

    def reduce_row(self, row: dict[str, Any], how: Reductions) -> dict[str, Any]:
        """Every rank's metric row, each metric reduced as ``how`` declares (see ``reduce_rows``);
        identical on every rank. A metric without a declaration is an error, in a world of one too."""
        if missing := undeclared(row, how):
            raise RuntimeError(f"metrics without a declared reduction over ranks: {missing}")
        if not self.active:
            return row
        rows: list[dict[str, Any]] = [None] * self.world  # type: ignore[list-item]
        self._dist.all_gather_object(rows, row, group=self._group)
        return reduce_rows(rows, how)

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items (n is a multiple of the world size)."""
        per = n // self.world
        return slice(self.rank * per, (self.rank + 1) * per)
