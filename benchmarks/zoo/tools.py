"""A tool that starts failing part-way, as a metered service does when its quota runs out: for
benchmarks/collapse_zoo.py's ``tool-quota`` collapse.

``lookup`` is the built-in ``rlctl.tools.lookup:lookup`` (it answers the conversation's hidden word) until
its worker process has answered ``QUOTA`` calls; every call after that raises, and the error goes back to
the model as ``error: RuntimeError: ...`` (``tool/error_frac``), so no conversation reaches its answer
and the reward (which needs the tool's answer) falls to zero. Nothing a rollback replays brings the quota
back: a person has to act. With ``rollout.multi_turn.tool_workers: 1`` one process counts every call of
the run (a resumed run starts counting again).
"""

from __future__ import annotations

QUOTA = 8000  # calls: about step 70 of the tools demo, once the model has learnt to call
_answered = 0


def lookup(word: str) -> str:
    """The word.

    Args:
        word: The word, from the prompt's row (hidden from the model).
    """
    global _answered
    if _answered >= QUOTA:
        raise RuntimeError(f"quota of {QUOTA} calls exceeded")
    _answered += 1
    return word
