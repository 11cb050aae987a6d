"""Code a model wrote, run in a jail (``jail``: bubblewrap and the limits) by a runner program
(``runner``), one run at a time (``run.execute``). On the ground floor: the standard library only, so the
built-in python tool (``rlctl.tools.python``), the code rewards (``rlctl.engine.reward.code``) and the
config's section (``rlctl.config.sandbox``) all stand on it."""

from rlctl.sandbox.jail import JAIL, UNSAFE, Limits, SandboxUnavailable, check, version
from rlctl.sandbox.run import Result, execute, limit_sentence

_limits = Limits()


def configure(limits: Limits) -> None:
    """Set this process's limits (a tool worker's, from the run's ``rollout.multi_turn.sandbox``)."""
    global _limits
    _limits = limits


def current() -> Limits:
    """This process's limits (the defaults until ``configure``)."""
    return _limits


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
