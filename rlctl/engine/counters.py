"""The trainer's own counters, as a Stateful: the step, the tokens and the prompts seen, and the last
validation (which a snapshot's manifest records, and which must come back with a restore)."""

from __future__ import annotations

from typing import Any

from rlctl.stateful import check_version


class TrainerState:
    """Counters of the run and its last validation. Stateful (version 2; version 1, before validation,
    still loads)."""

    VERSION = 2

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.prompts_seen = 0
        self.last_val: dict[str, Any] | None = None  # {"step": N, "metrics": {"val/score/mean": ...}}

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "prompts_seen": self.prompts_seen,
            "last_val": self.last_val,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            check_version("trainer", state, self.VERSION)
        self.step, self.tokens_seen, self.prompts_seen = state["step"], state["tokens_seen"], state["prompts_seen"]
        self.last_val = state.get("last_val")
