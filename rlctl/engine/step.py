"""One training step's phases, on a trainer's parts: the batch (made now, or ahead by ``engine.ahead``),
the forward passes the update needs (old and reference log-probs, values), advantages, the critic's and
the actor's updates, the KL controller fed the ranks' reduced measurement, the rollout's weights re-synced,
and the step's row, reduced alike on every rank, with the trainer's counters advanced.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from rlctl import algos, faults
from rlctl.config import RunConfig
from rlctl.engine.actor import REDUCTIONS as ACTOR_REDUCTIONS
from rlctl.engine.actor import Actor, sequence_log_probs
from rlctl.engine.ahead import STALENESS_REDUCTIONS, RolloutAhead
from rlctl.engine.batch import Sequences
from rlctl.engine.counters import TrainerState
from rlctl.engine.critic import REDUCTIONS as CRITIC_REDUCTIONS
from rlctl.engine.dist import MAX, MEAN, SUM, Dist
from rlctl.engine.experience import REDUCTIONS as BATCH_REDUCTIONS
from rlctl.engine.experience import SAMPLING_REDUCTIONS, Experience, advantages_of, batch_metrics
from rlctl.engine.reward.sources import metrics_of
from rlctl.engine.runtime import Runtime
from rlctl.metrics import timed
from rlctl.policies.guard import PolicyGuard

# How the ranks reduce the metrics the trainer itself makes (timings, which are all MAX, aside).
STEP_REDUCTIONS = {
    "actor/reward_kl_penalty": MEAN,
    "rollout/logprob_diff": MEAN,
    "actor/kl_coef": MEAN,
    "perf/tokens": SUM,
    "perf/throughput": SUM,
}


class Host(Protocol):
    """What a step needs of the trainer it runs in (``rlctl.engine.trainer.Trainer``)."""

    cfg: RunConfig
    runtime: Runtime
    dist: Dist
    state: TrainerState
    actor: Actor
    ref: Any  # the reference policy (a model or the actor's LoRA-disabled view), None without a KL term
    critic: Any  # rlctl.engine.critic.Critic, None without one
    rollout: Any  # the rank's rollout backend
    experience: Experience
    ahead: RolloutAhead | None
    guard: PolicyGuard | None
    kl_ctrl: Any
    on_policy: bool
    shared_engine: bool
    emit: Callable[[dict[str, Any]], None]

    def follow_schedules(self, step: int) -> None: ...


class TrainStep:
    """The phases of one step of the trainer ``host`` (module docstring)."""

    def __init__(self, host: Host):
        self.host = host

    def _timed(self, t: dict[str, float], name: str):
        """``timed``, waiting for the accelerator at both ends (a GPU runs a phase's kernels after it)."""
        return timed(t, name, self.host.runtime.synchronize)

    def run(self, step: int) -> dict[str, Any]:
        t: dict[str, float] = {}
        self.host.follow_schedules(step)
        with self._timed(t, "step"):
            with self._timed(t, "gen"):
                seqs, scores, sampling = self.batch_for(step)
            old, ref, values, drift = self.forward_passes(seqs, t)
            rewards, current_kl, advantages, returns = advantages_of(
                self.host.cfg.algorithm, seqs, scores, old, ref, values, self.host.kl_ctrl.value
            )
            stats = self.update(step, seqs, advantages, returns, old, ref, values, t)
            kl_used = self.host.kl_ctrl.value
            stats = self.adapt_kl(stats, current_kl, ref, len(seqs))
            if faults.value("stale_rollout") is None and not self.host.shared_engine:
                self.host.rollout.sync_weights()
        tokens = int(seqs.attention_mask.sum())
        rest = {  # stats are reduced already
            **drift,
            **batch_metrics(
                seqs, scores, rewards, advantages, returns, values, old, ref, self.host.cfg.rollout.max_new_tokens
            ),
            **sampling,
            "actor/kl_coef": kl_used,
            **t,
            "perf/tokens": float(tokens),
            "perf/throughput": tokens / t["timing_s/step"],
        }
        return self.record(step, stats, rest)

    def batch_for(self, step: int) -> tuple[Sequences, torch.Tensor, dict[str, float]]:
        """The step's batch: made now (rollout.mode sync), or during the step before (one_step_off), the
        next step's then started in the background before this one trains (``engine.ahead``)."""
        if self.host.ahead is None:
            return self.host.experience.rollout_batch(step)
        skipped = self.host.guard.skipped_prompts if self.host.guard is not None else ()
        batch, staleness = self.host.ahead.take(step, self.host.state.step, skipped)
        self.host.experience.drawn = batch.drawn  # what a policy's skip skips
        for event in batch.events:  # the generation's (multi-turn: drift, replayed calls), in order
            self.host.emit(event)
        self.host.ahead.fill(step, self.host.state.step, self.host.cfg.trainer.total_steps)
        return batch.seqs, batch.scores, {**batch.sampling, **staleness}

    def forward_passes(self, seqs: Sequences, t: dict[str, float]):
        """(B, T) old log-probs (None on-policy: the update's forward gives them), reference log-probs
        (None without a KL term) and values (None without a critic); the rollout's log-prob drift."""
        temperature, sampler = self.host.cfg.rollout.temperature, self.host.cfg.rollout.sampler
        with self._timed(t, "old_log_prob"), torch.no_grad():
            old = None if self.host.on_policy else self.host.actor.old_log_probs(seqs, temperature)
        drift = {}
        if seqs.rollout_log_probs is not None and old is not None:
            diff = (old - seqs.rollout_log_probs).abs()
            drift["rollout/logprob_diff"] = algos.masked_mean(diff, seqs.response_mask).item()
        with self._timed(t, "ref"), torch.no_grad():
            ref = (
                None
                if self.host.ref is None
                else self.host.actor.in_pieces(
                    seqs, lambda part: sequence_log_probs(self.host.ref, part, temperature, sampler=sampler)[0]
                )
            )
        with self._timed(t, "values"), torch.no_grad():
            values = self.host.critic.values(seqs) if self.host.critic is not None else None
        return old, ref, values, drift

    def update(self, step: int, seqs: Sequences, advantages, returns, old, ref, values, t) -> dict[str, float]:
        """The critic's update (PPO), then the actor's (after the critic's warm-up); their metrics."""
        stats: dict[str, float] = {}
        if self.host.critic is not None:
            with self._timed(t, "update_critic"):
                stats.update(self.host.critic.update(seqs, values, returns))
        if self.host.critic is None or step > self.host.cfg.critic.warmup_steps:
            with self._timed(t, "update_actor"):
                drill = faults.once("nan_log_prob", step)  # (a value: only that rank's batch)
                poison = drill is not None and (drill == "" or int(drill) == self.host.dist.rank)
                rollout_lp = seqs.rollout_log_probs  # (on-policy: logprob_diff; any step: the rollout correction)
                actor = self.host.actor.update(seqs, advantages, old, ref, self.host.kl_ctrl.value, poison, rollout_lp)
                stats.update(actor)
        return stats

    def adapt_kl(self, stats: dict[str, float], current_kl, ref, batch: int) -> dict[str, float]:
        """The update's metrics reduced over the ranks, so that every rank's KL controller sees the same
        measurement, and the controller updated with it."""
        if current_kl is not None:
            stats["actor/reward_kl_penalty"] = current_kl
        how = {**ACTOR_REDUCTIONS, **CRITIC_REDUCTIONS, **STEP_REDUCTIONS}
        stats = self.host.dist.reduce_row(stats, how)
        if ref is not None:
            measured = stats.get("actor/reward_kl_penalty", stats.get("actor/kl_loss"))
            if measured is not None and math.isfinite(measured):
                self.host.kl_ctrl.update(measured, n_steps=batch * self.host.dist.world)
        return stats

    def record(self, step: int, stats: dict[str, float], rest: dict[str, Any]) -> dict[str, Any]:
        """The step's row, identical on every rank (the policies decide the same everywhere), and the
        counters advanced."""
        how = {
            **BATCH_REDUCTIONS,
            **SAMPLING_REDUCTIONS,
            **metrics_of(self.host.experience.reward_fn),  # each reward source's mean (reward.sources)
            **self.host.rollout.reductions,  # the rollout's own (multi-turn: turns, tool calls)
            **(STALENESS_REDUCTIONS if self.host.ahead is not None else {}),
            **STEP_REDUCTIONS,
            **{key: MAX for key in rest if key.startswith("timing_s/")},
        }  # a step takes its slowest rank's time
        row = {"step": step, "timestamp": round(time.time(), 3), **stats, **self.host.dist.reduce_row(rest, how)}
        self.host.state.step = step
        self.host.state.prompts_seen += self.host.cfg.trainer.prompts_per_step
        self.host.state.tokens_seen += int(row.pop("perf/tokens"))
        row["perf/tokens_seen"] = self.host.state.tokens_seen
        return row
