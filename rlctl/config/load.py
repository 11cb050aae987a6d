"""Loading a run config: defaults <- a YAML file <- ``--set`` overrides, validated strictly.

A config file holds only what differs from the schema's defaults; ``--set a.b=VALUE`` overrides a key
with a value read as YAML and typed by the schema. The origin of every key (file and line, or the --set
flag) is kept so that a mistake is one located sentence. Policy files named by the config are checked
and inlined, so a run directory never depends on where they lived.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlctl.config.knob_values import domain, get_knob, is_float_field, lift_schedules
from rlctl.config.provenance import Provenance
from rlctl.config.schema import RunConfig
from rlctl.errors import ConfigError
from rlctl.policies.actions import AdjustAction, RollbackAction
from rlctl.policies.loader import load_policies, resolve_policy_path
from rlctl.policies.schema import Rule, rule_metrics
from rlctl.yamlsrc import NotYaml, Origins, Spelled, explain, load_yaml, origin_for, read_yaml

PACKAGED = Path(__file__).parent.parent / "configs"  # configs shipped with rlctl, picked by a bare name
BUILTIN_CONFIG = PACKAGED / "builtin.yaml"  # what `rlctl start` runs without a CONFIG
DEMO_CONFIG = PACKAGED / "demo.yaml"  # `rlctl start demo`: the showcase


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] = ()) -> RunConfig:
    """Defaults <- CONFIG (or the packaged built-in config) <- --set overrides, validated strictly. A
    CONFIG that is no file but the bare name of a packaged config (``demo``) picks that one. Policy files
    are read (relative to the config's folder, then the working directory), checked, and inlined. The
    overrides apply in order: a key given twice on the command line takes the last value."""
    source = config_source(path)
    data, origins = read_yaml(source)
    for item in overrides:
        key, value, set_origins = read_set(item)
        set_path(data, key, value, item)
        origins.update(set_origins)
    inline_tool_file(data, origins, source.parent)
    cfg = validate_config(data, origins)
    return inline_policies(cfg, source.parent)


def config_source(path: str | os.PathLike[str] | None) -> Path:
    """The file a CONFIG argument names: itself, a packaged config by bare name, or the built-in one."""
    if path is None:
        return BUILTIN_CONFIG
    source = Path(path)
    packaged = PACKAGED / f"{source.name}.yaml"
    if not source.exists() and source.name == str(path) and packaged.is_file():
        return packaged
    return source


def parse_set(item: str) -> tuple[tuple[str, ...], Any]:
    """``a.b=VALUE`` -> (("a", "b"), VALUE read as YAML 1.2); see ``read_set``."""
    key, value, _ = read_set(item)
    return key, value


def read_set(item: str) -> tuple[tuple[str, ...], Any, Origins]:
    """``a.b=VALUE`` -> (("a", "b"), VALUE read as YAML 1.2 (``no`` a string), where the key and each key
    inside VALUE came from: the flag). A VALUE that is not YAML is its text; one that gives a key twice
    (``{lr: 1, lr: 2}``) is a ConfigError."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    path, flag = tuple(key.strip().split(".")), f"--set {item}"
    try:
        value, origins = load_yaml(raw, flag, at=path, lines=False) if raw.strip() else (None, {})
    except NotYaml:
        value, origins = raw, {}
    origins[path] = flag
    if isinstance(value, bool):  # (for the sentence of a boolean where a string belongs)
        origins[path] = Spelled(flag)
        origins[path].scalar = raw.strip()
    return path, value, origins


def set_path(data: dict[str, Any], path: tuple[str, ...], value: Any, item: str) -> None:
    """Set ``path`` in ``data`` (a config file's mapping) to ``value`` for ``--set ITEM``: a mapping made
    where none is; an item of a list the config gives by its index (``tools.0.name``), which must be there.
    A list is never turned into a mapping: a part that is no index of it is a ConfigError."""
    node: Any = data
    for depth, part in enumerate(path[:-1]):
        if isinstance(node, list):
            index = _list_index(node, path[: depth + 1], item)
            if not isinstance(node[index], (dict, list)):
                node[index] = {}
            node = node[index]
            continue
        if not isinstance(node.get(part), (dict, list)) and path[depth + 1].isdigit():
            raise ConfigError(
                f"--set {item}: the config gives no list at '{'.'.join(path[: depth + 1])}' to take item "
                f"{path[depth + 1]} of; set the whole list (--set '{'.'.join(path[: depth + 1])}=[...]')"
            )
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        node = node[part]
    if isinstance(node, list):
        node[_list_index(node, path, item)] = value
    else:
        node[path[-1]] = value


def _list_index(items: list, path: tuple[str, ...], item: str) -> int:
    """The index ``path[-1]`` names in ``items`` (the list at ``path[:-1]``); else a ConfigError."""
    part, where = path[-1], ".".join(path[:-1])
    if part.isdigit() and int(part) < len(items):
        return int(part)
    span = f"0 to {len(items) - 1}" if items else "it is empty"
    raise ConfigError(
        f"--set {item}: '{where}' is a list of {len(items)} item(s), and '{part}' is none of its indices "
        f"({span}); set an item by its index, or the whole list (--set '{where}=[...]')"
    )


def validate_config(data: dict[str, Any], origins: Origins | None = None) -> RunConfig:
    """The RunConfig of already-parsed data; ConfigError with a located sentence per mistake. Knobs
    written as a schedule at their own place move to ``schedules``, and so do their origins. The config
    keeps the origins (``RunConfig.provenance``) for the sentences of the checks made before a start."""
    origins = {} if origins is None else origins
    data = lift_schedules(data, origins)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain(exc, origins, RunConfig, "invalid config")) from None
    return cfg.read_from(Provenance("invalid config", origins))


