"""Code a model wrote, run in a jail (``jail``: bubblewrap and the limits) by a runner program
(``runner``), one execution at a time (``execution.execute``); ``jail`` also keeps this process's limits (``configure``,
``current``). This package only re-exports. On the ground floor: the standard library only, so the
built-in python tool (``rlctl.tools.python``), the code rewards (``rlctl.engine.reward.code``) and the
config's section (``rlctl.config.sandbox``) all stand on it."""

from rlctl.sandbox.execution import Result, execute, limit_sentence
from rlctl.sandbox.jail import JAIL, UNSAFE, Limits, SandboxUnavailable, check, configure, current, version

__all__ = [
    "configure",
    "current",
    "JAIL",
    "UNSAFE",
    "Limits",
    "Result",
    "SandboxUnavailable",
    "check",
    "execute",
    "limit_sentence",
    "version",
]
