"""What a tool author and the rollout share, with no torch and no process in it: the tool-call formats
(``formats``: how a model writes a call, one parsing function each), the JSON schema of a tool read from
its signature and docstring and the check of a call's arguments against it (``schema``), and
``ToolError``, which a tool raises to tell the model a failure in its own words, and
``ToolUnavailable``, which a tool raises when what it stands on (a service, a sandbox) is down: that is
no mistake of the model's, and the trajectory is left out of the update."""

from __future__ import annotations


class ToolUnavailable(Exception):
    """Raised by a tool whose infrastructure failed (not the model's call): the trajectory that made the
    call is masked out of the update and counted in ``tool/unavailable_frac``."""


class ToolError(Exception):
    """Raised by a tool to tell the model a failure of its call in the tool's own words (the outcome is an
    error, counted in ``tool/error_frac``, and the model reads the message as it is: no type name, no place
    in the tool's source), e.g. the traceback of the code the python tool ran."""


__all__ = ["ToolError", "ToolUnavailable"]
