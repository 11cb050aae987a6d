"""The trainer's own counters, as a Stateful: the step, the tokens and the prompts seen."""

from __future__ import annotations

from typing import Any

from rlctl.stateful import check_version


class TrainerState:
    """Counters of the run. Stateful."""

    VERSION = 1

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.prompts_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "prompts_seen": self.prompts_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("trainer", state, self.VERSION)
        self.step, self.tokens_seen, self.prompts_seen = state["step"], state["tokens_seen"], state["prompts_seen"]
