"""The Stateful protocol: everything restorable implements it.

``state_dict()`` returns plain data (numbers, strings, lists, dicts, tensors, numpy arrays) that
includes a ``"version"``; ``load_state_dict()`` checks that version (and any topology it recorded) and
raises a sentence naming the mismatch.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StateMismatchError(ValueError):
    """A state dict does not fit the object asked to load it (version or topology)."""


def check_version(owner: str, state: dict[str, Any], supported: int) -> None:
    version = state.get("version")
    if version != supported:
        raise StateMismatchError(f"{owner} state has version {version!r}; this rlctl reads version {supported}")
