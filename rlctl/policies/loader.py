"""Loading policy files (or inline dicts from a run config) into validated rules, with located errors.

Every mistake is one ConfigError sentence naming the file, the YAML line and the dotted key (list items
by index: ``rules.0.trigger.metric``), with a "did you mean" for a typo: an unknown key, an unknown
``kind`` or ``type``, an unknown adjustable setting, a misspelt choice. Never a traceback.

The sentence grammar is that of ``rlctl.config.explain``; this module has its own walker because policy
errors sit inside lists and discriminated unions, where ``explain`` cannot find the candidate names.
"""

from __future__ import annotations

import difflib
import os
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from rlctl.config import read_yaml, yaml_lines
from rlctl.errors import ConfigError
from rlctl.policies.schema import PolicyFile, Rule

Origin = str  # "default.yaml line 4"
Origins = dict[tuple[str, ...], Origin]
PolicySpec = Union[str, os.PathLike, Mapping[str, Any]]  # a path to a YAML file, or an inline policy


# --------------------------------------------------------------------------------------------------
# Public entry points


# the ready-made policies (policies/ of the source tree rlctl runs from), which a bare name picks
READY_DIR = Path(__file__).resolve().parents[2] / "policies"


def ready_policies() -> list[str]:
    """Names of the ready-made policies: ``default``, ``conservative``, ``warn-only`` ..."""
    return sorted(p.stem for p in READY_DIR.glob("*.yaml")) if READY_DIR.is_dir() else []


def load_policy_file(path: str | os.PathLike[str]) -> PolicyFile:
    """Read and validate one policy file (or ready-made policy, by name); ConfigError names the file,
    line and key of any mistake."""
    return _load_file(resolve_policy_path(Path(path), None))[0]


def _load_file(path: Path) -> tuple[PolicyFile, Origins]:
    if not path.is_file():
        names = ready_policies()
        hint = ""
        if names and len(path.parts) == 1:
            close = difflib.get_close_matches(path.stem, names, n=1)
            hint = f"; a bare name picks a ready-made policy: {', '.join(names)}"
            hint += f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"policy file not found: {path}{hint}")
    data, _ = read_yaml(path)  # YAML syntax and "not a mapping" errors, located
    origins = yaml_origins(path.read_text(), path.name)
    return validate_policy(data, origins, source=f"file {path}"), origins


