"""rollout.multi_turn.tool_retry_budget's decision (rlctl/engine/tool_workers/budget.py): a step counts when it ran
tool calls and every one ended in an infrastructure failure, read from its metric row (reduced over the
ranks); the run ends at the first step that makes the streak exceed the budget."""

from rlctl.engine.tool_workers.budget import ToolRetryBudget, tools_down


def row(calls=1.0, timeout=0.0, unavailable=0.0, invalid=0.0, error=0.0):
    return {
        "tool/calls/mean": calls,
        "tool/timeout_frac": timeout,
        "tool/unavailable_frac": unavailable,
        "tool/invalid_call_frac": invalid,
        "tool/error_frac": error,
    }


def test_a_step_counts_when_every_call_that_ran_failed_in_the_infrastructure():
    assert tools_down(row(unavailable=1.0))
    assert tools_down(row(timeout=0.25, unavailable=0.75))
    assert tools_down(row(unavailable=2 / 3, invalid=1 / 3))  # the malformed call reached no tool
    assert tools_down(row(timeout=0.1 + 0.2, unavailable=0.7 - 1e-12))  # shares of counts, rounded
    assert not tools_down(row(unavailable=0.75))  # one call in four answered
    assert not tools_down(row(unavailable=0.5, error=0.5))  # a tool that raised did answer
    assert not tools_down(row(calls=0.0))  # no call: nothing says the tools are down
    assert not tools_down(row(invalid=1.0))  # only malformed calls: no tool was asked
    assert not tools_down({"step": 3})  # a run without tools
    assert not tools_down(row(calls=float("nan"), unavailable=1.0))


def test_the_run_ends_at_the_first_step_past_the_budget_and_any_other_step_ends_the_streak():
    down, up = row(unavailable=1.0), row()
    budget = ToolRetryBudget(2)
    assert [budget.spent(r) for r in (down, down, up, down, down)] == [False] * 5
    assert budget.spent(down) and budget.streak == 3
    zero = ToolRetryBudget(0)
    assert not zero.spent(up) and not zero.spent(row(calls=0.0)) and zero.spent(down)
