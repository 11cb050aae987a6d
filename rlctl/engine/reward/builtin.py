"""The built-in demo task: echo the letters before '='.

A prompt is a few random letters and '=' (``"qxe="``); the ideal completion repeats them and stops
(``"qxe"`` then <eos>). The reward gives partial credit so that a randomly initialised model has a
gradient to follow from the first step:

- half for how many of the first L completion characters are letters of the prompt,
- half for how many are the right letter in the right position,
- all of it scaled by L / max(L, len(completion)), so rambling past the answer costs reward.

A random model scores about 0.02; a perfect echo scores 1.0.
"""

from __future__ import annotations

import random
import string

from rlctl.errors import InputError

LETTERS = string.ascii_lowercase[:12]


def make_prompts(n: int, seed: int, min_len: int = 2, max_len: int = 4) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))
        rows.append({"prompt": f"{word}=", "target": word})
    return rows


def make_held_out_prompts(n: int, seed: int, training: list[dict]) -> list[dict]:
    """``n`` prompts of the same task (words of 3 or 4 letters), none of them a training prompt: the
    built-in held-out split. An InputError when the training prompts leave fewer than ``n`` such words."""
    seen = {row["prompt"] for row in training}
    free = len(LETTERS) ** 3 + len(LETTERS) ** 4 - sum(len(p) in (4, 5) for p in seen)
    if n > free:
        raise InputError(
            f"'data.builtin_val_size' ({n}) asks for more held-out prompts than the built-in task has left "
            f"({free} words of 3 or 4 letters are not training prompts); lower it or 'data.builtin_size'"
        )
    rng = random.Random(f"{seed}/held-out")
    rows = []
    while len(rows) < n:
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 4)))
        if f"{word}=" not in seen:
            seen.add(f"{word}=")
            rows.append({"prompt": f"{word}=", "target": word})
    return rows


def echo_score(target: str, completion: str) -> float:
    n = len(target)
    if n == 0 or not completion:
        return 0.0
    head = completion[:n]
    in_set = sum(ch in target for ch in head) / n
    exact = sum(a == b for a, b in zip(head, target)) / n
    return (0.5 * in_set + 0.5 * exact) * n / max(n, len(completion))


def echo_reward(prompts: list[str], completions: list[str], target: list[str] | None = None, **_) -> list[float]:
    targets = target if target is not None else [p.split("=")[0] for p in prompts]
    return [echo_score(t, c) for t, c in zip(targets, completions)]


def no_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """0 for every completion: the reward of a run whose environment gives every reward
    (``rollout.multi_turn.environment`` without a reward of the run's own)."""
    return [0.0] * len(completions)
