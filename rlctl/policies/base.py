"""The base of every policy model (strict: an unknown key is an error) and the two helpers their
validators and descriptions share."""

from __future__ import annotations

from typing import NoReturn

from pydantic import BaseModel, ConfigDict


class PolicyModel(BaseModel):
    """Strict: an unknown key is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid")


def as_written(value: float) -> str:
    """A number as a person writes it: 0.05, 1e-06, 10."""
    return f"{value:g}"


def reject(message: str) -> NoReturn:
    """Reject a model in a validator (pydantic turns the ValueError into a located error)."""
    raise ValueError(message)
