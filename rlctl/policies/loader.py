"""Loading policy files (or inline dicts from a run config) into validated rules, with located errors.

Every mistake is one ConfigError sentence naming the file, the YAML line and the dotted key (list items
by index: ``rules.0.trigger.metric``), with a "did you mean" for a typo: an unknown key, an unknown
``kind`` or ``type``, an unknown knob, a misspelt choice; a malformed ``when`` expression adds its column
and a caret line under the spot. Never a traceback.

The sentences are ``rlctl.yamlsrc.explain``'s, the same as the run config's. A bare name (``default``)
picks a ready-made policy shipped in the package (``rlctl/policies/ready/``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlctl.errors import ConfigError
from rlctl.policies.schema import PolicyFile, PolicySpec, Rule
from rlctl.yamlsrc import Origins, closest, explain, origin_for, read_yaml

# the ready-made policies, shipped inside the package (the repository's policies/ links here); a bare
# name picks one
READY_DIR = Path(__file__).resolve().parent / "ready"


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
            close = closest(path.stem, names)
            hint = f"; a bare name picks a ready-made policy: {', '.join(names)}"
            hint += f" (did you mean '{close}'?)" if close else ""
        raise ConfigError(f"policy file not found: {path}{hint}")
    data, origins = read_yaml(path, "policy file")  # encoding, YAML syntax and "not a mapping" errors, located
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
        raise ConfigError(explain(exc, origins or {}, PolicyFile, f"invalid policy {source}")) from None
    located = [(rule, _where(("rules", str(i), "name"), origins or {})) for i, rule in enumerate(policy.rules)]
    _check_unique(located, f"invalid policy {source}: ")
    return policy


def load_policies(
    specs: Iterable[PolicySpec | os.PathLike[str]], base_dir: str | os.PathLike[str] | None = None
) -> list[Rule]:
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
    return f"'{'.'.join(key)}'{origin_for(key, origins)}"


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
