"""The base of every config section: a strict pydantic model (unknown keys are errors, assignments are
validated); and the check of a ``module:attribute`` key (a reward function, a tool), which the sections
share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_import_path(v: str, what: str) -> str:
    """``module:attribute``, else a ValueError naming ``what`` it should be."""
    module, sep, attribute = v.partition(":")
    if not sep or not module or not attribute:
        raise ValueError(f"expected 'module:{what}', got {v!r}")
    return v
