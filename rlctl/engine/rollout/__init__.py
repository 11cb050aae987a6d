"""Generation backends behind one interface.

A backend turns prompts into a ``Sequences`` batch: ``generate(prompts, keys, step)`` samples one
completion per (prompt, key) where a key is (prompt index, sample index). Sampling seeds are derived
from (seed, step, prompt index, sample index), so a resumed or rolled-back run regenerates exactly the
same rollouts from the same weights, whatever the batch around them. ``sync_weights`` is called after
every actor update and every restore.

Both backends sample the same distribution (rollout.temperature, then min_p, top_k, top_p, in vLLM's
order: ``sampling.truncate``), end a completion at the same token (eos, or the token completing a
rollout.stop string: ``sampling.StopStrings``) and report the same log-probs: of the sampled token under
the untruncated softmax(logits / T), the distribution the actor's old and new log-probs refer to.
"""

from __future__ import annotations

from typing import Protocol

from rlctl.engine.batch import Sequences
from rlctl.engine.rollout.seeds import sample_seed

__all__ = ["RolloutBackend", "make_backend", "sample_seed"]


class RolloutBackend(Protocol):
    def sync_weights(self) -> None: ...

    def generate(
        self, prompts: list[str], keys: list[tuple[int, int]], step: int, temperature: float | None = None
    ) -> Sequences: ...

    def decode(self, seqs: Sequences) -> list[str]: ...

    def forget_cache(self) -> None:
        """Drop what generation cached across calls (vLLM's prefix cache), so what comes next samples as
        after a restore: validation leaves no trace in training."""


def make_backend(name: str, **kwargs) -> RolloutBackend:
    if name == "hf":
        from rlctl.engine.rollout.hf import HFRollout

        kwargs.pop("model_dir", None)  # generates with the actor's own module
        return HFRollout(**kwargs)
    if name == "vllm":
        from rlctl.engine.rollout.vllm import VLLMRollout

        return VLLMRollout(**kwargs)
    raise KeyError(f"unknown rollout backend '{name}'; valid: hf, vllm")
