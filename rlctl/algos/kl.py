"""KL coefficient controllers. Stateful: the coefficient is part of every snapshot."""

from __future__ import annotations

from typing import Any

from rlctl.algos.registry import KL_CONTROLLERS
from rlctl.stateful import check_version


def _check_type(state: dict[str, Any], expected: str) -> None:
    found = state.get("type")
    if found != expected:
        raise ValueError(
            f"KL controller state is of type {found!r}, this controller is {expected!r}; "
            "the run's algorithm.kl_ctrl.type must match the snapshot's"
        )


class FixedKLController:
    """The coefficient stays at ``kl_coef``."""

    VERSION = 1

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed controller keeps its coefficient."""

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.VERSION, "type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("KL controller", state, self.VERSION)
        _check_type(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. (2019)'s proportional controller, as verl: the coefficient moves so that the
    observed KL approaches ``target_kl``, by at most 20% per ``horizon`` samples.

    update(kl, n): error = clip(kl / target_kl - 1, -0.2, 0.2); value *= 1 + error * n / horizon.
    """

    VERSION = 1

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"adaptive KL controller needs target_kl > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon}")
        self.value = kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """``current_kl``: the batch's KL (``apply_kl_penalty``'s second value); ``n_steps``: samples
        it was measured on (verl passes the batch size)."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "type": "adaptive",
            "value": self.value,
            "target_kl": self.target_kl,
            "horizon": self.horizon,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the coefficient. ``target_kl`` and ``horizon`` are recorded for inspection only: the
        constructor's (the config's) stay in force, so a resume with a new target steers toward it."""
        check_version("KL controller", state, self.VERSION)
        _check_type(state, "adaptive")
        self.value = float(state["value"])


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """The controller named by ``type`` (verl's ``get_kl_controller``); adaptive needs target_kl and
    horizon > 0. An unknown type lists the valid ones."""
    if KL_CONTROLLERS.canonical(type) == "fixed":
        return FixedKLController(kl_coef)
    if target_kl is None or horizon is None:
        raise ValueError("an adaptive KL controller needs target_kl and horizon")
    return AdaptiveKLController(kl_coef, target_kl, horizon)
