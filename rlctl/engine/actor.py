"""The policy being trained: a Hugging Face causal LM inside a DeepSpeed ZeRO engine.

The optimizer is a ``torch.optim.AdamW`` instance (ZeRO accepts it and nothing needs a JIT build),
torch's fused kernel on CPU and CUDA: ZeRO steps one flat fp32 partition, where the unfused update
allocates several temporaries of its full size (a 25M-parameter ZeRO-2 step: 148 -> 67 ms on one CPU
thread, benchmarks/zero_overhead.py). The engine owns the weights, optimizer and lr scheduler; ``log_probs`` and
``update`` are the only two things the trainer asks of it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from rlctl import algos
from rlctl.algos.logprobs import token_log_probs
from rlctl.checkpoint.collectives import Collectives
from rlctl.config import RunConfig
from rlctl.engine import lora
from rlctl.engine.batch import Sequences, position_ids_for
from rlctl.engine.dist import MAX, MEAN, MIN, SUM, combine
from rlctl.engine.ds_module import DSModule, EngineSpec, rank_mini_batch, weights_digest
from rlctl.engine.microbatch import MicroBatch, by_count
from rlctl.engine.model import load_causal_lm, logits_to_keep
from rlctl.engine.runtime import Runtime
from rlctl.engine.token_budget import device_token_budget

# How the ranks reduce each metric ``Actor.update`` reports (also how its micro-batches combine: counts
# add up, extremes take the max or min, the others are means of values weighted so that their mean is
# the batch's).
REDUCTIONS = {
    "actor/pg_loss": MEAN,
    "actor/kl_loss": MEAN,
    "actor/ppo_kl": MEAN,
    "actor/pg_clipfrac": MEAN,
    "actor/pg_clipfrac_lower": MEAN,
    "actor/entropy": MEAN,
    "actor/grad_norm": MEAN,
    "actor/lr": MEAN,
    "rollout/logprob_diff": MEAN,
    "rollout_corr/ratio_mean": MEAN,
    "rollout_corr/ratio_max": MAX,
    "rollout_corr/clipfrac": MEAN,
    "actor/nonfinite/log_prob": SUM,
    "actor/nonfinite/loss": SUM,
    "actor/nonfinite/old_log_prob": SUM,
    "actor/skipped_updates": SUM,
    "actor/loss_scale": MIN,  # model.dtype fp16 only; the same on every rank, as is the next
    "actor/overflow_skipped": MAX,
    "actor/ppo_ratio/max": MAX,
    "actor/log_prob/min": MIN,
    "perf/update_padding_frac": MEAN,
}


class Actor(DSModule):
    """The policy: a causal LM. ``log_probs`` and ``update`` are all the trainer asks of it."""

    def __init__(
        self,
        cfg: RunConfig,
        model_dir: Path,
        runtime: Runtime,
        *,
        collectives: Collectives | None = None,
        fence: Callable[[], None] | None = None,
        zero_stage: int | None = None,
    ):
        """``zero_stage``: the ZeRO stage the engine trains at (``rlctl.rundir.snapshots.trained_stages``;
        None: actor.zero_stage)."""
        self.cfg = cfg
        mini = rank_mini_batch(cfg)
        spec = EngineSpec(
            lr=cfg.actor.lr,
            zero_stage=cfg.actor.zero_stage if zero_stage is None else zero_stage,
            grad_clip=cfg.actor.grad_clip,
            mini_batch=mini,
            micro_batch=cfg.actor.micro_batch_size or mini,
            max_tokens=cfg.actor.max_tokens_per_micro_batch,
            betas=cfg.actor.betas,
            weight_decay=cfg.actor.weight_decay,
            warmup_steps=cfg.actor.warmup_steps,
        )
        model = load_causal_lm(model_dir, runtime.dtype, cfg.model.trust_remote_code)
        shape = model.config
        if cfg.actor.gradient_checkpointing:
            lora.enable_gradient_checkpointing(model, "actor.gradient_checkpointing")
        if cfg.actor.lora.rank:  # the base frozen, a seeded adapter trained
            model = lora.apply_lora(model, cfg.actor.lora, cfg.seed)
        super().__init__(model, spec, runtime, collectives=collectives, fence=fence)
        if cfg.actor.micro_batch_size is None and cfg.actor.max_tokens_per_micro_batch is None:
            self._default_token_budget(shape)

    def _default_token_budget(self, shape) -> None:
        """On a GPU, with neither ``actor.micro_batch_size`` nor ``actor.max_tokens_per_micro_batch`` set:
        micro-batches by the token budget the device's free memory allows now (``token_budget``; the
        smallest over the ranks), the weights and optimizer state already placed. ``shape``: the model's
        transformers config. On the CPU nothing changes: the rank's whole share in one piece."""
        budget = device_token_budget(
            self.runtime.device, shape, self.runtime.dtype, self.cfg.actor.gradient_checkpointing
        )
        if budget is not None:
            self.keep_token_budget(-self.collectives.max(-budget))

    @property
    def token_budget(self) -> int | None:
        """The micro-batch token budget chosen by ``_default_token_budget`` (None: none chosen)."""
        return self.spec.max_tokens if self.cfg.actor.max_tokens_per_micro_batch is None else None

    def keep_token_budget(self, budget: int | None) -> None:
        """Cut micro-batches by ``budget`` tokens (None: the rank's share by micro_batch_size), unless the
        config sets actor.micro_batch_size or max_tokens_per_micro_batch: a resumed run keeps the budget
        its start chose (``TrainerState.token_budget``), whatever memory is free now."""
        if self.cfg.actor.micro_batch_size is None and self.cfg.actor.max_tokens_per_micro_batch is None:
            self.spec = dataclasses.replace(self.spec, max_tokens=budget)

    @property
    def trains_in_train_mode(self) -> bool:
        """Whether the update's forward runs in training mode: transformers checkpoints only then, and
        LoRA's dropout applies only then (the model is otherwise in eval mode, as loaded)."""
        return self.cfg.actor.gradient_checkpointing or (self.has_lora and self.cfg.actor.lora.dropout > 0)

    @property
    def has_lora(self) -> bool:
        """Whether the actor trains a LoRA adapter on a frozen base (``actor.lora.rank`` > 0)."""
        return self.cfg.actor.lora.rank > 0

    def reference(self) -> lora.AdapterDisabled:
        """The reference policy of a LoRA run: this module with its adapter disabled (no second copy)."""
        return lora.AdapterDisabled(self.engine, self.module)

    def merged_weights(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the weights of the plain model the actor is, under its base names: the
        adapter merged into the base under LoRA, else the parameters themselves. Under ZeRO-3, call
        inside ``full_parameters``."""
        if self.has_lora:
            return lora.merged_weights(self.module)
        return [(name, p.detach()) for name, p in self.module.named_parameters()]

    def weights_sha256(self) -> str:
        """A hash of the plain model's weights (``merged_weights``), by name: equal hashes mean
        bit-identical policies; under LoRA it is the hash of the merged model ``rlctl export`` writes."""
        with self.full_parameters():
            return weights_digest(self.merged_weights())

    def log_probs(
        self, seqs: Sequences, temperature: float, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) log π(response | prompt) of the sampled tokens in fp32 (the logits scaled by the
        temperature as the run's ``rollout.sampler`` did), and optionally the (B, T) entropy of the token
        distribution, without gradient. Gradients flow to the log-probs when called outside ``torch.no_grad``."""
        return sequence_log_probs(self.engine, seqs, temperature, with_entropy, sampler=self.cfg.rollout.sampler)

    def old_log_probs(self, seqs: Sequences, temperature: float) -> torch.Tensor:
        """(B, T) log-probs of the sampled tokens without gradients, micro-batch by micro-batch under a
        token budget (``in_pieces``)."""
        return self.in_pieces(seqs, lambda part: self.log_probs(part, temperature)[0])

    def in_pieces(self, seqs: Sequences, forward: Callable[[Sequences], torch.Tensor]) -> torch.Tensor:
        """``forward``'s (B, T) result over the rank's batch: by ``actor.micro_batch_size`` sequences at a
        time when that is set (as the update cuts them), else as ``DSModule.in_pieces`` (a token budget, or
        one piece). Every rank's share has the same size, so the ranks run as many forwards (ZeRO-3)."""
        micro = self.cfg.actor.micro_batch_size
        if self.spec.max_tokens is not None or micro is None or micro >= len(seqs):
            return super().in_pieces(seqs, forward)
        return torch.cat([forward(seqs.select(rows)).float() for rows in by_count(0, len(seqs), micro)])

    def update(
        self,
        seqs: Sequences,
        advantages: torch.Tensor,
        old_log_prob: torch.Tensor | None,
        ref_log_prob: torch.Tensor | None,
        kl_coef: float,
        poison: bool = False,
        rollout_log_prob: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """PPO-style updates over the batch: ``ppo_epochs`` passes of mini-batches (one optimizer step
        each), every mini-batch run as micro-batches whose gradients DeepSpeed accumulates.

        (B, T) advantages; (B, T) old log-probs, or None when the update is exactly on-policy (one epoch,
        one mini-batch): then they come from the same forward as the gradient, without a second pass.
        (B, T) reference log-probs when a KL loss applies (not when the KL is folded into the reward).
        Returns the metrics averaged over micro-batches (counts summed). ``poison`` is the nan_log_prob
        fault drill. ``rollout_log_prob``: the rollout engine's (B, T) log-probs (None: the batch has none),
        compared on-policy with this forward's (before any optimizer step) for `rollout/logprob_diff`, and
        the pi_rollout of ``algorithm.rollout_correction`` (``_correction``)."""
        a = self.cfg.algorithm
        totals: dict[str, float] = {}
        n_micro, real, computed = 0, 0, 0
        lr = self.scheduler.get_last_lr()[0]
        overflows = self.overflow_skipped()
        for _ in range(a.ppo_epochs):
            for mb in self.minibatches(seqs):
                loss, stats = self._micro_batch_loss(
                    seqs,
                    mb,
                    advantages,
                    old_log_prob,
                    ref_log_prob,
                    kl_coef,
                    poison=poison and n_micro == 0,
                    rollout_log_prob=rollout_log_prob,
                )
                if not self.apply(loss, mb):
                    stats["actor/skipped_updates"] = 1.0
                # (a step DeepSpeed skipped on an fp16 overflow has no norm to report: its inf is no fault)
                if mb.last and ("actor/skipped_updates" in stats or not self.step_overflowed()):
                    totals["actor/grad_norm"] = totals.get("actor/grad_norm", 0.0) + _as_float(
                        self.engine.get_global_grad_norm() if "actor/skipped_updates" not in stats else float("nan")
                    )
                    totals["_boundaries"] = totals.get("_boundaries", 0.0) + 1
                accumulate(totals, stats)
                n_micro += 1
                real, computed = real + mb.real_size, computed + mb.padded_size
        boundaries = totals.pop("_boundaries", 1.0)
        out = {k: v / n_micro if REDUCTIONS[k] == MEAN else v for k, v in totals.items()}  # counts add up
        out["actor/grad_norm"] = totals.get("actor/grad_norm", float("nan")) / boundaries
        out.setdefault("actor/skipped_updates", 0.0)
        out["perf/update_padding_frac"] = 1.0 - real / computed if computed else 0.0
        out["actor/lr"] = lr
        if self.engine.fp16_enabled():  # the loss scale after this update, and its steps skipped on overflow
            out["actor/loss_scale"] = self.loss_scale()
            out["actor/overflow_skipped"] = float(self.overflow_skipped() - overflows)
            if "actor/grad_norm" not in totals:  # every step overflowed: absent, not inf (no nonfinite rollback)
                del out["actor/grad_norm"]
        return out

    def _micro_batch_loss(
        self,
        seqs: Sequences,
        mb: MicroBatch,
        advantages: torch.Tensor,
        old_log_prob: torch.Tensor | None,
        ref_log_prob: torch.Tensor | None,
        kl_coef: float,
        *,
        poison: bool,
        rollout_log_prob: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's forward: its loss and its metrics, weighted so that their means over
        micro-batches and ranks are the mini-batch's (``MicroBatch.token_weight``), on the micro-batch's
        own columns.

        Each term of the loss carries the weight of its own aggregation mode (``MicroBatch.weight``): GSPO's
        policy loss is a sequence mean (``policy_agg_mode``) while the entropy and KL terms follow
        ``loss_agg_mode``, as verl. ``seq-mean-token-sum-norm`` divides every term by the same constant,
        ``rollout.max_new_tokens`` (verl's ``loss_scale_factor``)."""
        a, horizon = self.cfg.algorithm, self.cfg.rollout.max_new_tokens
        tw, weight = mb.token_weight, mb.weight(a.loss_agg_mode)
        pg_weight = mb.weight(algos.masked.policy_agg_mode(a.loss_agg_mode, a.importance_ratio))
        part, mask = mb.seqs(seqs), mb.tokens(seqs.response_mask)
        with lora.training(self.module, self.trains_in_train_mode):
            log_prob, entropy = self.log_probs(part, self.cfg.rollout.temperature, with_entropy=True)
        if poison:  # fault drill: one NaN log-prob, as a broken kernel would give
            log_prob = poisoned(log_prob)
        old = log_prob.detach() if old_log_prob is None else mb.tokens(old_log_prob)
        rollout_lp = None if rollout_log_prob is None else mb.tokens(rollout_log_prob)
        corr = self._correction(old, rollout_lp, mask)
        pl = self._policy_loss(log_prob, old, mb.tokens(advantages), mask, None if corr is None else corr.weights)
        loss = pl.pg_loss * pg_weight
        if a.entropy_coef:
            loss = loss - a.entropy_coef * weight * algos.agg_loss(entropy, mask, a.loss_agg_mode, horizon)
        kl_loss = log_prob.new_zeros(())
        if ref_log_prob is not None and not a.kl_in_reward:
            kl = algos.kl_penalty(log_prob, mb.tokens(ref_log_prob), a.kl_estimator)
            kl_loss = algos.agg_loss(kl, mask, a.loss_agg_mode, horizon)
            loss = loss + kl_coef * weight * kl_loss
        pending = {
            "actor/pg_loss": (pl.pg_loss, pg_weight),
            "actor/kl_loss": (kl_loss, weight),
            "actor/ppo_kl": (pl.ppo_kl, tw),
            "actor/pg_clipfrac": (pl.pg_clipfrac, tw),
            "actor/pg_clipfrac_lower": (pl.pg_clipfrac_lower, tw),
            "actor/entropy": (algos.masked_mean(entropy.detach(), mask), tw),
            "actor/nonfinite/log_prob": ((~torch.isfinite(log_prob) & mask.bool()).sum(), 1.0),
            "actor/nonfinite/loss": (~torch.isfinite(loss), 1.0),
            "actor/ppo_ratio/max": (pl.ratio_max, 1.0),
            "actor/log_prob/min": (algos.masked.masked_min(log_prob.detach(), mask), 1.0),
            **rollout_stats(old, rollout_lp, corr, mask, tw, on_policy=old_log_prob is None),
        }
        stats = read_once(pending)
        if old_log_prob is None:  # on-policy: the old log-probs are this forward's
            stats["actor/nonfinite/old_log_prob"] = stats["actor/nonfinite/log_prob"]
        return loss, stats

    def _correction(
        self, old: torch.Tensor, rollout_lp: torch.Tensor | None, mask: torch.Tensor
    ) -> algos.RolloutCorrection | None:
        """``algorithm.rollout_correction`` of one micro-batch: the weights of its tokens' policy losses by
        the ratio of its (B, T) old log-probs to the rollout engine's, or None (mode none, or a batch
        without rollout log-probs, such as the degenerate drill's). On-policy the old log-probs are the
        update's own forward, before its one optimizer step: the same values a separate pass would give."""
        rc = self.cfg.algorithm.rollout_correction
        if rc.mode == "none" or rollout_lp is None:
            return None
        return algos.rollout_correction(old, rollout_lp, mask, rc.mode, rc.cap)

    def _policy_loss(
        self,
        log_prob: torch.Tensor,
        old: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        token_weights: torch.Tensor | None = None,
    ) -> algos.PolicyLoss:
        """The clipped surrogate of one micro-batch with the run's clips, level and aggregation (all (B, T)),
        each token's loss times its ``token_weights`` (the rollout correction's) when given."""
        a = self.cfg.algorithm
        return algos.compute_policy_loss(
            log_prob,
            old,
            advantages,
            mask,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            clip_c=a.clip_ratio_c,
            agg_mode=a.loss_agg_mode,
            level=a.importance_ratio,
            horizon=self.cfg.rollout.max_new_tokens,
            token_weights=token_weights,
        )


def sequence_log_probs(
    model: torch.nn.Module,
    seqs: Sequences,
    temperature: float,
    with_entropy: bool = False,
    *,
    sampler: str = "generator",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) fp32 log-probs of ``seqs``' response tokens under ``model`` (a causal LM, an engine, a LoRA
    reference), the logits scaled by ``temperature`` as ``sampler`` did (``rollout.sampler``; "generator",
    the division, for a caller that names none), and with ``with_entropy`` the (B, T) entropy of each
    position's distribution (under grad, the entropy bonus's gradient flows through it, as verl's
    ``entropy_coeff``; unused, it adds none). Computed a chunk of positions at a time (``algos.logprobs.token_log_probs``): no
    (B, T, V) fp32 tensor is kept for the backward, and the logits' gradient takes the logits' memory."""
    T = seqs.responses.shape[1]
    out = model(
        input_ids=seqs.input_ids,
        attention_mask=seqs.attention_mask,
        position_ids=position_ids_for(seqs.attention_mask),
        use_cache=False,
        **logits_to_keep(model, T + 1),  # the LM head over the response's positions only
    )
    logits = out.logits  # (B, L, V): position L - T - 1 + t predicts response token t
    first = logits.shape[1] - (T + 1)
    del out
    token_lp, entropy = token_log_probs(
        logits, seqs.responses, temperature, sampler, first=first, with_entropy=with_entropy, in_place=True
    )  # (the model's logits are read by nothing else: the backward writes their gradient into them)
    return token_lp, entropy


def rollout_stats(
    old: torch.Tensor,
    rollout_lp: torch.Tensor | None,
    corr: algos.RolloutCorrection | None,
    mask: torch.Tensor,
    tw: float,
    *,
    on_policy: bool,
) -> dict[str, tuple[torch.Tensor, float]]:
    """A micro-batch's metrics against the rollout engine's (B, T) log-probs, as ``read_once`` takes them
    (0-dim value, weight): weighted by its token weight ``tw`` as the others: on-policy,
    `rollout/logprob_diff` against its (B, T) ``old`` log-probs (this forward's; off-policy the trainer
    compares its separate pass itself); the rollout correction's."""
    stats: dict[str, tuple[torch.Tensor, float]] = {}
    if on_policy and rollout_lp is not None:
        stats["rollout/logprob_diff"] = (algos.masked_mean((old - rollout_lp).abs(), mask), tw)
    if corr is not None:
        stats["rollout_corr/ratio_mean"] = (corr.ratio_mean, tw)
        stats["rollout_corr/ratio_max"] = (corr.ratio_max, 1.0)
        stats["rollout_corr/clipfrac"] = (corr.clipfrac, tw)
    return stats


def read_once(pending: dict[str, tuple[torch.Tensor, float]]) -> dict[str, float]:
    """Each metric's 0-dim tensor (any dtype: a value, a count, a flag) read to the host in one transfer,
    times its weight: one ``tolist`` of their stack in the widest float dtype among them (fp64 where a
    ratio is kept in fp64, else fp32), which holds each value exactly, so the floats are those ``.item()``
    gives (counts are below 2**24)."""
    if not pending:
        return {}
    dtype = functools.reduce(torch.promote_types, (t.dtype for t, _ in pending.values()), torch.float32)
    values = torch.stack([t.detach().reshape(()).to(dtype) for t, _ in pending.values()]).tolist()
    return {key: value * weight for (key, (_, weight)), value in zip(pending.items(), values)}


def poisoned(log_prob: torch.Tensor) -> torch.Tensor:
    """The nan_log_prob fault drill: ``log_prob`` with its first value NaN (gradients still flow)."""
    hit = torch.zeros_like(log_prob, dtype=torch.bool)
    hit[0, 0] = True
    return torch.where(hit, torch.full_like(log_prob, float("nan")), log_prob)


def accumulate(totals: dict[str, float], stats: dict[str, float]) -> None:
    """Fold one micro-batch's ``stats`` into ``totals``: a MAX or MIN metric keeps the extreme (NaN
    wins), the others add up (sums of counts, sums of weighted values to divide into means)."""
    for key, value in stats.items():
        if key not in totals:
            totals[key] = value
        elif REDUCTIONS.get(key) in (MAX, MIN):
            totals[key] = combine([totals[key], value], REDUCTIONS[key])
        else:
            totals[key] = totals[key] + value


def _as_float(x) -> float:
    if x is None:
        return float("nan")
    return float(x.item() if isinstance(x, torch.Tensor) else x)
