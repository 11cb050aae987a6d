"""What the ranks of a run do together, one name per collective.

The snapshot manager and the engine's trained modules take a ``Collectives`` at construction;
``rlctl.engine.dist.Dist`` implements it over torch.distributed. ``Local`` stands in where there is no
process group: a world of one, the driver process, or threads in a test that meet at a given barrier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Collectives(Protocol):
    def barrier(self) -> None:
        """Every rank meets here."""

    def all(self, flag: bool) -> bool:
        """True on every rank when it is true on all of them."""

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on at least one."""

    def sum(self, value: int) -> int:
        """The sum over every rank."""

    def max(self, value: int) -> int:
        """The largest over every rank."""


class Local:
    """Collectives of one process: every decision is its own; ``barrier`` calls the given meeting
    point (a ``threading.Barrier``'s ``wait`` in a test), or nothing."""

    def __init__(self, barrier: Callable[[], object] | None = None):
        self._barrier = barrier

    def barrier(self) -> None:
        if self._barrier is not None:
            self._barrier()

    def all(self, flag: bool) -> bool:
        return flag

    def any(self, flag: bool) -> bool:
        return flag

    def sum(self, value: int) -> int:
        return value

    def max(self, value: int) -> int:
        return value