def validate_policy(data: Any, origins: Origins | None = None, source: str = "(inline)") -> PolicyFile:
    """Validate an already-parsed policy (an inline mapping of a run config, or a file's contents).

    ``origins`` maps key paths (list indices as strings) to where they were written; ``source`` names
    the policy in messages ("file policies/x.yaml", "run.yaml policies.1").
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"policy {source} must be a mapping of keys to values, got {type(data).__name__}")
    try:
        policy = PolicyFile.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(explain_policy(exc, origins or {}, source)) from None
    located = [(rule, _where(("rules", str(i), "name"), origins or {})) for i, rule in enumerate(policy.rules)]
    _check_unique(located, f"invalid policy {source}: ")
    return policy


def load_policies(specs: Iterable[PolicySpec], base_dir: str | os.PathLike[str] | None = None) -> list[Rule]:
    """The rules of several policies, in order: each spec is a path to a YAML file or an inline mapping.

    A relative path is looked up in ``base_dir`` (e.g. the run config's folder) first, then in the
    current directory. Rule names must be unique across all of them.
    """
    located: list[tuple[Rule, str]] = []
    for index, spec in enumerate(specs):
        if isinstance(spec, Mapping):
            source = f"policies.{index} (inline)"
            policy = validate_policy(spec, None, source)
            located += [(rule, f"'rules.{i}.name' of {source}") for i, rule in enumerate(policy.rules)]
        else:
            policy, origins = _load_file(resolve_policy_path(Path(spec), base_dir))
            located += [(rule, _where(("rules", str(i), "name"), origins)) for i, rule in enumerate(policy.rules)]
    _check_unique(located, "invalid policies: ")
    return [rule for rule, _ in located]


def resolve_policy_path(path: Path, base_dir: str | os.PathLike[str] | None) -> Path:
    """A relative path: in ``base_dir`` (the run config's folder) first, then the current directory.
    A bare name that is neither (``default``, ``warn-only.yaml``): the ready-made policy of that name."""
    if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).is_file():
        return Path(base_dir) / path
    if path.is_file() or path.is_absolute() or len(path.parts) > 1:
        return path
    ready = READY_DIR / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    return ready if ready.is_file() else path


def _where(key: tuple[str, ...], origins: Origins) -> str:
    return f"'{'.'.join(key)}'{_origin_for(key, origins)}"


def _check_unique(located: list[tuple[Rule, str]], prefix: str) -> None:
    """ConfigError naming both places when two rules share a name."""
    seen: dict[str, str] = {}
    for rule, where in located:
        if rule.name in seen:
            raise ConfigError(
                f"{prefix}rule name '{rule.name}' is used twice: {seen[rule.name]} and {where}; "
                "rule names must be unique."
            )
        seen[rule.name] = where


# --------------------------------------------------------------------------------------------------
# Where each key was written


yaml_origins = yaml_lines  # list items by index: ("rules", "0", "trigger")


def _origin_for(key: tuple[str, ...], origins: Origins) -> str:
    for n in range(len(key), 0, -1):
        if key[:n] in origins:
            return f" ({origins[key[:n]]})"
    return ""


# --------------------------------------------------------------------------------------------------
# Following a pydantic error location through the schema's types


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


def _did_you_mean(word: Any, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


# --------------------------------------------------------------------------------------------------
# Sentences


def explain_policy(exc: ValidationError, origins: Origins, source: str, root: type[BaseModel] = PolicyFile) -> str:
    """A pydantic ValidationError of a policy as sentences: dotted key, file and line, did-you-mean."""
    errors = exc.errors()
    suggested: set[tuple[str, ...]] = set()
    sentences = [_sentence(err, origins, root, suggested) for err in errors]
    kept = [s for err, s in zip(errors, sentences) if not _explained_by_typo(err, root, suggested)]
    text = f"invalid policy {source}: " + "; ".join(kept)
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
    where = _origin_for(key, origins)
    if kind == "literal_error" and str(err["loc"][-1]) == "[key]":
        choices = _choices(tp)
        return (f"'{'.'.join(key[:-1])}'{where}: unknown setting '{key[-1]}' (one of {', '.join(choices)})"
                f"{_did_you_mean(key[-1], choices)}")  # fmt: skip
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) or kind == "value_error" else f" (got {got!r})"
    hint = _did_you_mean(got, _choices(tp)) if kind == "literal_error" else ""
    return f"'{'.'.join(key) or '(top level)'}'{where}: {msg[:1].lower() + msg[1:]}{shown}{hint}"


def _unknown_key_sentence(
    err: Any, key: tuple[str, ...], origins: Origins, root: type[BaseModel], suggested: set[tuple[str, ...]]
) -> str:
    """An unknown key, with the nearest field of the model that holds it (remembered in ``suggested``)."""
    parent = _unwrap(_walk(err["loc"][:-1], root)[1])
    fields = list(parent.model_fields) if _is_model(parent) else []
    text = f"unknown key '{'.'.join(key)}'{_origin_for(key, origins)}"
    close = difflib.get_close_matches(key[-1], fields, n=1, cutoff=0.6)
    if not close:
        return text
    suggested.add((*key[:-1], close[0]))
    return f"{text}; did you mean '{'.'.join((*key[:-1], close[0]))}'?"


def _tag_sentence(err: Any, key: tuple[str, ...], tp: Any, origins: Origins) -> str:
    """An unknown or missing ``kind`` / ``type`` of a discriminated union."""
    tagged = tagged_members(tp)
    field, tags = tagged if tagged else ("kind", {})
    names = ", ".join(tags)
    tag_key = (*key, field)
    if err["type"] == "union_tag_not_found":
        return f"'{'.'.join(key)}'{_origin_for(key, origins)}: needs '{field}' (one of {names})"
    tag = err.get("ctx", {}).get("tag")
    return (f"'{'.'.join(tag_key)}'{_origin_for(tag_key, origins)}: unknown {field} '{tag}' (one of {names})"
            f"{_did_you_mean(tag, tags)}")  # fmt: skip
