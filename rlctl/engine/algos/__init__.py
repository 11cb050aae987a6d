"""Pure functions of the RL maths: advantage estimators, policy losses, KL estimators, KL controllers.

Registries map names to functions; asking for an unknown name lists the valid ones. Nothing here does
I/O. Shapes: B sequences, T response tokens; ``mask`` is (B, T) with 1 on real response tokens.
"""

from rlctl.engine.algos.core import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    Registry,
    agg_loss,
    count_nonfinite,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
)
from rlctl.engine.algos.kl import FixedKLController

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "FixedKLController",
    "Registry",
    "agg_loss",
    "count_nonfinite",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
]
