"""Advantages, losses and KL estimators (verl's ``core_algos`` semantics, written anew)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            for name in names:
                self._items[name] = fn
            return fn

        return deco

    def __getitem__(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} '{name}'; valid: {', '.join(sorted(self._items))}") from None

    def names(self) -> list[str]:
        return sorted(self._items)


ADV_ESTIMATORS: Registry = Registry("advantage estimator")
KL_ESTIMATORS: Registry = Registry("KL estimator")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1. A NaN at a masked-in position propagates (it is
    never hidden); one at a padding position does not leak in (``x * mask`` would: NaN * 0 is NaN)."""
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros_like(x)).sum()
    return total / keep.sum().clamp(min=1).to(total.dtype)


def count_nonfinite(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Number of NaN/Inf values of ``x`` at masked-in positions (padding is not counted)."""
    return float((~torch.isfinite(x) & mask.bool()).sum().item())


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """(B, T) per-token loss -> scalar. token-mean: every response token of the batch weighs the same."""
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    raise KeyError(f"unknown loss_agg_mode '{mode}'; valid: token-mean")


@ADV_ESTIMATORS.register("grpo")
def grpo_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(B,) scores, consecutive groups of ``group_size`` -> (B,) advantages (r - mean_g) / (std_g + eps).

    std is the unbiased sample std of the group, as in verl and TRL; a group whose scores all tie gets
    zero advantage.
    """
    groups = scores.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + eps)).view(-1)


@KL_ESTIMATORS.register("k1")
def _kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("k2")
def _kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def _kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Schulman's k3, unbiased and non-negative: exp(ref - logp) - (ref - logp) - 1. The log-ratio is
    clamped to [-20, 20] before exp and the result to [-10, 10], as verl does, so it cannot overflow."""
    kl = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (kl.exp() - kl - 1).clamp(-10.0, 10.0)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    """(B, T) log π(a|s), (B, T) log π_ref(a|s) -> (B, T) per-token KL estimate."""
    return KL_ESTIMATORS[estimator](log_prob, ref_log_prob)


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
    agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate.

    (B, T) log π, (B, T) log π_old, (B, T) advantages, (B, T) mask -> (pg_loss, pg_clipfrac, ppo_kl),
    where ppo_kl is the token mean of log π_old - log π and pg_clipfrac the fraction of tokens whose
    clipped term was the active one. The log-ratio is clamped to [-20, 20] before exp.
    """
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    losses = torch.maximum(unclipped, clipped)
    pg_loss = agg_loss(losses, mask, agg_mode)
    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).to(log_prob.dtype), mask)
    ppo_kl = masked_mean(-log_ratio, mask)
    return pg_loss, pg_clipfrac, ppo_kl


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) entropy of softmax(logits), computed in fp32."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
