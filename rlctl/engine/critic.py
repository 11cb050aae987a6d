"""The value model of PPO: a causal LM's backbone with a one-output token head, in its own DeepSpeed
engine (own lr and ZeRO stage), as verl builds it (``AutoModelForTokenClassification``, num_labels=1)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from rlctl import algos
from rlctl.checkpoint.collectives import Collectives
from rlctl.config import RunConfig
from rlctl.engine import lora
from rlctl.engine.batch import Sequences, position_ids_for
from rlctl.engine.dist import MAX, MEAN, MIN
from rlctl.engine.ds_module import DSModule, EngineSpec, rank_mini_batch
from rlctl.engine.runtime import Runtime
from rlctl.errors import InputError


def load_value_model(path: Path, dtype: torch.dtype, trust_remote_code: bool):
    from transformers import AutoModelForTokenClassification

    try:
        return AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # transformers raises many types for an unsupported architecture
        raise InputError(f"cannot build a value model from {path} ('critic.path'): {exc}") from None


# How the ranks reduce each metric ``Critic.update`` reports.
REDUCTIONS = {
    "critic/vf_loss": MEAN,
    "critic/vf_clipfrac": MEAN,
    "critic/grad_norm": MEAN,
    "critic/lr": MEAN,
    "critic/loss_scale": MIN,  # model.dtype fp16 only; the same on every rank, as is the next
    "critic/overflow_skipped": MAX,
}


class Critic(DSModule):
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
        None: critic.zero_stage)."""
        self.cfg = cfg
        mini = rank_mini_batch(cfg)
        spec = EngineSpec(
            lr=cfg.critic.lr,
            zero_stage=cfg.critic.zero_stage if zero_stage is None else zero_stage,
            grad_clip=cfg.critic.grad_clip,
            mini_batch=mini,
            micro_batch=cfg.actor.micro_batch_size or mini,
            max_tokens=cfg.actor.max_tokens_per_micro_batch,
            section="critic",
        )
        path = Path(cfg.critic.path).expanduser() if cfg.critic.path else model_dir
        model = load_value_model(path, runtime.dtype, cfg.model.trust_remote_code)
        if cfg.critic.gradient_checkpointing:
            lora.enable_gradient_checkpointing(model, "critic.gradient_checkpointing")
        super().__init__(model, spec, runtime, collectives=collectives, fence=fence)

    def values(self, seqs: Sequences) -> torch.Tensor:
        """(B, T) V(s_t): the value of the state before each response token (the head's output at the
        position that predicts it), 0 on padding; micro-batch by micro-batch under a token budget."""
        return self.in_pieces(seqs, self._values)

    def _values(self, seqs: Sequences) -> torch.Tensor:
        out = self.engine(
            input_ids=seqs.input_ids,
            attention_mask=seqs.attention_mask,
            position_ids=position_ids_for(seqs.attention_mask),
        )
        P = seqs.prompt_len
        values = out.logits[:, P - 1 : -1, 0].float()
        return values * seqs.response_mask

    def update(self, seqs: Sequences, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """Clipped value-loss updates over the batch, with the actor's epochs and (mini/micro) batches.
        The value loss is aggregated by ``loss_agg_mode``, ``seq-mean-token-sum-norm`` over the actor's
        constant (``rollout.max_new_tokens``), as verl's critic shares the actor's ``loss_scale_factor``."""
        a = self.cfg.algorithm
        totals: dict[str, float] = {}
        n = 0
        overflows = self.overflow_skipped()
        for _ in range(a.ppo_epochs):
            for mb in self.minibatches(seqs):
                mask, weight = mb.tokens(seqs.response_mask), mb.weight(a.loss_agg_mode)
                with lora.training(self.module, self.cfg.critic.gradient_checkpointing):
                    vpreds = self._values(mb.seqs(seqs))
                vf_loss, vf_clipfrac = algos.compute_value_loss(
                    vpreds,
                    mb.tokens(old_values),
                    mb.tokens(returns),
                    mask,
                    self.cfg.critic.cliprange_value,
                    a.loss_agg_mode,
                    horizon=self.cfg.rollout.max_new_tokens,
                )
                self.apply(vf_loss * weight, mb)  # all ranks step, or none; a non-finite loss is never applied
                # weighted so that their means over micro-batches and ranks are the batch's
                for key, value in (
                    ("critic/vf_loss", vf_loss.item() * weight),
                    ("critic/vf_clipfrac", vf_clipfrac.item() * mb.token_weight),
                ):
                    totals[key] = totals.get(key, 0.0) + value
                n += 1
        out = {k: v / n for k, v in totals.items()}
        if not self.step_overflowed():  # a step DeepSpeed skipped on an fp16 overflow has no norm (inf is no fault)
            out["critic/grad_norm"] = float(self.engine.get_global_grad_norm() or 0.0)
        out["critic/lr"] = self.scheduler.get_last_lr()[0]
        if self.engine.fp16_enabled():  # the loss scale after this update, and its steps skipped on overflow
            out["critic/loss_scale"] = self.loss_scale()
            out["critic/overflow_skipped"] = float(self.overflow_skipped() - overflows)
        return out
