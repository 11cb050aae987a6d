"""What ``rlctl resume --set`` may change (knobs of the optimisation, not the identity of the run),
and applying such changes to a run's config."""

from __future__ import annotations

from typing import Any

from rlctl.config import RunConfig, check_policies_fit, parse_set, validate_config
from rlctl.errors import ConfigError
from rlctl.policies import load_policies

SAFE_ON_RESUME = frozenset(
    {
        "trainer.total_steps",
        "trainer.num_threads",
        "trainer.lease_timeout",
        "trainer.lease_heartbeat",
        "actor.lr",
        "actor.grad_clip",
        "algorithm.kl_coef",
        "algorithm.clip_ratio",
        "rollout.temperature",
        "rollout.max_new_tokens",
        "checkpoint.every",
        "checkpoint.keep_last",
        "checkpoint.keep_every",
        "checkpoint.asynchronous",
        "checkpoint.staging_dir",
        "cluster.address",
    }
)


def apply_resume_overrides(cfg: RunConfig, overrides: list[str]) -> tuple[RunConfig, dict[str, Any]]:
    """The config with ``overrides`` (``key=value`` items) applied, and the changes as
    ``{dotted key: {"from", "to"}}``; a key outside SAFE_ON_RESUME is a ConfigError."""
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
        for part in key[:-1]:
            node = node[part]
        changes[dotted] = {"from": node.get(key[-1]), "to": value}
        node[key[-1]] = value
        origins[key] = f"--set {item}"
    new = validate_config(data, origins)
    for dotted, change in changes.items():  # record typed values
        section, name = dotted.split(".")
        change["to"] = getattr(getattr(new, section), name)
    if new.policies:  # e.g. checkpoint.every=0 under a policy that rolls back
        check_policies_fit(new, load_policies(new.policies))
    return new, changes
