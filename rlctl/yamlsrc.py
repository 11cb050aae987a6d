"""YAML sources and the error sentences that point into them.

ONE strict reader for every YAML text rlctl reads (``load_yaml``; files: ``read_yaml``,
``parse_yaml_mapping``): where each key was written (key path -> "FILE line N"), located encoding and
syntax errors, and a key given twice in one mapping refused with both lines. It is ruamel.yaml's
(maintained, YAML 1.2, its node tree carries every line): what people write is read as YAML 1.2, where
``yes``/``no``/``on``/``off`` are strings and ``1e-3`` a number; what rlctl wrote itself with PyYAML's
emitter (a run's config.yaml) as the YAML 1.1 that wrote it, so an older run reads as it did. And ONE
explainer that turns a pydantic of any strict model (the run config, a rollback policy) into sentences: the dotted key people wrote (list items by index, union tags left out), where it came from, and a "did you mean" for
an unknown key, an unknown ``kind`` / ``type`` of a discriminated union, or a misspelt choice.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from ruamel.yaml.resolver import VersionedResolver

from rlctl.errors import ConfigError

Origin = str  # "demo.yaml line 4" or "--set actor.lr=..."
Origins = dict[tuple[str, ...], Origin]

PEOPLE = "1.2"  # configs, policies, tool files, --set values: YAML 1.2, where yes/no/on/off are strings
SAVED = "1.1"  # what rlctl wrote itself (a run's config.yaml, a rank's spec): PyYAML's emitter, YAML 1.1
_BOOL = "tag:yaml.org,2002:bool"


class NotYaml(ConfigError):
    """Text that is not YAML; ``line`` (1-based, or None) and ``problem`` for a caller's own sentence."""

    def __init__(self, source: str, line: int | None, problem: str):
        super().__init__(f"{source}{f' line {line}' if line else ''} is not valid YAML: {problem}")
        self.line, self.problem = line, problem


class Spelled(str):
    """An origin ("run.yaml line 4") of a value that YAML read as a boolean, with how it was written
    there (``scalar``: "no", "True"), for the sentence of a boolean where a string belongs."""

    scalar: str = ""


class _WrittenByRlctl(VersionedResolver):
    """YAML 1.1 exactly as PyYAML reads it (PyYAML's own table of plain scalars: ``1e-3`` a string,
    ``yes`` a boolean), for the files rlctl wrote with PyYAML's emitter, which quotes by that table."""

    _TABLE = {first: list(rules) for first, rules in yaml.resolver.Resolver.yaml_implicit_resolvers.items()}

    @property
    def versioned_resolver(self) -> Any:
        return self._TABLE

    @property
    def processing_version(self) -> Any:
        return (1, 1)


class _SavedDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # (libyaml's emitter where PyYAML has it)
    """PyYAML's emitter, quoting also the strings that YAML 1.2 would read as numbers (``1e5``, ``0o17``),
    so that a saved config.yaml reads the same as YAML 1.1 (rlctl) and as YAML 1.2 (a CONFIG file)."""


_SavedDumper.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9_]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+0123456789."),
)
_SavedDumper.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?0(?:o[0-7_]+|x[0-9a-fA-F_]+)$"), list("-+0")
)


def dump_saved(data: Any) -> str:
    """``data`` (plain Python) as the YAML rlctl saves (a run's config.yaml): keys in their order."""
    return yaml.dump(data, Dumper=_SavedDumper, sort_keys=False)


def _reader(dialect: str) -> YAML:
    reader = YAML(typ="safe", pure=True)
    if dialect == SAVED:
        reader.Resolver = _WrittenByRlctl
    else:
        reader.version = (1, 2)
    return reader


def load_yaml(
    text: str, source: str, dialect: str = PEOPLE, at: tuple[str, ...] = (), lines: bool = True
) -> tuple[Any, Origins]:
    """The document in ``text`` (None when empty), read as ``dialect`` (``PEOPLE``: YAML 1.2; ``SAVED``:
    rlctl's own YAML 1.1), and where each key was written: key path (list items by index, under ``at``)
    -> "SOURCE line N" (without ``lines``, as for a --set flag: "SOURCE"). NotYaml names the line of a syntax error; a key given
    twice in one mapping is a ConfigError naming its dotted path and both lines, never the last word."""
    reader = _reader(dialect)
    try:
        root = reader.compose(text)
        origins = _origins(root, source, at, lines)
        return (None if root is None else reader.constructor.construct_document(root)), origins
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise NotYaml(source, mark.line + 1 if mark else None, problem) from None


