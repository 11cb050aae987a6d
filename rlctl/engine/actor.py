"""The policy being trained: a Hugging Face causal LM inside a DeepSpeed ZeRO engine.

The optimizer is a ``torch.optim.AdamW`` instance (ZeRO accepts it and nothing needs a JIT build),
torch's fused kernel on CPU and CUDA: ZeRO steps one flat fp32 partition, where the unfused update
allocates several temporaries of its full size (a 25M-parameter ZeRO-2 step: 148 -> 67 ms on one CPU
thread, benchmarks/zero_overhead.py). The engine owns the weights, optimizer and lr scheduler; ``log_probs`` and
``update`` are the only two things the trainer asks of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rlctl.config import RunConfig
from rlctl.engine import algos
from rlctl.engine.model import load_causal_lm
from rlctl.engine.runtime import Runtime


@dataclass
class Sequences:
    """A rollout batch. P prompt tokens (left-padded), T response tokens (right-padded)."""

    input_ids: torch.Tensor  # (B, P+T) prompt then response token ids
    attention_mask: torch.Tensor  # (B, P+T) 1 on real prompt tokens and real response tokens
    response_mask: torch.Tensor  # (B, T) 1 on response tokens up to and including the first eos
    prompt_len: int  # P
    # (B, T) fp32 log-probs of the sampled tokens as the rollout engine computed them (0 past the
    # response), or None: compared with the actor's for `rollout/logprob_diff`
    rollout_log_probs: torch.Tensor | None = None

    @property
    def responses(self) -> torch.Tensor:  # (B, T)
        return self.input_ids[:, self.prompt_len :]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx) -> Sequences:
        lp = None if self.rollout_log_probs is None else self.rollout_log_probs[idx]
        return Sequences(self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx], self.prompt_len, lp)

    @staticmethod
    def concat(parts: list[Sequences], pad_id: int) -> Sequences:
        """One batch from several (rounds of dynamic sampling): prompts re-padded on the left, responses
        on the right, to the longest of each."""
        if len(parts) == 1:
            return parts[0]
        P = max(p.prompt_len for p in parts)
        T = max(p.responses.shape[1] for p in parts)
        ids, attn, resp_mask, lps = [], [], [], []
        with_lp = all(p.rollout_log_probs is not None for p in parts)
        for p in parts:
            left, right = P - p.prompt_len, T - p.responses.shape[1]
            ids.append(torch.nn.functional.pad(p.input_ids, (left, right), value=pad_id))
            attn.append(torch.nn.functional.pad(p.attention_mask, (left, right), value=0))
            resp_mask.append(torch.nn.functional.pad(p.response_mask, (0, right), value=0))
            if with_lp:
                lps.append(torch.nn.functional.pad(p.rollout_log_probs, (0, right), value=0.0))
        return Sequences(torch.cat(ids), torch.cat(attn), torch.cat(resp_mask), P, torch.cat(lps) if with_lp else None)


def _deferring_engine_class():
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class _Deferring(CheckpointEngine):
        """DeepSpeed's checkpoint I/O with serialization moved off the training thread.

        ``save`` hands the state dict to ``defer(path, write)``; the snapshot manager calls ``write`` on
        a background thread with a file that hashes and fsyncs as it goes. Without ``defer`` (a plain
        ``save_checkpoint``) it saves at once. ``preserves_storage_sharing`` is False, so DeepSpeed does
        not clone every tensor first: nothing is copied in the training thread at all."""

        def __init__(self):
            super().__init__()
            self.name = "rlctl-deferring"
            self.defer = None

        def create(self, info) -> None:
            pass

        def save(self, state_dict, path: str) -> None:
            if self.defer is None:
                torch.save(state_dict, path)
            else:
                self.defer(path, lambda fh: _save_without_crc(state_dict, fh))

        def load(self, path: str, map_location=None):
            return torch.load(path, map_location=map_location, weights_only=False)

        def commit(self, info) -> bool:
            return True

        def preserves_storage_sharing(self) -> bool:
            return False

    return _Deferring


def _save_without_crc(obj, fh) -> None:
    """torch.save without the zip format's CRC32: the manifest's sha256 covers every byte already."""
    from torch.utils.serialization import config as serialization_config

    previous = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = False
    try:
        torch.save(obj, fh)
    finally:
        serialization_config.save.compute_crc32 = previous


def DeferringCheckpointEngine():  # noqa: N802 - a factory: DeepSpeed is imported lazily
    return _deferring_engine_class()()


def rank_mini_batch(cfg: RunConfig) -> int:
    """Each rank's share of a mini-batch (the config's mini-batch counts sequences over all ranks)."""
    batch = cfg.trainer.prompts_per_step * cfg.algorithm.group_size
    return (cfg.actor.mini_batch_size or batch) // cfg.world_size


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, as transformers' generate does for left-padded prompts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass(frozen=True)
class EngineSpec:
    """What a DeepSpeed engine of rlctl is built from (the actor's or the critic's settings)."""

    lr: float
    zero_stage: int
    grad_clip: float
    mini_batch: int
    micro_batch: int
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0


def ds_config(spec: EngineSpec, dtype: torch.dtype) -> dict:
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.mini_batch // spec.micro_batch,
        "gradient_clipping": spec.grad_clip,
        "zero_optimization": {"stage": spec.zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DSModule:
    """A model inside a DeepSpeed ZeRO engine with a torch AdamW (nothing to JIT-build) and a warm-up
    LambdaLR, whose checkpoints the snapshot manager writes in the background. The actor and the
    critic are both one."""

    def __init__(self, model: torch.nn.Module, spec: EngineSpec, runtime: Runtime):
        import deepspeed

        self.spec, self.runtime = spec, runtime
        self.mini_batch, self.micro_batch = spec.mini_batch, spec.micro_batch
        fused = runtime.device.type in ("cpu", "cuda")  # (torch_npu's AdamW has no fused kernel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay,
                                      fused=fused or None)  # fmt: skip
        warmup = spec.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0
        )
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model.to(runtime.device), optimizer=optimizer, lr_scheduler=scheduler,
            config=ds_config(spec, runtime.dtype),
        )  # fmt: skip
        self._ckpt_engine = DeferringCheckpointEngine()
        self.engine.checkpoint_engine = self._ckpt_engine
        self.fence = None  # called before every optimizer step: waits for snapshot files still being written
        # a decision every rank must take the same way (with several ranks: true only if true on all)
        self.agree: Callable[[bool], bool] = lambda flag: flag
        self.total: Callable[[int], int] = lambda n: n  # an integer summed over the ranks

    def step(self, loss: torch.Tensor) -> None:
        """Backward and (at a mini-batch boundary, DeepSpeed decides) an optimizer step, behind the fence."""
        self.engine.backward(loss)
        if self.fence is not None:
            self.fence()
        self.engine.step()

    def minibatches(self, mask: torch.Tensor, agg_mode: str):
        """(slice of one micro-batch, token weight, loss weight) over the rank's (B, T) response mask,
        mini-batch by mini-batch. DeepSpeed averages gradients over the micro-batches of a mini-batch and over the
        ranks, so a token mean computed per micro-batch would weigh a token of a short micro-batch more
        than one of a long one. Times the token weight (this micro-batch's tokens x micro-batches x
        ranks / the mini-batch's tokens over all ranks), a per-micro-batch token mean becomes its share
        of the mean over every token of the mini-batch on every rank, as one rank with one micro-batch
        computes it (where the weight is exactly 1): for the loss under ``token-mean`` and for the
        token-mean metrics. The loss weight is the token weight under ``agg_mode`` token-mean, else 1:
        aggregation modes that weigh whole sequences need none, every micro-batch holds equally many."""
        n = mask.shape[0]
        scale = self.engine.gradient_accumulation_steps() * self.engine.dp_world_size
        for start in range(0, n, self.mini_batch):
            stop = min(start + self.mini_batch, n)
            tokens = self.total(int(mask[start:stop].sum()))
            for micro in range(start, stop, self.micro_batch):
                idx = slice(micro, min(micro + self.micro_batch, stop))
                tw = int(mask[idx].sum()) * scale / tokens if tokens else 1.0
                yield idx, tw, (tw if agg_mode == "token-mean" else 1.0)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def full_parameters(self) -> contextlib.AbstractContextManager:
        """Context in which every parameter is materialised (ZeRO-3 partitions them), e.g. for generate."""
        if self.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    # -- DirStateful: the engine's own checkpoint format, ZeRO-aware for every stage and rank ----------
    def save_to_dir(self, path: str, defer=None) -> None:
        """DeepSpeed's save_checkpoint, with each file's serialization handed to ``defer`` (the snapshot
        manager's background writer) when given. The files then read the live tensors, so the next
        optimizer step waits at ``fence`` until they are written: the only thing that changes saved
        state is ``engine.step()``."""
        parent, tag = os.path.split(path.rstrip("/"))
        self._ckpt_engine.defer = defer
        try:
            self.engine.save_checkpoint(parent, tag=tag, save_latest=False)
        finally:
            self._ckpt_engine.defer = None

    def load_from_dir(self, path: str) -> None:
        parent, tag = os.path.split(path.rstrip("/"))
        loaded, _ = self.engine.load_checkpoint(
            parent, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state from {path}")

    def set_lr(self, lr: float) -> None:
        """Change the base learning rate (warm-up and schedule still apply on top of it)."""
        sched = self.scheduler
        sched.base_lrs = [lr for _ in sched.base_lrs]
        factor = sched.lr_lambdas[0](sched.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * factor
        sched._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def weights_sha256(self) -> str:
        """A hash of every parameter's bytes, by name: equal hashes mean bit-identical weights."""
        h = hashlib.sha256()
        with self.full_parameters():
            for name, p in sorted(self.module.named_parameters()):
                h.update(name.encode())
                h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

class Actor(DSModule):
    """The policy: a causal LM. ``log_probs`` and ``update`` are all the trainer asks of it."""

    def __init__(self, cfg: RunConfig, model_dir: Path, runtime: Runtime):
        self.cfg = cfg
        mini = rank_mini_batch(cfg)
        spec = EngineSpec(
            lr=cfg.actor.lr, zero_stage=cfg.actor.zero_stage, grad_clip=cfg.actor.grad_clip, mini_batch=mini,
            micro_batch=cfg.actor.micro_batch_size or mini, betas=cfg.actor.betas,
            weight_decay=cfg.actor.weight_decay, warmup_steps=cfg.actor.warmup_steps,
        )  # fmt: skip
        super().__init__(load_causal_lm(model_dir, runtime.dtype, cfg.model.trust_remote_code), spec, runtime)

    def log_probs(
        self, seqs: Sequences, temperature: float, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) log π(response | prompt) of the sampled tokens in fp32 (logits / temperature, as the
        sampler used), and optionally the (B, T) entropy of the token distribution. Gradients flow
        when called outside ``torch.no_grad``."""
        return sequence_log_probs(self.engine, seqs, temperature, with_entropy)

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
        fault drill. ``rollout_log_prob``: the rollout engine's (B, T) log-probs, compared on-policy with
        this forward's (before any optimizer step) for `rollout/logprob_diff`.
        """
        a = self.cfg.algorithm
        horizon = self.cfg.rollout.max_new_tokens
        totals: dict[str, float] = {}
        n_micro = 0
        lr = self.scheduler.get_last_lr()[0]
        for _ in range(a.ppo_epochs):
            for idx, tw, weight in self.minibatches(seqs.response_mask, a.loss_agg_mode):
                mb, mask = seqs.select(idx), seqs.response_mask[idx]
                log_prob, entropy = self.log_probs(mb, self.cfg.rollout.temperature, with_entropy=True)
                if poison and n_micro == 0:  # fault drill: one NaN log-prob, as a broken kernel would give
                    hit = torch.zeros_like(log_prob, dtype=torch.bool)
                    hit[0, 0] = True
                    log_prob = torch.where(hit, torch.full_like(log_prob, float("nan")), log_prob)
                old = log_prob.detach() if old_log_prob is None else old_log_prob[idx]
                pl = algos.compute_policy_loss(
                    log_prob, old, advantages[idx], mask, clip_low=a.clip_low, clip_high=a.clip_high,
                    clip_c=a.clip_ratio_c, agg_mode=a.loss_agg_mode, level=a.importance_ratio,
                )  # fmt: skip
                loss = pl.pg_loss
                entropy_term = algos.agg_loss(entropy, mask, a.loss_agg_mode, horizon)
                if a.entropy_coef:
                    loss = loss - a.entropy_coef * entropy_term
                kl_loss = torch.zeros(())
                if ref_log_prob is not None and not a.kl_in_reward:
                    kl = algos.kl_penalty(log_prob, ref_log_prob[idx], a.kl_estimator)
                    kl_loss = algos.agg_loss(kl, mask, a.loss_agg_mode, horizon)
                    loss = loss + kl_coef * kl_loss
                stats = {  # weighted so that their means over micro-batches and ranks are the batch's
                    "actor/pg_loss": pl.pg_loss.item() * weight,
                    "actor/kl_loss": kl_loss.item() * weight,
                    "actor/ppo_kl": pl.ppo_kl.item() * tw,
                    "actor/pg_clipfrac": pl.pg_clipfrac.item() * tw,
                    "actor/pg_clipfrac_lower": pl.pg_clipfrac_lower.item() * tw,
                    "actor/entropy": algos.masked_mean(entropy, mask).item() * tw,
                    "actor/nonfinite/log_prob": algos.count_nonfinite(log_prob, mask),
                    "actor/nonfinite/loss": float(not torch.isfinite(loss).item()),
                }
                if old_log_prob is None:  # on-policy: the old log-probs are this forward's
                    stats["actor/nonfinite/old_log_prob"] = stats["actor/nonfinite/log_prob"]
                if rollout_log_prob is not None:
                    diff = (log_prob.detach() - rollout_log_prob[idx]).abs()
                    stats["rollout/logprob_diff"] = algos.masked_mean(diff, mask).item() * tw
                boundary = self.engine.is_gradient_accumulation_boundary()
                # every rank applies its micro-batch, or none does: backward and step are collectives
                if self.agree(bool(torch.isfinite(loss))):
                    self.step(loss * weight)
                else:
                    # A non-finite loss is never applied: no backward, its micro-batch adds no gradient.
                    # DeepSpeed still counts the micro-step so accumulation boundaries stay aligned.
                    stats["actor/skipped_updates"] = 1.0
                    if self.micro_batch == self.mini_batch:
                        self.engine.zero_grad()
                    else:
                        self.engine.step()
                if boundary:
                    totals["actor/grad_norm"] = totals.get("actor/grad_norm", 0.0) + _as_float(
                        self.engine.get_global_grad_norm() if "actor/skipped_updates" not in stats else float("nan")
                    )
                    totals["_boundaries"] = totals.get("_boundaries", 0.0) + 1
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
                n_micro += 1
        boundaries = totals.pop("_boundaries", 1.0)
        out = {k: v if _is_count(k) else v / n_micro for k, v in totals.items()}
        out["actor/grad_norm"] = totals.get("actor/grad_norm", float("nan")) / boundaries
        out.setdefault("actor/skipped_updates", 0.0)
        out["actor/lr"] = lr
        return out


def sequence_log_probs(
    model: torch.nn.Module, seqs: Sequences, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = model(
        input_ids=seqs.input_ids,
        attention_mask=seqs.attention_mask,
        position_ids=position_ids_for(seqs.attention_mask),
        use_cache=False,
    )
    P = seqs.prompt_len
    logits = out.logits[:, P - 1 : -1, :].float() / temperature  # (B, T, V): position t predicts token t+1
    log_probs = torch.log_softmax(logits, dim=-1)
    token_lp = log_probs.gather(-1, seqs.responses.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = algos.entropy_from_logits(logits.detach())
    return token_lp, entropy



def _is_count(key: str) -> bool:
    return key.startswith("actor/nonfinite/") or key == "actor/skipped_updates"


def _as_float(x) -> float:
    if x is None:
        return float("nan")
    return float(x.item() if isinstance(x, torch.Tensor) else x)
