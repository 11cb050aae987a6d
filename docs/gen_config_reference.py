"""Write docs/config-reference.md from the run config's schema: every key, its type, default and the
description the schema gives it, one section per config section.

    .venv/bin/python docs/gen_config_reference.py           # rewrite the page
    .venv/bin/python docs/gen_config_reference.py --check   # exit 1 if the page differs from the schema

The page is never edited by hand: change a field's description in the schema and run this again.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from _generated import cell, check_main
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rlctl.config import RunConfig

PAGE = Path(__file__).resolve().parent / "config-reference.md"

HEADER = """\
# Config reference

Every key of a run config, generated from the schema's own field descriptions by
[`gen_config_reference.py`](gen_config_reference.py) (`.venv/bin/python docs/gen_config_reference.py`
rewrites this page; a test fails when it differs from the schema). Do not edit it by hand.

A config file holds only what differs from these defaults. `rlctl start --set KEY=VALUE` and
`rlctl resume --set KEY=VALUE` take the same dotted keys ([which ones a resume may change](knobs-and-schedules.md#rlctl-resume---set)).
"Empty" is YAML's `null` (or leaving the key out). In a key, `[i]` is any entry of a list and `<knob>` any
[knob](knobs-and-schedules.md).

## What the loader accepts

Every YAML file rlctl reads (a run config, a policy, a tool file, a `--set` value, a run's saved
`config.yaml`) goes through one strict reader, built on [ruamel.yaml](https://pypi.org/project/ruamel.yaml/):
a maintained YAML 1.2 library whose node tree carries the line of every key, so a mistake names its
file, line and dotted key without parsing of rlctl's own.

- **A key given twice in one mapping is an error** (exit 3, before any work), never the last value:
  `run.yaml: 'actor.lr' is given twice: line 2 and line 4; a key is written once in a mapping: keep one`.
  The same holds for a policy (two `when:` lines in one rule), a tool file and a `--set` value
  (`--set 'actor={lr: 1, lr: 2}'`). Two `--set` flags for one key are not: the last one wins.
- **Files you write are YAML 1.2**: `yes`, `no`, `on`, `off`, `y` and `n` are strings (a stop string
  `no` needs no quotes); only `true` and `false` (or `True`, `FALSE` ...) are booleans; `1e-3` is a number, as is `0o17`
  (octal; `017` is 17). A file that starts with `%YAML 1.1` is read as YAML 1.1. A boolean where a string belongs
  says so: `` `True` was read as the boolean true; quote it ('True') ``.
- **A run's `config.yaml`** is written by rlctl (PyYAML's emitter, which quotes by YAML 1.1's rules)
  and read back as that same YAML 1.1, plain scalars resolved by PyYAML's own table, so a run written by
  an older rlctl loads exactly as it did (a stop string `1e5` or `0o17`, which PyYAML leaves unquoted,
  stays a string). It is read as strictly: a key given twice there is an error naming the file. rlctl
  now also quotes the strings YAML 1.2 would read as numbers (`'1e5'`), so a saved `config.yaml` reads
  the same as a CONFIG file of a new run.
"""

Row = tuple[str, str, str, str]


def _args(ann: Any) -> tuple[Any, ...]:
    return typing.get_args(ann)


def _is_union(ann: Any) -> bool:
    return typing.get_origin(ann) in (typing.Union, types.UnionType)


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _strip_none(ann: Any) -> tuple[Any, bool]:
    """The annotation without ``None``, and whether ``None`` was allowed."""
    if _is_union(ann):
        rest = [a for a in _args(ann) if a is not type(None)]
        if len(rest) < len(_args(ann)):
            return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True  # noqa: UP007
    return ann, False


def type_name(ann: Any) -> str:
    """A type in words a YAML writer reads: ``int``, ``one of: a, b``, ``list of str``, ``mapping``."""
    ann, optional = _strip_none(ann)
    origin = typing.get_origin(ann)
    if ann is Any:
        text = "any"
    elif _is_model(ann):
        text = "mapping"
    elif origin is Literal:
        text = "one of: " + ", ".join(str(a) for a in _args(ann))
    elif _is_union(ann):
        text = " or ".join(type_name(a) for a in _args(ann))
    elif origin in (list, tuple):
        inner = _args(ann)
        if origin is tuple and inner and inner[-1] is not Ellipsis:
            text = "[" + ", ".join(type_name(a) for a in inner) + "]"
        else:
            text = "list of " + (type_name(inner[0]) + ("s" if _is_model(inner[0]) else "") if inner else "any")
    elif origin is dict:
        key, value = _args(ann)
        key_text = "knob" if typing.get_origin(key) is Literal and len(_args(key)) > 6 else type_name(key)
        text = f"mapping of {key_text} to {type_name(value)}"
    else:
        text = getattr(ann, "__name__", str(ann))
    return text + (", or empty" if optional else "")


def limits(field: FieldInfo) -> str:
    """The field's numeric bounds and minimum length, as ``>= 1`` or ``> 0 and < 1``."""
    words = []
    for meta in field.metadata:
        for kind, attr, sign in (
            (annotated_types.Gt, "gt", ">"),
            (annotated_types.Ge, "ge", ">="),
            (annotated_types.Lt, "lt", "<"),
            (annotated_types.Le, "le", "<="),
        ):
            if isinstance(meta, kind):
                words.append(f"{sign} {getattr(meta, attr)}")
        if isinstance(meta, annotated_types.MinLen):
            words.append("not empty" if meta.min_length == 1 else f"at least {meta.min_length} long")
    return " and ".join(words)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "empty"
    if isinstance(value, BaseModel):
        return "its keys' defaults"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, (list, tuple, dict)):
        return "`" + json.dumps(_plain(value)) + "`"
    return f"`{value}`"


def row(key: str, field: FieldInfo) -> Row:
    kind = type_name(field.annotation)
    if bound := limits(field):
        kind += f", {bound}"
    return f"`{key}`", cell(kind), cell(default_text(field)), cell(field.description or "")


def nested(ann: Any) -> tuple[type[BaseModel], str] | None:
    """The model a field's keys continue into, and the key segment that leads there: ``""`` for a
    section, ``[i]`` for a list of them, ``.<knob>`` for a mapping to them."""
    ann, _ = _strip_none(ann)
    if _is_model(ann):
        return ann, ""
    origin = typing.get_origin(ann)
    if origin is list and _is_model(_args(ann)[0]):
        return _args(ann)[0], "[i]"
    if origin is dict and _is_model(_args(ann)[1]):
        key = _args(ann)[0]
        return _args(ann)[1], ".<knob>" if typing.get_origin(key) is Literal else ".<key>"
    return None


def rows(model: type[BaseModel], prefix: str) -> list[Row]:
    """One row per key of ``model`` and, depth first, of the models its fields hold."""
    out: list[Row] = []
    for name, field in model.model_fields.items():
        key = prefix + name
        out.append(row(key, field))
        if inner := nested(field.annotation):
            sub, segment = inner
            out += rows(sub, f"{key}{segment}.")
    return out


def table(body: list[Row]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    return lines + [f"| {' | '.join(r)} |" for r in body]


def render() -> str:
    top: list[Row] = []
    sections: list[str] = []
    for name, field in RunConfig.model_fields.items():
        inner = nested(field.annotation)
        if inner is None:
            top.append(row(name, field))
            continue
        sub, segment = inner
        body = [row(name, field)] if segment else []
        body += rows(sub, f"{name}{segment}.")
        sections += ["", f"## `{name}`", "", cell(field.description or ""), "", *table(body)]
    head = ["", "## Top level", "", "Keys at the top of the file.", "", *table(top)]
    return HEADER + "\n".join(head + sections) + "\n"


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, __doc__, PAGE, lambda _page: render(), "the schema", "gen_config_reference.py")


if __name__ == "__main__":
    sys.exit(main())