TOOLS = ("rollout", "multi_turn")


def inline_tool_file(data: dict[str, Any], origins: Origins, base_dir: Path) -> None:
    """``rollout.multi_turn.tools_file`` read (relative to the config's folder, then the working directory)
    and its ``tools`` appended to ``rollout.multi_turn.tools``, each key's origin its line in that file;
    the file's name dropped, so the run directory never depends on where it lived."""
    section = data.get("rollout", {}).get("multi_turn") if isinstance(data.get("rollout"), dict) else None
    if not isinstance(section, dict) or section.get("tools_file") is None:
        return
    name = Path(str(section["tools_file"])).expanduser()
    path = base_dir / name if not name.is_absolute() and (base_dir / name).is_file() else name
    where = f"'rollout.multi_turn.tools_file'{origin_for((*TOOLS, 'tools_file'), origins)}"
    try:
        content, file_origins = read_yaml(path, "tool file")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    extra = content.get("tools")
    if set(content) != {"tools"} or not isinstance(extra, list):
        raise ConfigError(f"{where}: {path} must hold one key, 'tools', a list of tools (as rollout.multi_turn.tools)")
    tools = section.get("tools") or []
    if not isinstance(tools, list):
        return  # the field's own error names it
    for key, origin in file_origins.items():
        if key[0] == "tools" and len(key) > 1 and key[1].isdigit():
            origins[(*TOOLS, "tools", str(len(tools) + int(key[1])), *key[2:])] = origin
    section["tools"] = [*tools, *extra]
    section["tools_file"] = None


def inline_policies(cfg: RunConfig, base_dir: Path | None) -> RunConfig:
    """Check every policy (located errors) and that it fits this run (``check_policies_fit``); replace
    file references by their contents so the run directory does not depend on where the files lived."""
    check_policies_fit(cfg, load_policies(cfg.policies, base_dir))
    inline = []
    for spec in cfg.policies:
        if isinstance(spec, dict):
            inline.append(spec)
        else:
            path = resolve_policy_path(Path(spec), base_dir)
            inline.append(read_yaml(path, "policy file")[0])
    cfg.policies = inline
    return cfg


