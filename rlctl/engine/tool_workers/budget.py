"""``rollout.multi_turn.tool_retry_budget``: how many steps in a row the tools may be down before the run
ends as a preemption does (exit 75: resume me), rather than training on, step after step, on
conversations that are all masked out.

A step counts when its tool calls ran (at least one) and every one of them ended in an infrastructure
failure (timed out or unavailable), read from the step's metric row, which is reduced over the ranks, so
every rank decides alike. A malformed call never reaches a tool and does not count either way; on
several ranks, a step counts only when every rank ran a call (the mean of the ranks' shares). Any other
step ends the streak. The count lives in the process: it starts again at a resume (the outage may be
over), and a step trained again after a rollback counts again.
"""

from __future__ import annotations

from typing import Any

from rlctl.events import TOOLS_UNAVAILABLE

TOLERANCE = 1e-9  # the shares are ratios of counts: equal counts may differ in the last bits


def tools_down(row: dict[str, Any]) -> bool:
    """Whether the step of ``row`` ran tool calls and every one ended in an infrastructure failure: the
    timed-out and unavailable shares of its calls make up all of the well-formed ones."""
    try:
        calls = float(row.get("tool/calls/mean", 0.0))
        infra = float(row.get("tool/timeout_frac", 0.0)) + float(row.get("tool/unavailable_frac", 0.0))
        ran = 1.0 - float(row.get("tool/invalid_call_frac", 0.0))
    except (TypeError, ValueError):
        return False
    return calls > 0 and ran > TOLERANCE and infra >= ran - TOLERANCE


class ToolRetryBudget:
    """The streak of steps whose tools were down (``tools_down``) against the budget."""

    def __init__(self, budget: int):
        self.budget = budget
        self.streak = 0

    def stops(self, row: dict[str, Any], total: int, emit) -> bool:
        """Count the step of ``row``; whether the run should stop after it (the streak past the budget, the
        run not over anyway), said in a ``tools_unavailable`` event."""
        if not self.spent(row) or row["step"] >= total:
            return False
        emit({"event": TOOLS_UNAVAILABLE, "step": row["step"], "steps": self.streak, "budget": self.budget})
        return True

    def spent(self, row: dict[str, Any]) -> bool:
        """Count the step of ``row``; whether the streak now exceeds the budget (the run should end)."""
        self.streak = self.streak + 1 if tools_down(row) else 0
        return self.streak > self.budget
