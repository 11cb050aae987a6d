"""A tool's JSON schema read from a plain function's signature and docstring, and the check of a call's
arguments against it.

The schema is what chat templates take (``{"type": "function", "function": {name, description,
parameters}}``): the description is the docstring's first paragraph, a parameter's description its line
under ``Args:`` (Google style), its type the JSON type of its annotation (str, int, float, bool, list,
dict, Literal choices, X | None), and a parameter without a default is required.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from rlctl.tools.formats import ToolCall

_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_PY = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def _json_type(annotation: Any) -> dict[str, Any]:
    """The JSON schema of a type annotation (an unknown one: no constraint)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {"type": _JSON.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return _json_type(kinds[0]) if len(kinds) == 1 else {}
    if origin is not None:
        annotation = origin
    return {"type": _JSON[annotation]} if annotation in _JSON else {}


def _doc_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The first paragraph of a docstring and the parameter lines of its ``Args:`` section."""
    doc = inspect.cleandoc(doc or "")
    description = " ".join(doc.split("\n\n")[0].split()) if doc and not doc.startswith("Args:") else ""
    params: dict[str, str] = {}
    section = re.search(r"^Args:\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if section:
        current = None
        for line in section.group(1).splitlines():
            match = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
            if match and (current is None or len(line) - len(line.lstrip()) <= 4):
                current = match.group(1)
                params[current] = match.group(2).strip()
            elif current is not None:
                params[current] = f"{params[current]} {line.strip()}".strip()
    return description, params


def function_schema(fn: Callable, name: str | None = None, doc: str | None = None) -> dict[str, Any]:
    """The chat-template tool schema of ``fn`` (called ``name``, default its own name; a method of a class
    without its ``self``). ``doc``: the description when ``fn``'s docstring has none (a class's)."""
    description, docs = _doc_parts(fn.__doc__ or "")
    if not description and doc:
        description = _doc_parts(doc)[0]
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve constrains nothing
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":  # Class.call: the object is no argument of the model's
        params = params[1:]
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _json_type(hints.get(param.name, Any))
        if param.name in docs:
            prop["description"] = docs[param.name]
        properties[param.name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name or fn.__name__, "description": description, "parameters": parameters},
    }


def check_call(call: ToolCall, schemas: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, str | None]:
    """The call's arguments, typed by its tool's schema, or None and a sentence for the model: an unknown
    tool, an unknown or missing argument, or a value of the wrong type. Text values of an untyped format
    are read as their declared type (JSON for numbers, booleans, arrays and objects)."""
    schema = schemas.get(call.name)
    if schema is None:
        return None, f"there is no tool named {call.name!r}; the tools are: {', '.join(sorted(schemas))}"
    params = schema["function"]["parameters"]
    props, required = params["properties"], params["required"]
    unknown = sorted(set(call.arguments) - set(props))
    if unknown:
        return None, f"{call.name} has no argument {unknown[0]!r}; its arguments are: {', '.join(props) or 'none'}"
    missing = [r for r in required if r not in call.arguments]
    if missing:
        return None, f"{call.name} needs the argument {missing[0]!r}"
    args = {}
    for key, value in call.arguments.items():
        value, problem = _typed(value, props[key], call.typed)
        if problem is not None:
            return None, f"argument {key!r} of {call.name}: {problem}"
        args[key] = value
    return args, None


def _typed(value: Any, prop: dict[str, Any], typed: bool) -> tuple[Any, str | None]:
    kind = prop.get("type")
    if not typed and kind not in (None, "string") and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, f"expected {kind}, got {value!r}"
    if kind is not None:
        ok = isinstance(value, _PY[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
        if not ok:
            return None, f"expected {kind}, got {json.dumps(value)}"
    if "enum" in prop and value not in prop["enum"]:
        return None, f"expected one of {json.dumps(prop['enum'])}, got {json.dumps(value)}"
    return value, None