def _origins(root: Node | None, source: str, at: tuple[str, ...], lines: bool) -> Origins:
    """Where each key path of the tree under ``root`` was written; a key repeated in a mapping refused."""
    origins: Origins = {}

    def walk(node: Node, path: tuple[str, ...]) -> None:
        if isinstance(node, MappingNode):
            children = _mapping_children(node, path, source, lines)
        elif isinstance(node, SequenceNode):
            children = [(str(i), v.start_mark.line + 1, v) for i, v in enumerate(node.value)]
        else:
            return
        for name, line, child in children:
            origin = f"{source} line {line}" if lines else source
            if isinstance(child, ScalarNode) and str(child.tag) == _BOOL:
                origin = Spelled(origin)
                origin.scalar = child.value
            origins[(*path, name)] = origin
            walk(child, (*path, name))

    if root is not None:
        walk(root, at)
    return origins


def _mapping_children(
    node: MappingNode, path: tuple[str, ...], source: str, lines: bool
) -> list[tuple[str, int, Node]]:
    """(key, its line, value) of each entry; ConfigError for a key written twice (same tag, same text),
    naming ``source`` and, in a text of several ``lines``, both lines."""
    children: list[tuple[str, int, Node]] = []
    seen: dict[tuple[str, str], int] = {}
    for key, value in node.value:
        line = key.start_mark.line + 1
        if isinstance(key, ScalarNode):
            ident = (str(key.tag), key.value)
            if ident in seen:
                first, dotted = seen[ident], ".".join((*path, str(key.value)))
                twice = f"twice on line {line}" if first == line else f"twice: line {first} and line {line}"
                said = f"'{dotted}' is given {twice if lines else 'twice'}"
                raise ConfigError(f"{source}: {said}; a key is written once in a mapping: keep one")
            seen[ident] = line
        children.append((str(key.value), line, value))
    return children


def read_yaml(path: Path, what: str = "config file") -> tuple[dict[str, Any], Origins]:
    """A YAML file's mapping (empty for an empty file) and the origin of each key; ConfigError names
    the file (and line, or byte offset) when it is missing, unreadable, not UTF-8, not YAML, not a
    mapping, or gives a key twice in one mapping. ``what`` names the kind of file in messages."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return parse_yaml_mapping(raw, str(path), what)


def parse_yaml_mapping(raw: bytes, source: str, what: str = "config file") -> tuple[dict[str, Any], Origins]:
    """``read_yaml`` of bytes already read from ``source`` (a path or URL), as YAML 1.2: the mapping and
    the origin of each key; ConfigError naming ``source`` when they are not UTF-8, not YAML (a key given
    twice included) or not a mapping."""
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
        data, origins = load_yaml(text, name)
    except NotYaml as exc:
        raise ConfigError(exc.message) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must be a mapping of keys to values, got {type(data).__name__}")
    return data, origins


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
    if kind == "string_type" and isinstance(err.get("input"), bool):
        return f"'{'.'.join(key)}'{where}: {_read_as_boolean(key, err['input'], origins)}"
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) or kind == "value_error" else f" (got {got!r})"
    hint = did_you_mean(got, _choices(tp)) if kind == "literal_error" else ""
    return f"'{'.'.join(key) or '(top level)'}'{where}: {msg[:1].lower() + msg[1:]}{shown}{hint}"


def _read_as_boolean(key: tuple[str, ...], value: bool, origins: Origins) -> str:
    """A boolean where a string belongs: YAML read a plain word as one ("`no` was read as ...")."""
    spelled = origins.get(key)
    word = spelled.scalar if isinstance(spelled, Spelled) else ""
    said = (
        f"`{word}` was read as the boolean {str(value).lower()}; quote it ('{word}')"
        if word
        else (f"the value was read as the boolean {str(value).lower()}; quote it")
    )
    return f"a string is expected, but {said}"


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
