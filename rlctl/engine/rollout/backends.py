"""Generation backends behind one interface (``RolloutBackend``), made by ``make_backend``.

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

from collections.abc import Callable
from typing import Any, Protocol

from rlctl.engine.batch import Sequences

__all__ = ["RolloutBackend", "make_backend"]


class RolloutBackend(Protocol):
    reductions: dict[str, str]  # how the ranks reduce each metric of ``take_metrics``

    def sync_weights(self) -> None: ...

    def take_metrics(self) -> dict[str, float]:
        """The backend's own metrics of what it generated since the last call (a multi-turn rollout's
        turns and tool calls), as one row; {} for single-turn generation."""

    def generate(
        self,
        prompts: list[str],
        keys: list[tuple[int, int]],
        step: int,
        temperature: float | None = None,
        columns: dict[str, list] | None = None,
    ) -> Sequences: ...

    def decode(self, seqs: Sequences) -> list[str]: ...

    def turn_ends(self) -> list[list[int | None]] | None:
        """Each last generated completion's turns of the model's, by their last position after the prompt
        (a multi-turn rollout's: per-turn rewards sit there); None for single-turn generation."""

    def reward_columns(self) -> dict[str, list]:
        """Columns the reward function gets for the last generate's completions besides the dataset's (a
        multi-turn rollout's ``conversation`` and ``tool_calls``); {} for single-turn generation."""

    def scored(self, step: int, scores) -> None:
        """The (B,) scores of the last generate's completions, at a training step (a multi-turn rollout
        writes its conversations' trajectories with them); nothing for single-turn generation."""

    def forget_cache(self) -> None:
        """Drop what generation cached across calls (vLLM's prefix cache), so what comes next samples as
        after a restore: validation leaves no trace in training."""


def make_backend(
    name: str,
    *,
    cfg,
    actor,
    tokenizer,
    model_dir=None,
    engine=None,
    tools=None,
    pool=None,
    emit: Callable[[dict[str, Any]], None] | None = None,
    record=None,
    trajectories=None,
) -> RolloutBackend:
    """The rollout backend ``name`` (rollout.backend). Under rollout.multi_turn the multi-turn rollout
    (its turns sampled by the HF module or the vLLM engine), with the run's ``tools`` (``engine.tool_workers.loader``), the
    rank's ``pool`` of tool workers (its owner closes it), the trainer's event emitter ``emit`` and the
    run's ``record`` of tool calls (``engine.tool_workers.call_record``) and ``trajectories`` of its conversations
    (``trajectory``). ``engine``: the vLLM rollout to use (vllm; None: a new engine)."""
    if cfg.rollout.multi_turn is not None:
        if tools is None or pool is None:
            raise ValueError("a multi-turn rollout needs the run's tools and a pool of tool workers")
        turns = (cfg, actor, tokenizer, cfg.rollout.multi_turn, tools, pool, emit, record, trajectories)
        if name == "vllm":
            from rlctl.engine.rollout.vllm import VLLMRollout
            from rlctl.engine.rollout.vllm_multi_turn import VLLMMultiTurnRollout

            return VLLMMultiTurnRollout(engine or VLLMRollout(cfg, actor, tokenizer, model_dir), *turns)
        from rlctl.engine.rollout.multi_turn import MultiTurnRollout

        return MultiTurnRollout(*turns)
    if name == "hf":
        from rlctl.engine.rollout.hf import HFRollout

        return HFRollout(cfg, actor, tokenizer)  # generates with the actor's own module (no model_dir)
    if name == "vllm":
        from rlctl.engine.rollout.vllm import VLLMRollout

        return engine or VLLMRollout(cfg, actor, tokenizer, model_dir)
    raise KeyError(f"unknown rollout backend '{name}'; valid: hf, vllm")
