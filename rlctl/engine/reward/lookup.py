"""The built-in tools task (``rlctl start tools-demo``): answer a word that only a tool knows.

Every prompt asks the same question (``"word?"``); its row holds a random word of 3 of the echo task's
letters as the hidden argument of the ``lookup`` tool (``rlctl.tools.lookup``), which the model never
sees: the only way to the word is to call the tool and read its answer. The reward is the echo task's
partial credit (``builtin.echo_score``) of the model's last turn against the word, for a conversation in
which the tool's answer reached the model; any other conversation scores 0, whatever it says. After a
look-up, that partial credit also counts the word's letters wherever they stand, so letters guessed from
the task's 12 get some of it (about 0.1 in the measured run, docs/multi-turn.md); 1.0 takes copying the
word."""

from __future__ import annotations

import random
from typing import Any

from rlctl.engine.reward.builtin import LETTERS, echo_score
from rlctl.errors import InputError

QUESTION = "word?"
TOOL = "lookup"
WORD_LENGTH = 3  # one length: the word sits at the same distance before every answer


def _row(word: str) -> dict[str, Any]:
    return {"prompt": QUESTION, "word": word, "tool_args": {TOOL: {"word": word}}}


def make_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows, each a random word of WORD_LENGTH of the echo task's letters to look up."""
    rng = random.Random(f"{seed}/lookup")
    return [_row(_word(rng)) for _ in range(n)]


def make_held_out_prompts(n: int, seed: int, training: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``n`` rows whose words are none of the ``training`` rows' words; an InputError when too few are left."""
    seen = {row["word"] for row in training}
    free = len(LETTERS) ** WORD_LENGTH - len(seen)
    if n > free:
        raise InputError(
            f"'data.builtin_val_size' ({n}) asks for more held-out prompts than the lookup task has left "
            f"({free} words are not training prompts); lower it or 'data.builtin_size'"
        )
    rng, rows = random.Random(f"{seed}/lookup/held-out"), []
    while len(rows) < n:
        if (word := _word(rng)) not in seen:
            seen.add(word)
            rows.append(_row(word))
    return rows


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(WORD_LENGTH))


def looked_up(conversation: list[dict[str, Any]], word: str) -> bool:
    """Whether the tool's answer, the word, reached the model in ``conversation`` (its messages)."""
    return any(m["role"] == "tool" and m.get("name") == TOOL and m["content"] == word for m in conversation)


def lookup_reward(
    prompts: list[str], completions: list[str], word: list[str], conversation: list[list[dict]], **_
) -> list[float]:
    """``echo_score`` of each completion (the model's last turn) against its word, 0 where the word was
    never looked up: 1.0 for the word and nothing else."""
    return [echo_score(w, c) if looked_up(conv, w) else 0.0 for c, w, conv in zip(completions, word, conversation)]
