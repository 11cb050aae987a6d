"""What ``rlctl resume --set`` may change (``rlctl.policies.knobs.SAFE_ON_RESUME``: the knobs and a few
settings of the process, not the identity of the run), and applying such changes to a run's config.

A knob set to a number replaces its schedule, if it had one; set to ``{schedule: [...]}`` it gets one."""

from __future__ import annotations

from typing import Any

from rlctl.config import Provenance, RunConfig, check_policies_fit, parse_set, validate_config
from rlctl.config.knob_values import get_knob
from rlctl.errors import ConfigError
from rlctl.policies import load_policies
from rlctl.policies.knobs import KNOBS, SAFE_ON_RESUME

__all__ = ["SAFE_ON_RESUME", "apply_resume_overrides"]


def apply_resume_overrides(cfg: RunConfig, overrides: list[str]) -> tuple[RunConfig, dict[str, Any]]:
    """The config with ``overrides`` (``key=value`` items) applied, and the changes as
    ``{dotted key: {"from", "to"}}``; a key outside SAFE_ON_RESUME, or a knob this run does not use (a
    critic setting without a critic, target_kl without the adaptive controller), is a ConfigError."""
    data = cfg.model_dump(mode="json")
    changes: dict[str, Any] = {}
    origins = {}
    for item in overrides:
        key, value = parse_set(item)
        dotted = ".".join(key)
        if dotted not in SAFE_ON_RESUME:
            raise ConfigError(
                f"'{dotted}' cannot change on resume: the run would no longer continue the same training. "
                f"Keys that can: {', '.join(sorted(SAFE_ON_RESUME))}"
            )
        node = data
        for depth, part in enumerate(key[:-1]):
            if node.get(part) is None:  # an optional section the run does not have (rollout.multi_turn)
                raise ConfigError(f"'{dotted}' cannot be set: this run has no '{'.'.join(key[: depth + 1])}'")
            node = node[part]
        changes[dotted] = {"from": node.get(key[-1]), "to": value}
        node[key[-1]] = value
        if not isinstance(value, dict):  # a number replaces the knob's schedule
            data.get("schedules", {}).pop(dotted, None)
        origins[key] = f"--set {item}"
    new = validate_config(data, origins)
    new.read_from(Provenance(cfg.provenance.lead, {**cfg.provenance.origins, **origins}))
    for dotted in changes:
        if (idle := new.algorithm.idle_knob(dotted)) is not None:
            raise ConfigError(f"'--set {dotted}' would do nothing: {idle}")
    for dotted, change in changes.items():  # record typed values
        sched = new.schedules.get(dotted)
        change["to"] = sched.model_dump(mode="json") if isinstance(change["to"], dict) else get_knob(new, dotted)
    if new.policies:  # e.g. checkpoint.every=0 under a policy that rolls back
        check_policies_fit(new, load_policies(new.policies))
    # a setting given its value again (a requeued job naming its Ray head) is no change; a knob is (a policy
    # may have moved it since the config was written: the value given is set anew)
    return new, {k: c for k, c in changes.items() if k in KNOBS or c["from"] != c["to"]}
