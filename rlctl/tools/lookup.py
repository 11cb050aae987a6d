"""A ready-made tool for the built-in tools task (``rlctl start tools-demo``, ``rlctl.engine.reward.lookup``):
``lookup`` answers the word its conversation asks for, the row's hidden argument (``hidden: [word]``), so
the model calls it without arguments and only the tool knows the answer."""

from __future__ import annotations


def lookup(word: str) -> str:
    """The word.

    Args:
        word: The word, from the prompt's row (hidden from the model).
    """
    return word
