"""The names a run config may choose for the RL maths, and what each name stands for.

Each registry maps names to implementations written ``"module:attribute"``; an implementation is
imported on its first lookup, so this module (and the config schema, whose choices are built from
``Registry.names``) never imports torch. Asking for an unknown name raises a KeyError that lists the
valid ones. A mode that one function branches on (a loss aggregation mode, a policy-loss level) names
that function.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

_ADVANTAGES = "rlctl.algos.advantages"
_DIVERGENCE = "rlctl.algos.divergence"
_MASKED = "rlctl.algos.masked"
_LOSSES = "rlctl.algos.losses"
_KL = "rlctl.algos.kl"
_CORRECTION = "rlctl.algos.correction"


class Registry:
    """Names -> implementations, resolved lazily. ``names`` are the canonical names, in order (what a
    config may choose); ``aliases`` are further names a lookup accepts."""

    def __init__(self, kind: str, targets: Mapping[str, str], aliases: Mapping[str, str] | None = None):
        self.kind = kind
        self._targets = dict(targets)
        self._aliases = dict(aliases or {})
        self.names: tuple[str, ...] = tuple(self._targets)
        self._resolved: dict[str, Any] = {}

    def canonical(self, name: str) -> str:
        """The canonical name of ``name`` (an alias resolved); KeyError listing the valid names."""
        if name in self._targets:
            return name
        if name in self._aliases:
            return self._aliases[name]
        valid = ", ".join((*self.names, *self._aliases))
        raise KeyError(f"unknown {self.kind} '{name}'; valid: {valid}")

    def subset(self, *names: str) -> tuple[str, ...]:
        """Some of this registry's names, each checked, e.g. the estimators that compare a group."""
        return tuple(self.canonical(name) for name in names)

    def __contains__(self, name: object) -> bool:
        return name in self._targets or name in self._aliases

    def __getitem__(self, name: str) -> Any:
        key = self.canonical(name)
        if key not in self._resolved:
            module, _, attribute = self._targets[key].partition(":")
            self._resolved[key] = getattr(importlib.import_module(module), attribute)
        return self._resolved[key]


# fn(AdvantageInputs) -> (advantages, returns), all (B, T)
ADVANTAGES = Registry(
    "advantage estimator",
    {
        "drgrpo": f"{_ADVANTAGES}:drgrpo_outcome_advantage",
        "gae": f"{_ADVANTAGES}:gae_advantage",
        "grpo": f"{_ADVANTAGES}:grpo_outcome_advantage",
        "reinforce_plus_plus": f"{_ADVANTAGES}:reinforce_plus_plus_advantage",
        "reinforce_plus_plus_baseline": f"{_ADVANTAGES}:reinforce_plus_plus_baseline_advantage",
        "rloo": f"{_ADVANTAGES}:rloo_outcome_advantage",
    },
)

# the estimators that compare the samples of one prompt (they need a group of at least 2)
GROUP_ESTIMATORS = ADVANTAGES.subset("drgrpo", "grpo", "reinforce_plus_plus_baseline", "rloo")

# fn((B, T) log π(a|s), (B, T) log π_ref(a|s)) -> (B, T) per-token KL estimate
KL_ESTIMATORS = Registry(
    "KL estimator",
    {"k1": f"{_DIVERGENCE}:kl_k1", "k2": f"{_DIVERGENCE}:kl_k2", "k3": f"{_DIVERGENCE}:kl_k3"},
    aliases={"low_var_kl": "k3"},  # verl's name for k3
)

# how per-token losses become one number: modes of agg_loss (seq-mean-token-sum-norm divides by a constant
# horizon, rollout.max_new_tokens, in every term: policy, value, entropy, KL)
AGG_MODES = Registry(
    "loss_agg_mode",
    {
        "token-mean": f"{_MASKED}:agg_loss",
        "seq-mean-token-sum": f"{_MASKED}:agg_loss",
        "seq-mean-token-mean": f"{_MASKED}:agg_loss",
        "seq-mean-token-sum-norm": f"{_MASKED}:agg_loss",
    },
)

# where the importance ratio is taken: levels of compute_policy_loss (token: PPO, sequence: GSPO, whose policy
# loss is always aggregated as seq-mean-token-mean, as verl: core.policy_agg_mode)
POLICY_LOSS_LEVELS = Registry(
    "importance ratio level", {"token": f"{_LOSSES}:compute_policy_loss", "sequence": f"{_LOSSES}:compute_policy_loss"}
)

# the KL coefficient's controllers (classes)
KL_CONTROLLERS = Registry(
    "KL controller type", {"adaptive": f"{_KL}:AdaptiveKLController", "fixed": f"{_KL}:FixedKLController"}
)

# the off-policy corrections against the rollout engine's log-probs (algorithm.rollout_correction.mode, whose
# further choice "none" applies none): fn((B, T) ratio, (B, T) bool mask, cap) -> ((B, T) weights, (B, T) hit)
ROLLOUT_CORRECTIONS = Registry(
    "rollout correction mode", {"tis": f"{_CORRECTION}:truncated_is", "masked": f"{_CORRECTION}:masked_is"}
)
