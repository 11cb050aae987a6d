"""Validation: the current weights answer the held-out prompts; their scores become ``val/...`` metrics.

Every ``trainer.val_every`` steps (and at the last step, and before the first with
``trainer.val_before_train``) each held-out prompt is answered ``rollout.val_samples`` times at
``rollout.val_temperature`` (0: greedy) and scored by the run's reward function. The metrics follow
verl's habits:

- ``val/score/mean``: the mean score of every answer;
- ``val/score/mean@N`` and ``val/score/best@N``: over prompts, the mean and the best of each prompt's N
  answers (best@N is pass@N for 0/1 rewards);
- ``val/response_length/mean``;
- ``val/<data_source>/score/mean`` for each value of a ``data_source`` column, when the data has one.

Validation is deterministic and leaves the run alone: sampling seeds come from (seed, prompt index,
sample index) under a step of their own (``VAL_STEP``), never from a global generator, so the same
weights validate identically in a resumed run, and a run that validates trains exactly as one that
does not. Each rank answers every world-th prompt; sums are reduced over the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from rlctl.config import RunConfig
from rlctl.engine.data import columns_of
from rlctl.engine.dist import SUM, Dist
from rlctl.engine.reward import score_completions
from rlctl.engine.rollout import RolloutBackend
from rlctl.engine.rollout.conversation import add_turn_rewards

VAL_STEP = -1  # the "step" of every validation's sampling seeds: the same answers from the same weights
SOURCE = "data_source"


class Validator:
    """Scores the held-out ``rows`` with the rollout backend's current weights."""

    def __init__(
        self, cfg: RunConfig, rows: list[dict[str, Any]], rollout: RolloutBackend, reward_fn: Callable, dist: Dist
    ):
        self.cfg, self.rows, self.rollout, self.reward_fn, self.dist = cfg, rows, rollout, reward_fn, dist
        self.n = cfg.rollout.val_samples
        self.sources = sorted({str(r[SOURCE]) for r in rows if r.get(SOURCE) is not None})
        # sequences a rank generates at once: its share of a training batch
        self.chunk = max(self.n, cfg.trainer.prompts_per_step * cfg.algorithm.group_size // dist.world)

    def due(self, step: int) -> bool:
        """Whether ``step`` validates: every ``val_every`` steps, and the last step of the run."""
        every = self.cfg.trainer.val_every
        return bool(every) and (step % every == 0 or step == self.cfg.trainer.total_steps)

    def run(self) -> dict[str, float]:
        """The ``val/...`` metrics of the current weights, identical on every rank."""
        # an equal share on every rank (the last ones padded with prompts that do not count), so every rank
        # generates as many times as the others: under ZeRO-3 each generation gathers the weights together
        per = -(-len(self.rows) // self.dist.world)
        mine = list(range(self.dist.rank * per, min(len(self.rows), (self.dist.rank + 1) * per)))
        counted = [True] * len(mine) + [False] * (per - len(mine))
        mine += [0] * (per - len(mine))
        sums = self._empty_sums()
        per_chunk = max(1, self.chunk // self.n)
        for start in range(0, per, per_chunk):
            end = start + per_chunk
            self._score_prompts(mine[start:end], counted[start:end], sums)
        totals = self.dist.reduce_row(sums, dict.fromkeys(sums, SUM))
        self.rollout.forget_cache()  # the next training step samples as if there had been no validation
        self.rollout.take_metrics()  # and its rollout metrics (turns, tool calls) are its own
        return self._metrics(totals)

    def _empty_sums(self) -> dict[str, float]:
        sums = {"answers": 0.0, "score": 0.0, "length": 0.0, "prompts": 0.0, "prompt_mean": 0.0, "prompt_best": 0.0}
        for source in self.sources:
            sums[f"{source}/answers"], sums[f"{source}/score"] = 0.0, 0.0
        return sums

    def _score_prompts(self, indices: list[int], counted: list[bool], sums: dict[str, float]) -> None:
        """Answer and score the prompts ``indices`` (each ``n`` times); add those ``counted`` to ``sums``."""
        key = self.cfg.data.prompt_key
        rows = [self.rows[i] for i in indices for _ in range(self.n)]
        keys = [(i, s) for i in indices for s in range(self.n)]
        prompts = [r[key] for r in rows]
        columns = columns_of(rows, key)
        t = self.cfg.rollout.val_temperature
        seqs = self.rollout.generate(prompts, keys, VAL_STEP, temperature=t, columns=columns)
        columns = {**columns, **self.rollout.reward_columns()}
        reward, ends = self.cfg.reward, self.rollout.turn_ends()
        turns = [None] * len(prompts) if ends is not None else None  # a reward function's of single turns
        scores = score_completions(
            self.reward_fn, reward.function, prompts, self.rollout.decode(seqs), columns, reward.kwargs, turns
        )
        keep = torch.tensor(counted)
        scores_t = torch.as_tensor(scores, dtype=torch.float64)
        # rewards of single turns (an environment's, the reward function's) are the score's too
        if (turn_sums := add_turn_rewards(seqs, turns, ends, f"reward function '{reward.function}'")) is not None:
            scores_t = scores_t + turn_sums.double()
        scores_t = scores_t.view(len(indices), self.n)[keep]
        lengths = seqs.response_mask.sum(-1).view(len(indices), self.n)[keep]
        sums["answers"] += float(scores_t.numel())
        sums["score"] += float(scores_t.sum())
        sums["length"] += float(lengths.sum())
        sums["prompts"] += float(len(scores_t))
        sums["prompt_mean"] += float(scores_t.mean(-1).sum())
        sums["prompt_best"] += float(scores_t.max(-1).values.sum()) if len(scores_t) else 0.0
        for row, score, real in zip(rows, scores, keep.repeat_interleave(self.n).tolist()):
            if real and row.get(SOURCE) is not None:
                sums[f"{row[SOURCE]}/answers"] += 1.0
                sums[f"{row[SOURCE]}/score"] += float(score)

    def _metrics(self, totals: dict[str, float]) -> dict[str, float]:
        def ratio(a: float, b: float) -> float:
            return a / b if b else math.nan

        n = self.n
        out = {
            "val/score/mean": ratio(totals["score"], totals["answers"]),
            f"val/score/mean@{n}": ratio(totals["prompt_mean"], totals["prompts"]),
            f"val/score/best@{n}": ratio(totals["prompt_best"], totals["prompts"]),
            "val/response_length/mean": ratio(totals["length"], totals["answers"]),
        }
        for source in self.sources:
            out[f"val/{source}/score/mean"] = ratio(totals[f"{source}/score"], totals[f"{source}/answers"])
        return out
