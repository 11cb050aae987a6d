"""The exceptions a tool raises to say what went wrong: ``ToolError`` (the call failed, in the tool's
own words for the model) and ``ToolUnavailable`` (what the tool stands on is down: no mistake of the
model's)."""


class ToolUnavailable(Exception):
    """Raised by a tool whose infrastructure failed (not the model's call): the trajectory that made the
    call is masked out of the update and counted in ``tool/unavailable_frac``."""


class ToolError(Exception):
    """Raised by a tool to tell the model a failure of its call in the tool's own words (the outcome is an
    error, counted in ``tool/error_frac``, and the model reads the message as it is: no type name, no place
    in the tool's source), e.g. the traceback of the code the python tool ran."""
