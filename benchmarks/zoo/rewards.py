"""A reward that can be hacked by repetition, as careless rewards are: for benchmarks/collapse_zoo.py.

``letter_count`` counts the completion's characters that are letters of the target, over twice the
target's length: a perfect echo scores 0.5, and nothing stops a completion from scoring more by repeating
a letter of the target until ``rollout.max_new_tokens`` ends it (``"aaaaaaaaaaaaaaaa"`` for ``"ab"``: 4.0).
It is the built-in echo reward's letter half without its length scaling, the mistake of a reward that
counts what it wants to see and forgets to bound it. A policy trained on it learns to repeat: the reward
rises while the answers degenerate and the real task's score (the echo reward, logged beside it with
weight 0) falls.
"""

from __future__ import annotations


def letter_count(prompts: list[str], completions: list[str], target: list[str] | None = None, **_) -> list[float]:
    targets = target if target is not None else [p.split("=")[0] for p in prompts]
    return [sum(ch in t for ch in c) / (2 * len(t)) if t else 0.0 for t, c in zip(targets, completions)]
