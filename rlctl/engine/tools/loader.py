"""The tools of ``rollout.multi_turn``: each function imported (in the trainer's process, once) for its JSON
schema; a name that does not import is a ConfigError naming the key, before any work (the preflight)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from rlctl.config.multi_turn import MultiTurnConfig
from rlctl.engine.reward import _import, call_user_code
from rlctl.errors import ConfigError
from rlctl.tools.schema import function_schema


@dataclass(frozen=True)
class Tools:
    schemas: dict[str, dict[str, Any]]  # name -> the chat template's tool schema (hidden parameters left out)
    functions: dict[str, str]  # name -> module:function, run by the worker processes
    hidden: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> parameters the rows fill


def load_tools(mt: MultiTurnConfig) -> Tools:
    """Every tool of ``mt`` imported (the working directory importable, as for a reward function and in
    the workers) and its schema read; a ConfigError naming the tool's key for one that is not there."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    schemas, functions = {}, {}
    for i, tool in enumerate(mt.tools):
        key = f"'rollout.multi_turn.tools[{i}].function'"
        module_name, _, fn_name = tool.function.partition(":")
        module = call_user_code(f"tool '{tool.function}': importing module '{module_name}'", _import, module_name)
        if module is None:
            raise ConfigError(f"{key}: cannot import module '{module_name}' (No module named '{module_name}')")
        fn = getattr(module, fn_name, None)
        if not callable(fn):
            raise ConfigError(f"{key}: module '{module_name}' has no function '{fn_name}'")
        schemas[tool.label] = without_hidden(function_schema(fn, tool.label), tool.hidden, i)
        functions[tool.label] = tool.function
    return Tools(schemas, functions, {t.label: tuple(t.hidden) for t in mt.tools if t.hidden})


def without_hidden(schema: dict[str, Any], hidden: list[str], index: int) -> dict[str, Any]:
    """``schema`` without the ``hidden`` parameters (each must be one of the function's: a ConfigError
    naming the key otherwise)."""
    params = schema["function"]["parameters"]
    for name in hidden:
        if name not in params.get("properties", {}):
            have = ", ".join(params.get("properties", {})) or "none"
            raise ConfigError(
                f"'rollout.multi_turn.tools[{index}].hidden': '{name}' is not a parameter of the tool "
                f"{schema['function']['name']} (its parameters: {have})"
            )
        del params["properties"][name]
        if name in params.get("required", []):
            params["required"].remove(name)
    return schema
