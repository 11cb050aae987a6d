"""Pure functions of the RL maths: advantage estimators, policy and value losses, KL estimators, KL
controllers, DAPO helpers.

Registries map names to functions; asking for an unknown name lists the valid ones. Nothing here does
I/O. Shapes: B sequences, T response tokens; ``mask`` is (B, T) with 1 on real response tokens.

``ADVANTAGES`` (one signature, ``fn(AdvantageInputs) -> (advantages, returns)``), ``compute_policy_loss``
and friends follow verl's ``core_algos``.
"""

from rlctl.engine.algos.core import (
    ADVANTAGES,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSS_LEVELS,
    AdvantageInputs,
    PolicyLoss,
    Registry,
    agg_loss,
    apply_kl_penalty,
    compute_policy_loss,
    compute_value_loss,
    count_nonfinite,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    masked_whiten,
    overlong_penalty,
    scores_to_token_rewards,
    tied_groups,
)
from rlctl.engine.algos.kl import (
    KL_CONTROLLER_TYPES,
    AdaptiveKLController,
    FixedKLController,
    make_kl_controller,
)

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "KL_CONTROLLER_TYPES",
    "KL_ESTIMATORS",
    "POLICY_LOSS_LEVELS",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "PolicyLoss",
    "Registry",
    "agg_loss",
    "apply_kl_penalty",
    "compute_policy_loss",
    "compute_value_loss",
    "count_nonfinite",
    "entropy_from_logits",
    "kl_penalty",
    "make_kl_controller",
    "masked_mean",
    "masked_whiten",
    "overlong_penalty",
    "scores_to_token_rewards",
    "tied_groups",
]
