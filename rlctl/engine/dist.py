"""What the ranks of a data-parallel run agree on, through torch.distributed.

Every rank runs the same loop on its share of the prompts. After each step the ranks exchange their
metric rows and reduce them the same way, so every rank holds the identical row: the rollback policies
then reach the same verdict everywhere without a broadcast, and the adaptive KL controller and the
counters stay in step. Decisions that start on one rank (a stop signal, the end of dynamic sampling)
are agreed with a one-integer all-reduce. In a world of one every method is a no-op.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _reduction(key: str) -> str:
    """How a metric combines over ranks: max, min, sum, first (identical on every rank) or mean."""
    if key in ("step", "timestamp"):
        return "first"
    if key.endswith("/max") or key.startswith("timing_s/"):
        return "max"  # a step takes as long as its slowest rank
    if key.endswith("/min"):
        return "min"
    if key.startswith("actor/nonfinite/") or key.startswith("critic/nonfinite/") or key.endswith(
        ("skipped_updates", "/tokens", "perf/throughput", "perf/tokens_seen", "kept_groups")
    ):
        return "sum"
    return "mean"


def reduce_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from every rank's row (same keys, rank order). Values equal on every rank (lr, the KL
    coefficient, the global grad norm) come out bit-identical; NaN anywhere stays NaN."""
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
        how = _reduction(key)
        if how == "first" or not all(isinstance(v, (int, float)) for v in values):
            out[key] = values[0]
        elif all(v == values[0] for v in values) and how != "sum":
            out[key] = values[0]
        elif any(isinstance(v, float) and math.isnan(v) for v in values):
            out[key] = math.nan
        elif how == "max":
            out[key] = max(values)
        elif how == "min":
            out[key] = min(values)
        elif how == "sum":
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


class Dist:
    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self._dist = dist if dist.is_initialized() else None
        self.rank = dist.get_rank() if self._dist else 0
        self.world = dist.get_world_size() if self._dist else 1
        self.device = device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.active:
            self._dist.barrier()

    def _reduce_int(self, value: int, op) -> int:
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._dist.all_reduce(t, op=op)
        return int(t.item())

    def sum(self, value: int) -> int:
        """The sum over every rank."""
        return self._reduce_int(value, self._dist.ReduceOp.SUM if self.active else None)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on at least one."""
        return bool(self._reduce_int(int(flag), self._dist.ReduceOp.MAX if self.active else None))

    def all(self, flag: bool) -> bool:
        """True on every rank when it is true on all of them."""
        return bool(self._reduce_int(int(flag), self._dist.ReduceOp.MIN if self.active else None))

    def reduce_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """Every rank's metric row, reduced (see ``reduce_rows``); identical on every rank."""
        if not self.active:
            return row
        rows: list[dict[str, Any]] = [None] * self.world  # type: ignore[list-item]
        self._dist.all_gather_object(rows, row)
        return reduce_rows(rows)

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items (n is a multiple of the world size)."""
        per = n // self.world
        return slice(self.rank * per, (self.rank + 1) * per)
