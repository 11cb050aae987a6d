"""KL coefficient controllers. Stateful: the coefficient is part of every snapshot."""

from __future__ import annotations

from typing import Any

from rlctl.checkpoint import check_version


class FixedKLController:
    VERSION = 1

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed controller keeps its coefficient."""

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.VERSION, "type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("KL controller", state, self.VERSION)
        self.value = float(state["value"])
