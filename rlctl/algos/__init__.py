"""Pure functions of the RL maths: advantage estimators, policy and value losses, KL estimators, KL
controllers, DAPO helpers, the off-policy correction against the rollout engine's log-probs.

Registries (``registry``) map names to functions; asking for an unknown name lists the valid ones.
Nothing here does I/O. Shapes: B sequences, T response tokens; ``mask`` is (B, T) with 1 on real
response tokens.

``ADVANTAGES`` (one signature, ``fn(AdvantageInputs) -> (advantages, returns)``), ``compute_policy_loss``
and friends follow verl's ``core_algos``.

The names below load on first use (PEP 562): ``rlctl.algos.registry``, which the config schema
reads its choices from, imports without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "registry": (
        "ADVANTAGES",
        "AGG_MODES",
        "GROUP_ESTIMATORS",
        "KL_CONTROLLERS",
        "KL_ESTIMATORS",
        "POLICY_LOSS_LEVELS",
        "ROLLOUT_CORRECTIONS",
        "Registry",
    ),
    "advantages": (
        "AdvantageInputs",
        "apply_kl_penalty",
        "overlong_penalty",
        "scores_to_token_rewards",
        "tied_groups",
    ),
    "divergence": ("entropy_from_logits", "kl_penalty"),
    "losses": ("PolicyLoss", "compute_policy_loss", "compute_value_loss"),
    "masked": (
        "agg_loss",
        "count_nonfinite",
        "masked_max",
        "masked_mean",
        "masked_min",
        "masked_whiten",
    ),
    "kl": ("AdaptiveKLController", "FixedKLController", "make_kl_controller"),
    "correction": ("RolloutCorrection", "rollout_correction"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _HOMES:  # a submodule asked for as an attribute: algos.masked
        return importlib.import_module(f"{__name__}.{name}")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
