"""A reward function named by ``module:function``, imported like any user's code (``rlctl.usercode``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from rlctl.errors import ConfigError
from rlctl.usercode import call_user_code, import_or_none

RewardFn = Callable[..., list[float]]


def load_reward_fn(spec: str) -> RewardFn:
    """The function named by ``module:function``. A module or function that does not exist is a
    ConfigError (the config names something that is not there); a module whose import fails is an
    InputError naming the cause."""
    module_name, _, fn_name = spec.partition(":")
    # The console script does not put the working directory on sys.path; a reward module next to the
    # config is the common case, so look there too (as uvicorn does for its apps).
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module = call_user_code(f"reward function '{spec}': importing module '{module_name}'", import_or_none, module_name)
    if module is None:
        raise ConfigError(f"'reward.function': cannot import module '{module_name}' (No module named '{module_name}')")
    fn = call_user_code(f"reward function '{spec}': looking it up", getattr, module, fn_name, None)
    if not callable(fn):
        names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None)))
        raise ConfigError(
            f"'reward.function': module '{module_name}' has no function '{fn_name}'"
            + (f" (it has: {', '.join(names[:10])})" if names else "")
        )
    return fn
