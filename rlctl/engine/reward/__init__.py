"""Reward functions, loaded by ``module:function`` like any user's.

A reward function is called once per step as ``fn(prompts, completions, **columns, **kwargs)`` where
``prompts`` and ``completions`` are lists of strings of equal length (each prompt repeated
``group_size`` times) and ``columns`` are the dataset's other columns, aligned the same way. It returns
one float per completion. This is the signature TRL's reward functions use, so they carry over.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from rlctl.errors import ConfigError

RewardFn = Callable[..., list[float]]


def load_reward_fn(spec: str) -> RewardFn:
    module_name, _, fn_name = spec.partition(":")
    # The console script does not put the working directory on sys.path; a reward module next to the
    # config is the common case, so look there too (as uvicorn does for its apps).
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"'reward.function': cannot import module '{module_name}' ({exc})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ConfigError(
            f"'reward.function': module '{module_name}' has no function '{fn_name}'"
            + (f" (it has: {', '.join(names[:10])})" if names else "")
        )
    return fn
