"""The policy-gradient and value losses (verl's ``compute_policy_loss`` and ``compute_value_loss``
semantics, written anew): PPO's clipped surrogate with dual clip, at the token or the sequence level
(GSPO), and the clipped value loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlctl.algos.masked import agg_loss, masked_max, masked_mean, policy_agg_mode, real_only
from rlctl.algos.registry import POLICY_LOSS_LEVELS


@dataclass
class PolicyLoss:
    """``pg_loss`` carries the gradient; the rest are 0-dim metrics (detached).

    pg_clipfrac: fraction of real tokens where the clipped term was the active one.
    ppo_kl: masked mean of log pi_old - log pi (token log-ratios, clamped at the token level).
    pg_clipfrac_lower: fraction of real tokens (all of them, as verl) that have A < 0 and where the dual
        clip was active; 0 without dual clip and for GSPO.
    ratio_max: the largest per-token importance ratio exp(log pi - log pi_old) over real tokens, before
        any clamp or clip (fp64, so it reads 5e8 where that is the truth; inf past ~1e308; 0 with no real
        token; NaN when a log-prob is NaN). Exactly 1.0 on-policy, where log pi_old is log pi detached.
    """

    pg_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    ppo_kl: torch.Tensor
    pg_clipfrac_lower: torch.Tensor
    ratio_max: torch.Tensor


def _importance_ratio(
    log_prob: torch.Tensor, log_ratio: torch.Tensor, keep: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log pi, (B, T) log pi - log pi_old, (B, T) bool mask -> ((B, T) importance ratio, (B, T) the
    log-ratios ppo_kl is taken from). token: exp of the log-ratio clamped to [-20, 20] (the clamped
    log-ratio for ppo_kl, as verl); sequence: GSPO's sg[s_i] pi_t / sg[pi_t], its log clamped at 10."""
    if level == "token":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return log_ratio.exp(), log_ratio
    seq_log_ratio = log_ratio.sum(dim=-1) / keep.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    log_is = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    return log_is.clamp(max=10.0).exp(), log_ratio


def _dual_clip(
    losses: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_c: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO: (B, T) clipped-surrogate losses -> (those of the tokens with A < 0 capped at -A clip_c,
    pg_clipfrac_lower: the share of tokens where the cap was active); ``clip_c`` None: unchanged and 0."""
    if clip_c is None:
        return losses, torch.zeros((), dtype=losses.dtype, device=losses.device)
    capped = -advantages * clip_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(losses, capped) & negative).to(losses.dtype), mask)
    return torch.where(negative, torch.minimum(losses, capped), losses), pg_clipfrac_lower


def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = 3.0,
    agg_mode: str = "token-mean",
    level: str = "token",
    horizon: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO's clipped surrogate, verl's ``vanilla`` (level="token") and ``gspo`` (level="sequence") losses
    (verl 0.9.0 ``compute_policy_loss_vanilla`` and ``compute_policy_loss_gspo``, core_algos.py lines
    1286-1376 and 1546-1618).

    (B, T) log pi(a|s), (B, T) log pi_old(a|s), (B, T) advantages, (B, T) mask -> PolicyLoss.

    token: ratio = exp(clamp(log pi - log pi_old, -20, 20)), clipped to [1 - clip_low, 1 + clip_high]
        (DAPO's clip-higher when they differ); loss = max(-A ratio, -A clip(ratio)). With ``clip_c``
        (dual-clip PPO, must be > 1) the loss of a token with A < 0 is further capped at -A clip_c.
    sequence (GSPO): s_i = exp(mean over the real tokens of sequence i of the log-ratios), applied to each
        token with that token's own gradient: log s_i,t = sg[log s_i] + log pi_t - sg[log pi_t], clamped
        at 10 before exp as verl; clipped with clip_low/clip_high; ``clip_c`` is ignored (no dual clip).
        Aggregated as ``seq-mean-token-mean`` whatever ``agg_mode`` is, as verl and the GSPO paper
        (``policy_agg_mode``).
    The per-token losses are reduced by ``agg_loss(.., policy_agg_mode(agg_mode, level), horizon)``
    (``horizon``: the constant of ``seq-mean-token-sum-norm``); padding never influences anything.
    ``token_weights``: (B, T) factors of the per-token losses, without gradient, applied after the clips and
    before the aggregation (the off-policy correction, ``rollout_correction``; verl multiplies its
    ``rollout_is_weights`` in at the same place); None: no factor, not even a multiplication by 1.
    """
    POLICY_LOSS_LEVELS.canonical(level)  # an unknown level: KeyError listing the valid ones
    keep = mask.bool()
    # Padding is zeroed up front, so it cannot reach the loss nor send a NaN gradient (0 * NaN) back.
    log_prob, old_log_prob, advantages = (real_only(x, keep) for x in (log_prob, old_log_prob, advantages))
    if level == "token" and clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"the dual-clip bound clip_c must be > 1, got {clip_c}")
    log_ratio = log_prob - old_log_prob
    ratio_max = masked_max(log_ratio.detach(), keep).double().exp()
    ratio, log_ratio = _importance_ratio(log_prob, log_ratio, keep, level)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).to(losses.dtype), mask)
    losses, pg_clipfrac_lower = _dual_clip(losses, advantages, mask, clip_c if level == "token" else None)
    if token_weights is not None:
        losses = losses * token_weights.detach()
    return PolicyLoss(
        pg_loss=agg_loss(losses, mask, policy_agg_mode(agg_mode, level), horizon),
        pg_clipfrac=pg_clipfrac.detach(),
        ppo_kl=masked_mean(-log_ratio, mask).detach(),
        pg_clipfrac_lower=pg_clipfrac_lower.detach(),
        ratio_max=ratio_max,
    )


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range_value: float,
    agg_mode: str = "token-mean",
    horizon: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (verl 0.9.0 ``compute_value_loss``, core_algos.py lines 2124-2184, whose
    argument order is vpreds, returns, values).

    (B, T) V_new(s), (B, T) V_old(s) (the values at rollout), (B, T) returns, (B, T) mask ->
    (vf_loss, vf_clipfrac): vpred_clipped = vpreds clamped to [values - c, values + c] (verl's
    ``clip_by_value``: exactly ``vpreds`` inside the range, where ``values + clamp(vpreds - values)`` would
    round away from it in fp32); vf_loss = 0.5 agg(max((vpreds - R)^2, (vpred_clipped - R)^2));
    vf_clipfrac = masked mean of (clipped loss > unclipped loss) (detached), so 0 when nothing is clipped.
    ``horizon``: the constant of ``seq-mean-token-sum-norm`` (``agg_loss``).
    """
    keep = mask.bool()
    vpreds, values, returns = (real_only(x, keep) for x in (vpreds, values, returns))
    vpred_clipped = torch.clamp(vpreds, values - clip_range_value, values + clip_range_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpred_clipped - returns).square()
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), mask, agg_mode, horizon)
    vf_clipfrac = masked_mean(torch.gt(clipped, unclipped).to(unclipped.dtype), mask)
    return vf_loss, vf_clipfrac.detach()
