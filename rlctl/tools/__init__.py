"""What a tool author and the rollout share, with no torch and no process in it: the tool-call formats
(``formats``: how a model writes a call, one parsing function each), the JSON schema of a tool read from
its signature and docstring and the check of a call's arguments against it (``schema``), and
``ToolError``, which a tool raises to tell the model a failure in its own words, and
``ToolUnavailable``, which a tool raises when what it stands on (a service, a sandbox) is down: that is
no mistake of the model's, and the trajectory is left out of the update."""

from rlctl.tools.exceptions import ToolError, ToolUnavailable

__all__ = ["ToolError", "ToolUnavailable"]
