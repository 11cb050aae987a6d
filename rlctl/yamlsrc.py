"""YAML sources and the error sentences that point into them.

Where each key of a YAML document was written (``yaml_lines``: key path -> "FILE line N"), reading a
YAML mapping with located encoding and syntax errors (``read_yaml``, ``parse_yaml_mapping``), and ONE explainer that turns a pydantic
ValidationError of any strict model (the run config, a rollback policy) into sentences: the dotted key
people wrote (list items by index, union tags left out), where it came from, and a "did you mean" for
an unknown key, an unknown ``kind`` / ``type`` of a discriminated union, or a misspelt choice.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rlctl.errors import ConfigError

Origin = str  # "demo.yaml line 4" or "--set actor.lr=..."
Origins = dict[tuple[str, ...], Origin]


# --------------------------------------------------------------------------------------------------
# Where each key was written


def yaml_lines(text: str, source: str) -> Origins:
    """Map each key path of a YAML document to 'FILE line N', list items included by index:
    ``("rules", "0", "trigger")``. Empty when the text is not valid YAML."""
    origins: Origins = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            children = [(str(k.value), k, v) for k, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            children = [(str(i), v, v) for i, v in enumerate(node.value)]
        else:
            return
        for name, marked, child in children:
            origins[(*path, name)] = f"{source} line {marked.start_mark.line + 1}"
            walk(child, (*path, name))

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return origins
    if root is not None:
        walk(root, ())
    return origins


def read_yaml(path: Path, what: str = "config file") -> tuple[dict[str, Any], Origins]:
    """A YAML file's mapping (empty for an empty file) and the origin of each key; ConfigError names
    the file (and line, or byte offset) when it is missing, unreadable, not UTF-8, not YAML or not a
    mapping. ``what`` names the kind of file in messages ("config file", "policy file")."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return parse_yaml_mapping(raw, str(path), what)


def parse_yaml_mapping(raw: bytes, source: str, what: str = "config file") -> tuple[dict[str, Any], Origins]:
    """``read_yaml`` of bytes already read from ``source`` (a path or URL): the mapping and the origin
    of each key; ConfigError naming ``source`` when they are not UTF-8, not YAML or not a mapping."""
    name = source.rstrip("/").rsplit("/", 1)[-1]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{what} {source} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} (line {line}) "
            "cannot be decoded; save it as UTF-8"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ConfigError(f"{name}{where} is not valid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must be a mapping of keys to values, got {type(data).__name__}")
    return data, yaml_lines(text, name)


def origin_for(key: tuple[str, ...], origins: Origins) -> str:
    """' (run.yaml line 4)' for the key, or for the nearest enclosing key that has an origin; else ''."""
    for n in range(len(key), 0, -1):
        if key[:n] in origins:
            return f" ({origins[key[:n]]})"
    return ""


def closest(word: Any, candidates: Iterable[str]) -> str | None:
    """The candidate nearest to ``word`` (difflib, ratio >= 0.6), if any."""
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: Any, candidates: Iterable[str]) -> str:
    """ "; did you mean 'X'?" for the candidate nearest to ``word``, or ''."""
    close = closest(word, candidates)
    return f"; did you mean '{close}'?" if close else ""


# --------------------------------------------------------------------------------------------------
# Following a pydantic error location through a model's types


def _unwrap(tp: Any) -> Any:
    """Strip Annotated[...] and Optional[...] until something else shows."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
            continue
        if get_origin(tp) in (Union, types.UnionType):
            members = [a for a in get_args(tp) if a is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
        return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def tagged_members(tp: Any) -> tuple[str, dict[str, type[BaseModel]]] | None:
    """For a discriminated union of models: (discriminator field, {tag: model}); else None."""
    tp = _unwrap(tp)
    if get_origin(tp) not in (Union, types.UnionType):
        return None
    members = get_args(tp)
    if not members or not all(_is_model(m) for m in members):
        return None
    for name in members[0].model_fields:
        if all(_is_literal_field(m, name) for m in members):
            return name, {get_args(m.model_fields[name].annotation)[0]: m for m in members}
    return None


def _is_literal_field(model: type[BaseModel], name: str) -> bool:
    field = model.model_fields.get(name)
    return field is not None and get_origin(field.annotation) is Literal


def _step(tp: Any, part: str) -> tuple[Any, bool]:
    """One location part down from type ``tp``: (the type there, whether the part is shown to people).
    A union's tag is not shown; nor is the '[key]' that pydantic puts after a dict key it rejects."""
    tp = _unwrap(tp)
    tagged = tagged_members(tp)
    if tagged is not None:
        return (tagged[1][part], False) if part in tagged[1] else (None, True)
    if _is_model(tp):
        field = tp.model_fields.get(part)
        return (field.annotation if field else None), True
    origin, args = get_origin(tp), get_args(tp)
    if origin in (list, tuple) and args:
        return args[0], True
    if origin is dict and args:
        return args[1], True
    return None, True


