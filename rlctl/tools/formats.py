"""Tool-call formats: how a model writes a call in its turn, one parsing function each (a registry).

A format is its end-of-call string (generation stops there when one call is run per turn) and a function
``text -> ParsedTurn``: the well-formed calls, in order, and a sentence for each malformed one (JSON that
does not parse, a call without a name, a call never closed). A malformed call never raises: it goes back
to the model as an error message and is counted. Whether a call names a known tool with fitting
arguments is ``schema.check_call``'s question.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call. ``typed``: the arguments carry JSON types (hermes); False where the format
    writes every value as text (qwen3_coder), to be read by the tool's schema (``schema.check_call``)."""

    name: str
    arguments: dict[str, Any]
    typed: bool = True


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)  # one sentence per malformed call, for the model

    @property
    def attempts(self) -> int:
        """Calls the model tried to make, well-formed or not."""
        return len(self.calls) + len(self.invalid)


@dataclass(frozen=True)
class Format:
    name: str
    start: str  # where a call begins
    end: str  # where a call ends: a stop string of generation
    parse: Callable[[str], ParsedTurn]


class FormatRegistry:
    """Names -> formats; an unknown name is a KeyError listing the valid ones."""

    def __init__(self) -> None:
        self._formats: dict[str, Format] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._formats)

    def register(self, name: str, start: str, end: str):
        def add(fn: Callable[[str], ParsedTurn]) -> Callable[[str], ParsedTurn]:
            self._formats[name] = Format(name, start, end, fn)
            return fn

        return add

    def __contains__(self, name: object) -> bool:
        return name in self._formats

    def __getitem__(self, name: str) -> Format:
        if name not in self._formats:
            raise KeyError(f"unknown tool-call format '{name}'; valid: {', '.join(self.names)}")
        return self._formats[name]


FORMATS = FormatRegistry()


def _blocks(text: str, start: str, end: str) -> tuple[list[str], bool]:
    """The bodies between ``start`` and ``end`` in ``text``, in order, and whether a last ``start`` was
    never closed."""
    bodies, pos = [], 0
    while (i := text.find(start, pos)) >= 0:
        j = text.find(end, i + len(start))
        if j < 0:
            return bodies, True
        bodies.append(text[i + len(start) : j])
        pos = j + len(end)
    return bodies, False


def _unclosed(end: str) -> str:
    return f"the last tool call was never closed with {end}"


@FORMATS.register("hermes", "<tool_call>", "</tool_call>")
def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5/3); ``arguments``
    may also be a JSON string holding the object, as some models write it."""
    bodies, unclosed = _blocks(text, "<tool_call>", "</tool_call>")
    out = ParsedTurn()
    for body in bodies:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            out.invalid.append(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            out.invalid.append('the tool call has no "name" (expected {"name": ..., "arguments": {...}})')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            out.invalid.append(f'the "arguments" of the call to {call["name"]} are not a JSON object')
            continue
        out.calls.append(ToolCall(call["name"], args))
    if unclosed:
        out.invalid.append(_unclosed("</tool_call>"))
    return out


_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


@FORMATS.register("qwen3_coder", "<tool_call>", "</tool_call>")
def parse_qwen3_coder(text: str) -> ParsedTurn:
    """``<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>`` (Qwen3-Coder's
    XML style): every value is text (one newline on each side dropped), read by the tool's schema."""
    bodies, unclosed = _blocks(text, "<tool_call>", "</tool_call>")
    out = ParsedTurn()
    for body in bodies:
        match = _FUNCTION.match(body)
        if match is None:
            out.invalid.append("the tool call is not <function=NAME>...</function>")
            continue
        name, inner = match.groups()
        args: dict[str, Any] = {}
        for key, value in _PARAMETER.findall(inner):
            value = value[1:] if value.startswith("\n") else value
            args[key] = value[:-1] if value.endswith("\n") else value
        if _PARAMETER.sub("", inner).strip():
            out.invalid.append(f"the call to {name} holds text outside <parameter=NAME>...</parameter>")
            continue
        out.calls.append(ToolCall(name, args, typed=False))
    if unclosed:
        out.invalid.append(_unclosed("</tool_call>"))
    return out
