"""Off-policy correction against the rollout engine's log-probs (``algorithm.rollout_correction``).

The rollout engine (vLLM, or the HF sampler) samples with log-probs that differ slightly from the
trainer's: another kernel, another precision, a stale weight sync. The clipped surrogate assumes the
tokens were sampled by pi_old, the trainer's policy before the update; they were sampled by pi_rollout.
The token-level importance ratio between the two corrects for it (verl's decoupled rollout correction
with ``rollout_is: token``, after Yao et al., "Your efficient RL framework secretly brings you
off-policy RL training"):

    rho_t = pi_old(a_t | s_t) / pi_rollout(a_t | s_t) = exp(log pi_old - log pi_rollout)

``tis`` (truncated importance sampling) multiplies each token's policy-gradient loss by min(rho_t, cap);
``masked`` (token-level rejection) gives weight 0 to the tokens whose rho_t is outside [1/cap, cap] and
1 to the others. The weights carry no gradient: pi_old and pi_rollout are both fixed. Nothing here does
I/O; shapes: B sequences, T response tokens, ``mask`` (B, T) with 1 on the tokens that train.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlctl.algos.masked import masked_max, masked_mean
from rlctl.algos.registry import ROLLOUT_CORRECTIONS

# the bound on |log rho_t| before exp, as verl's safety bound: exp(20) ~ 5e8, never inf
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """``weights``: (B, T) the factor of each token's policy-gradient loss, detached, 0 on the tokens the
    mask leaves out. The rest are 0-dim metrics (detached), over the tokens of ``mask``:

    ratio_mean: the mean of rho_t (its log bounded to [-20, 20]), before any cap: 1.0 when the rollout
        engine and the trainer agree.
    ratio_max: the largest rho_t, before any bound or cap (fp64, as ``PolicyLoss.ratio_max``; 0 with no
        token; NaN when a log-prob is NaN).
    clipfrac: tis: the share of tokens whose rho_t exceeded the cap (their weight is the cap); masked: the
        share of tokens outside [1/cap, cap] (their weight is 0).
    """

    weights: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    clipfrac: torch.Tensor


def _ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, T) rho_t with its log bounded, 1.0 off the mask (so that nothing left out is capped or masked)."""
    log_ratio = (old_log_prob.detach() - rollout_log_prob.detach()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(keep, log_ratio, torch.zeros_like(log_ratio)).exp()


@torch.no_grad()
def truncated_is(ratio: torch.Tensor, keep: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """tis: ((B, T) weights min(rho_t, cap), (B, T) bool: the tokens capped). A NaN rho_t stays NaN (a
    NaN log-prob must reach the loss and its nonfinite counters, not be hidden)."""
    capped = keep & (ratio > cap)
    return ratio.clamp(max=cap), capped


@torch.no_grad()
def masked_is(ratio: torch.Tensor, keep: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """masked: ((B, T) weights 1 inside [1/cap, cap] and 0 outside, (B, T) bool: the tokens masked). A NaN
    rho_t weighs NaN, as in ``truncated_is``."""
    outside = keep & ((ratio < 1.0 / cap) | (ratio > cap))
    weights = torch.where(outside, torch.zeros_like(ratio), torch.ones_like(ratio))
    return torch.where(ratio.isnan(), ratio, weights), outside


@torch.no_grad()
def rollout_correction(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> RolloutCorrection:
    """(B, T) log pi_old(a|s), (B, T) log pi_rollout(a|s), (B, T) mask, a mode of ``ROLLOUT_CORRECTIONS``
    (tis, masked) and its cap (> 1) -> RolloutCorrection. Tokens off the mask (padding, the tools'
    tokens of a multi-turn conversation, whose rollout log-prob is 0) weigh 0 and count in no metric."""
    if not cap > 1.0:
        raise ValueError(f"the rollout correction's cap must be > 1, got {cap}")
    keep = mask.bool()
    ratio = _ratio(old_log_prob, rollout_log_prob, keep)
    weights, hit = ROLLOUT_CORRECTIONS[mode](ratio, keep, cap)
    dtype = ratio.dtype
    return RolloutCorrection(
        weights=torch.where(keep, weights, torch.zeros_like(weights)),
        ratio_mean=masked_mean(ratio, keep),
        ratio_max=masked_max(old_log_prob.detach() - rollout_log_prob.detach(), keep).double().exp(),
        clipfrac=masked_mean(hit.to(dtype), keep),
    )
