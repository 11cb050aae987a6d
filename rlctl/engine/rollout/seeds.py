"""Sampling seeds derived from (seed, step, prompt index, sample index) and nothing else, so a resumed
or rolled-back run regenerates exactly the same rollouts."""

from __future__ import annotations

import hashlib


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int, turn: int = 0) -> int:
    """A 63-bit seed that depends on the four numbers (and a multi-turn conversation's turn after its
    first) and nothing else."""
    key = f"{seed}/{step}/{prompt_index}/{sample_index}" + (f"/{turn}" if turn else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
