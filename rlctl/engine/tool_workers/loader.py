"""The tools of ``rollout.multi_turn``: each function or stateful class imported (in the trainer's process,
once) for its JSON schema, and the environment's class checked; a name that does not import is a
ConfigError naming the key, before any work (the preflight). With the built-in python tool, the sandbox
is started once: a jail that cannot start on this machine is a ConfigError too, naming the fix."""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from rlctl.config.multi_turn import MultiTurnConfig, ToolConfig
from rlctl.errors import ConfigError
from rlctl.sandbox import SandboxUnavailable, check
from rlctl.tools.schema import function_schema
from rlctl.usercode import call_user_code, import_or_none

SANDBOXED = "rlctl.tools.python"  # the tools that run the model's code in the sandbox


@dataclass(frozen=True)
class Tools:
    schemas: dict[str, dict[str, Any]]  # name -> the chat template's tool schema (hidden parameters left out)
    functions: dict[str, str]  # name -> module:function (or module:Class), run by the worker processes
    hidden: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> parameters the rows fill
    stateful: frozenset[str] = frozenset()  # names of the tools kept as an object per conversation
    environment: str | None = None  # module:Class answering every turn instead of tools
    # name -> the tool's own metrics of a call (its ``call_metrics``: ``reductions`` and ``of(outcome, text)``)
    call_metrics: dict[str, Any] = field(default_factory=dict)


def load_tools(mt: MultiTurnConfig) -> Tools:
    """Every tool of ``mt`` imported (the working directory importable, as for a reward function and in
    the workers) and its schema read, and the environment's class found; a ConfigError naming the key for
    one that is not there or not of its kind."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    schemas, functions, call_metrics = {}, {}, {}
    for i, tool in enumerate(mt.tools):
        key = f"'rollout.multi_turn.tools[{i}].{'function' if tool.function is not None else 'stateful'}'"
        found = _attribute(tool.spec, key, "function" if tool.function is not None else "class")
        if tool.function is not None:
            if not callable(found) or inspect.isclass(found):
                raise ConfigError(f"{key}: {tool.spec} is no function")
            schema = without_hidden(function_schema(found, tool.label), tool.hidden, i)
        else:
            schema = _stateful_schema(found, tool, key, i)
        schemas[tool.label], functions[tool.label] = schema, tool.spec
        if getattr(found, "call_metrics", None) is not None:  # e.g. the built-in python tool's tool/python/*
            call_metrics[tool.label] = found.call_metrics
    environment = None
    if mt.environment is not None:
        env = _attribute(mt.environment, "'rollout.multi_turn.environment'", "class")
        if not inspect.isclass(env) or not callable(getattr(env, "step", None)):
            raise ConfigError(
                f"'rollout.multi_turn.environment': {mt.environment} is no class with a step(action) method"
            )
        environment = mt.environment
    if any(t.spec.partition(":")[0] == SANDBOXED for t in mt.tools):
        try:
            check(mt.sandbox.limits(), "rollout.multi_turn.sandbox")
        except SandboxUnavailable as exc:
            raise ConfigError(str(exc)) from None
    stateful = frozenset(t.label for t in mt.tools if t.stateful is not None)
    hidden = {t.label: tuple(t.hidden) for t in mt.tools if t.hidden}
    return Tools(schemas, functions, hidden, stateful, environment, call_metrics)


def _attribute(spec: str, key: str, noun: str) -> Any:
    """What ``module:attribute`` names, imported; a ConfigError naming ``key`` when it is not there."""
    module_name, _, name = spec.partition(":")
    module = call_user_code(f"tool '{spec}': importing module '{module_name}'", import_or_none, module_name)
    if module is None:
        raise ConfigError(f"{key}: cannot import module '{module_name}' (No module named '{module_name}')")
    found = getattr(module, name, None)
    if found is None:
        raise ConfigError(f"{key}: module '{module_name}' has no {noun} '{name}'")
    return found


def _stateful_schema(cls: Any, tool: ToolConfig, key: str, index: int) -> dict[str, Any]:
    """A stateful tool's schema: its ``call``'s signature and docstring (the class's when call has none);
    its hidden parameters must be ``create``'s."""
    if not inspect.isclass(cls) or not callable(getattr(cls, "call", None)):
        raise ConfigError(f"{key}: {tool.spec} is no class with a call(...) method")
    create = getattr(cls, "create", None)
    params = list(inspect.signature(create).parameters)[1:] if callable(create) else []
    for name in tool.hidden:
        if name not in params:
            raise ConfigError(
                f"'rollout.multi_turn.tools[{index}].hidden': '{name}' is not a parameter of {tool.spec}.create "
                f"(its parameters: {', '.join(params) or 'none'})"
            )
    return function_schema(cls.call, tool.label, doc=cls.__doc__)


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
