"""The trainer's own counters, as a Stateful: the step, the tokens and the prompts seen, and the last
validation (which a snapshot's manifest records, and which must come back with a restore)."""

from __future__ import annotations

from typing import Any

from rlctl.stateful import check_version


class TrainerState:
    """Counters of the run, its last validation, and the actor's micro-batch token budget chosen at the
    run's start (on a GPU with neither actor.micro_batch_size nor max_tokens_per_micro_batch set; None
    otherwise), which every resume keeps so that the update cuts its batches as the run always did.
    Stateful (version 3; versions 1, before validation, and 2, before the budget, still load: those runs
    had no budget)."""

    VERSION = 3

    def __init__(self, token_budget: int | None = None) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.prompts_seen = 0
        self.last_val: dict[str, Any] | None = None  # {"step": N, "metrics": {"val/score/mean": ...}}
        self.token_budget = token_budget

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "prompts_seen": self.prompts_seen,
            "last_val": self.last_val,
            "token_budget": self.token_budget,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") not in (1, 2):
            check_version("trainer", state, self.VERSION)
        self.step, self.tokens_seen, self.prompts_seen = state["step"], state["tokens_seen"], state["prompts_seen"]
        self.last_val = state.get("last_val")
        self.token_budget = state.get("token_budget")