def check_policies_fit(cfg: RunConfig, rules: list[Rule]) -> None:
    """ConfigError when a rule adjusts a setting this run does not have, multiplies or adds to a knob
    this run leaves empty, rolls back while ``checkpoint.every`` is 0 (there would be no snapshot to
    return to), or watches a validation metric in a run that never validates (it could never fire)."""
    for rule in rules:
        for action in rule.actions:
            if isinstance(action, AdjustAction):
                check_adjust_fits(cfg, rule.name, action)
            if isinstance(action, RollbackAction) and cfg.checkpoint.every == 0:
                raise ConfigError(
                    f"policy rule '{rule.name}' rolls back, but 'checkpoint.every' is 0: there would be no "
                    "snapshot to roll back to; set checkpoint.every to N > 0 (snapshot every N steps)"
                )
        check_validation_fits(cfg, rule)


def check_adjust_fits(cfg: RunConfig, rule: str, action: AdjustAction) -> None:
    """ConfigError when an adjust action names a knob that is no number field of this run's config or
    does nothing in this run (a critic setting without a critic, target_kl without the adaptive
    controller), multiplies / adds to one this run leaves empty (clip_ratio_high following clip_ratio),
    or sets it, or bounds it, outside the knob's legal values."""
    for op, verb in (("set", "sets"), ("multiply", "multiplies"), ("add", "adds to")):
        for key in getattr(action, op, None) or {}:
            if not is_float_field(RunConfig, key):
                raise ConfigError(
                    f"policy rule '{rule}' adjusts '{key}', which this run does not have "
                    f"(algorithm '{cfg.algorithm.name}' has no such setting yet)"
                )
            if (idle := cfg.algorithm.idle_knob(key)) is not None:
                raise ConfigError(f"policy rule '{rule}' {verb} {key}, but {idle}: it would do nothing")
            if op != "set" and get_knob(cfg, key) is None and key not in cfg.schedules:
                raise ConfigError(
                    f"policy rule '{rule}' {verb} {key}, which this run leaves empty{_follows(key)}; set it in "
                    "the config or use set"
                )
    _check_adjust_values(rule, action)


def _check_adjust_values(rule: str, action: AdjustAction) -> None:
    """ConfigError when an adjust action sets a knob, or bounds it (min / max), outside its legal values."""
    for op, what in (("set", "sets {key} to"), ("min", "bounds {key} with min"), ("max", "bounds {key} with max")):
        for key, value in (getattr(action, op, None) or {}).items():
            legal = domain(RunConfig, key)
            if not legal.contains(value):
                raise ConfigError(
                    f"policy rule '{rule}' {what.format(key=key)} {value:g}, outside {key}'s legal values "
                    f"({legal.describe()})"
                )


def _follows(key: str) -> str:
    """What an empty knob stands for, in words."""
    name = key.rpartition(".")[2]
    if name in ("clip_ratio_low", "clip_ratio_high"):
        return " (it follows clip_ratio)"
    return " (no dual clip)" if name == "clip_ratio_c" else ""


def check_validation_fits(cfg: RunConfig, rule: Rule) -> None:
    """ConfigError when ``rule`` watches a validation metric in a run that never validates, or rolls back
    to the best snapshot by a metric that no snapshot records (they record validation metrics only)."""
    trigger = rule.resolved_trigger
    watched = [m for m in rule_metrics(rule) if m.startswith("val/")]
    if watched and not cfg.validates:
        raise ConfigError(
            f"policy rule '{rule.name}' watches {watched[0]}, but this run never validates: "
            "set trainer.val_every to N > 0 (validate every N steps)"
        )
    to_best = any(isinstance(a, RollbackAction) and a.to == "best" for a in rule.actions)
    if to_best and not getattr(trigger, "metric", "").startswith("val/"):
        raise ConfigError(
            f"policy rule '{rule.name}' rolls back to the best snapshot by {trigger.metric}, but snapshots "
            "record validation metrics only (val/...): roll back to last-good, or watch a val/ metric"
        )