def _walk(loc: tuple[Any, ...], root: type[BaseModel]) -> tuple[tuple[str, ...], Any]:
    """(the dotted key people see, the type found there) for a pydantic error location. For a rejected
    dict key (``(..., "set", "actor.lrr", "[key]")``) the type is the dict's key type."""
    shown: list[str] = []
    tp: Any = root
    parts = [str(p) for p in loc]
    for i, part in enumerate(parts):
        if part == "[key]":
            continue
        if i + 1 < len(parts) and parts[i + 1] == "[key]" and get_origin(_unwrap(tp)) is dict:
            tp, visible = get_args(_unwrap(tp))[0], True
        else:
            tp, visible = _step(tp, part)
        if visible:
            shown.append(part)
    return tuple(shown), tp


def _choices(tp: Any) -> list[str]:
    tp = _unwrap(tp)
    return [str(a) for a in get_args(tp)] if get_origin(tp) is Literal else []


# --------------------------------------------------------------------------------------------------
# Sentences


def explain(exc: ValidationError, origins: Origins, root: type[BaseModel], lead: str) -> str:
    """A pydantic ValidationError of ``root`` as one text: ``lead`` ("invalid config", "invalid policy
    file x.yaml"), then a sentence per error naming the dotted key, where it was written (file and
    line, or the --set flag) and the nearest valid name of a misspelt one."""
    errors = exc.errors()
    suggested: set[tuple[str, ...]] = set()
    sentences = [_sentence(err, origins, root, suggested) for err in errors]
    kept = [s for err, s in zip(errors, sentences, strict=True) if not _explained_by_typo(err, root, suggested)]
    text = f"{lead}: " + "; ".join(kept)
    return text if text.endswith(("?", ".")) else text + "."


def _explained_by_typo(err: Any, root: type[BaseModel], suggested: set[tuple[str, ...]]) -> bool:
    """A 'field required' whose key an unknown key's did-you-mean already names says nothing new."""
    return err["type"] == "missing" and _walk(err["loc"], root)[0] in suggested


def _sentence(err: Any, origins: Origins, root: type[BaseModel], suggested: set[tuple[str, ...]]) -> str:
    key, tp = _walk(err["loc"], root)
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_key_sentence(err, key, origins, root, suggested)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return _tag_sentence(err, key, tp, origins)
    where = origin_for(key, origins)
    if kind == "literal_error" and str(err["loc"][-1]) == "[key]":
        choices = _choices(tp)
        return (
            f"'{'.'.join(key[:-1])}'{where}: unknown setting '{key[-1]}' (one of {', '.join(choices)})"
            f"{did_you_mean(key[-1], choices)}"
        )
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) or kind == "value_error" else f" (got {got!r})"
    hint = did_you_mean(got, _choices(tp)) if kind == "literal_error" else ""
    return f"'{'.'.join(key) or '(top level)'}'{where}: {msg[:1].lower() + msg[1:]}{shown}{hint}"


def _unknown_key_sentence(
    err: Any, key: tuple[str, ...], origins: Origins, root: type[BaseModel], suggested: set[tuple[str, ...]]
) -> str:
    """An unknown key, with the nearest field of the model that holds it (remembered in ``suggested``)."""
    parent = _unwrap(_walk(err["loc"][:-1], root)[1])
    fields = list(parent.model_fields) if _is_model(parent) else []
    text = f"unknown key '{'.'.join(key)}'{origin_for(key, origins)}"
    close = closest(key[-1], fields)
    if close is None:
        return text
    suggested.add((*key[:-1], close))
    return f"{text}; did you mean '{'.'.join((*key[:-1], close))}'?"


def _tag_sentence(err: Any, key: tuple[str, ...], tp: Any, origins: Origins) -> str:
    """An unknown or missing ``kind`` / ``type`` of a discriminated union."""
    tagged = tagged_members(tp)
    field, tags = tagged if tagged else ("kind", {})
    names = ", ".join(tags)
    tag_key = (*key, field)
    if err["type"] == "union_tag_not_found":
        return f"'{'.'.join(key)}'{origin_for(key, origins)}: needs '{field}' (one of {names})"
    tag = err.get("ctx", {}).get("tag")
    return (
        f"'{'.'.join(tag_key)}'{origin_for(tag_key, origins)}: unknown {field} '{tag}' (one of {names})"
        f"{did_you_mean(tag, tags)}"
    )
