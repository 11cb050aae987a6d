"""Advantages, losses and KL estimators (verl's ``core_algos`` semantics, written anew). The names that
choose among them live in ``registry``, which points at the functions here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlctl.algos.groups import (
    baseline,
    grouped,
    present_mean,
    present_members,
    present_std,
    present_ties,
    ties,
)
from rlctl.algos.registry import AGG_MODES, KL_ESTIMATORS, POLICY_LOSS_LEVELS


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1. A NaN at a masked-in position propagates (it is
    never hidden); one at a padding position does not leak in (``x * mask`` would: NaN * 0 is NaN)."""
    keep = mask.bool()
    total = torch.where(keep, x, torch.zeros_like(x)).sum()
    return total / keep.sum().clamp(min=1).to(total.dtype)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-dim max of ``x`` over positions where ``mask`` is 1 (-inf when there is none). A NaN at a
    masked-in position makes it NaN; padding never leaks in."""
    return torch.where(mask.bool(), x, torch.full_like(x, float("-inf"))).max()


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-dim min of ``x`` over positions where ``mask`` is 1 (+inf when there is none). A NaN at a
    masked-in position makes it NaN; padding never leaks in."""
    return torch.where(mask.bool(), x, torch.full_like(x, float("inf"))).min()


def count_nonfinite(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Number of NaN/Inf values of ``x`` at masked-in positions (padding is not counted)."""
    return float((~torch.isfinite(x) & mask.bool()).sum().item())


def _real(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x`` on real tokens, 0 on padding (gradient 0 there too)."""
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(B, T) values, (B, T) mask -> (B, T) values whitened over all masked-in positions of the batch.

    (x - mean) / sqrt(var + eps) with the masked mean and the unbiased (Bessel-corrected) masked
    variance, as verl's ``masked_whiten``; ``shift_mean=False`` adds the mean back (only the spread is
    normalised). Padded positions of the output are 0 and never influence the statistics, NaN included.
    With a single real position the variance is taken as 0 (verl would divide by zero), so that position
    becomes 0 (its own value with ``shift_mean=False``); with none the output is all zeros.
    """
    keep = mask.bool()
    mean = masked_mean(x, keep)
    centered = _real(x - mean, keep)
    var = centered.square().sum() / (keep.sum() - 1).clamp(min=1).to(x.dtype)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return _real(out, keep)


def agg_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", horizon: int | None = None
) -> torch.Tensor:
    """(B, T) per-token loss, (B, T) mask -> scalar, by verl's ``loss_agg_mode``.

    As verl 0.9.0's ``agg_loss`` (``verl/trainer/ppo/core_algos.py`` lines 1140-1206, tag v0.9.0, commit
    483b8a0), on one micro-batch:

    - ``token-mean``: masked mean over every response token of the batch (each token weighs the same).
    - ``seq-mean-token-sum``: each sequence's token sum, then the mean over sequences.
    - ``seq-mean-token-mean``: each sequence's token mean, then the mean over sequences.
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): each sequence's token sum, the MEAN over sequences, divided by
      the constant ``horizon`` (verl's ``loss_scale_factor``; rlctl passes ``rollout.max_new_tokens``, the
      length verl pads every response to and so divides by when ``loss_scale_factor`` is null). It has no
      default: the batch's padded width would be the step's longest response, which changes from step to
      step. verl up to 0.7.0 took the SUM over sequences here (B times larger); verl 0.7.1 and later
      (PR #5417) take the mean, as the Dr. GRPO paper.

    "Mean over sequences" counts the sequences with at least one real token (a fully padded row adds
    nothing), as verl. Padding never leaks in, NaN included: sums go through ``torch.where``.
    ``horizon`` is only read by ``seq-mean-token-sum-norm``.
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    AGG_MODES.canonical(mode)  # an unknown mode: KeyError listing the valid ones
    keep = mask.bool()
    seq_sum = torch.where(keep, loss_mat, torch.zeros_like(loss_mat)).sum(dim=-1)
    n_tokens = keep.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / n_tokens.clamp(min=1).to(seq_sum.dtype)
    elif mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon <= 0:
            raise ValueError(
                f"seq-mean-token-sum-norm needs a constant horizon > 0 (rollout.max_new_tokens), got {horizon}"
            )
        per_seq = seq_sum / horizon
    else:
        per_seq = seq_sum
    n_seqs = (n_tokens > 0).sum().clamp(min=1).to(per_seq.dtype)
    return per_seq.sum() / n_seqs


def policy_agg_mode(agg_mode: str, level: str = "token") -> str:
    """The aggregation mode of the policy-gradient loss: ``agg_mode``, except GSPO (level="sequence"),
    which verl always aggregates as ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (verl 0.9.0
    ``compute_policy_loss_gspo``, core_algos.py line 1605, and every release since GSPO was added in
    PR #2775). ``agg_mode`` still applies to the entropy and KL terms, as in verl."""
    AGG_MODES.canonical(agg_mode)
    return "seq-mean-token-mean" if POLICY_LOSS_LEVELS.canonical(level) == "sequence" else agg_mode


def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Schulman's k3, unbiased and non-negative: exp(ref - logp) - (ref - logp) - 1. The log-ratio is
    clamped to [-20, 20] before exp and the result to [-10, 10], as verl does, so it cannot overflow."""
    kl = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (kl.exp() - kl - 1).clamp(-10.0, 10.0)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    """(B, T) log π(a|s), (B, T) log π_ref(a|s) -> (B, T) per-token KL estimate."""
    return KL_ESTIMATORS[estimator](log_prob, ref_log_prob)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) entropy of softmax(logits), computed in fp32."""
    return entropy_from_log_probs(torch.log_softmax(logits.float(), dim=-1))


def entropy_from_log_probs(logp: torch.Tensor) -> torch.Tensor:
    """(..., V) log-probabilities of a distribution -> (...) its entropy, -sum p log p (the log-probs'
    dtype)."""
    return -(logp.exp() * logp).sum(dim=-1)


# -- verl-style API: token-level rewards, one estimator signature, dataclass results --------------------


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores, (B, T) mask -> (B, T) token rewards: each score on its sequence's last real
    response token, zeros elsewhere (a row with no real token gets no reward)."""
    keep = mask.bool()
    dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    pos = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    last = torch.where(keep, pos, torch.zeros_like(pos)).argmax(dim=-1)
    at_last = torch.nn.functional.one_hot(last, mask.shape[-1]).bool() & keep.any(dim=-1, keepdim=True)
    return _real(scores.to(dtype).unsqueeze(-1).expand(-1, mask.shape[-1]), at_last)


@dataclass
class AdvantageInputs:
    """What every estimator of ``ADVANTAGES`` reads.

    token_rewards: (B, T) per-token rewards: the score on the last real token (``scores_to_token_rewards``),
        minus the per-token KL penalty when KL is folded into the reward (``apply_kl_penalty``).
    mask: (B, T) 1 on real response tokens (right-padded).
    group_size: G, completions per prompt; groups are consecutive rows. B must be a multiple of G.
    values: (B, T) critic values V(s_t) (GAE only).
    gamma, lam: discount and GAE lambda. eps: added to the group std (grpo).
    """

    token_rewards: torch.Tensor
    mask: torch.Tensor
    group_size: int
    values: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    eps: float = 1e-6


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]


def _sequence_rewards(inp: AdvantageInputs) -> torch.Tensor:
    """(B,) outcome reward: the masked sum of the token rewards."""
    r = inp.token_rewards
    return torch.where(inp.mask.bool(), r, torch.zeros_like(r)).sum(dim=-1)


def _to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B/G, G) or (B,) sequence advantages -> (B, T), broadcast over real tokens, 0 on padding."""
    adv = adv.reshape(-1, 1)
    return _real(adv.expand(-1, mask.shape[-1]), mask.bool())


def _outcome(
    inp: AdvantageInputs, centre: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shape every outcome estimator shares: (G groups of) sequence rewards -> ``centre(r, present)``
    (``present``: ``groups.present_members``) -> a tied group gets exactly 0 -> broadcast over real tokens. returns ==
    advantages."""
    r = grouped(_sequence_rewards(inp), inp.group_size)
    present = present_members(inp.mask, inp.group_size)
    adv = centre(r, present)
    if inp.group_size > 1:
        tied = ties(r) if present is None else present_ties(r, present)
        adv = torch.where(tied, torch.zeros_like(adv), adv)
    adv = _to_tokens(adv, inp.mask)
    return adv, adv


@torch.no_grad()
def grpo_outcome_advantage(inp: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (r - group mean) / (group std + eps), unbiased std as verl and TRL. A group whose rewards
    all tie gets exactly 0; a group of one keeps r / (1 + eps) (verl: mean 0, std 1)."""
    if inp.group_size == 1:
        return _outcome(inp, lambda r, _: r / (1.0 + inp.eps))

    def centre(r: torch.Tensor, present: torch.Tensor | None) -> torch.Tensor:
        if present is None:
            return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + inp.eps)
        return (r - present_mean(r, present)) / (present_std(r, present) + inp.eps)

    return _outcome(inp, centre)


@torch.no_grad()
def drgrpo_outcome_advantage(inp: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: r - group mean, no std normalisation (verl's ``norm_adv_by_std_in_grpo=False``). A tied
    group gets exactly 0; a group of one keeps r (verl)."""
    return _outcome(inp, lambda r, present: r - baseline(r, present))


@torch.no_grad()
def rloo_outcome_advantage(inp: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: r_i - mean_{j != i} r_j = (r_i - mean) * G / (G - 1). A group of one keeps r (verl)."""
    g = inp.group_size
    if g == 1:
        return _outcome(inp, lambda r, _: r.clone())

    def centre(r: torch.Tensor, present: torch.Tensor | None) -> torch.Tensor:
        if present is None:
            return (r - r.mean(dim=1, keepdim=True)) * (g / (g - 1))
        n = present.sum(dim=1, keepdim=True).clamp(min=2)
        return (r - present_mean(r, present)) * (n / (n - 1))

    return _outcome(inp, centre)


@torch.no_grad()
def reinforce_plus_plus_baseline_advantage(inp: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: r - group mean (sequence level), broadcast over real tokens, then whitened over
    every real token of the batch (``masked_whiten``). returns == advantages, as verl."""
    r = grouped(_sequence_rewards(inp), inp.group_size)
    adv = masked_whiten(_to_tokens(r - baseline(r, present_members(inp.mask, inp.group_size)), inp.mask), inp.mask)
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, T) rewards -> (B, T) G_t = sum_{k>=t} gamma^(k-t) r_k over the real tokens k of the row; 0 on
    masked positions. A masked hole inside a response (a tool's or the environment's tokens of a multi-turn
    conversation) passes the running return on unchanged, as current verl carries it across tool tokens
    (PRs 7278 and 7300; it restarted at every masked token before): only the padding after the last real
    token, where nothing follows, starts from 0. The hole is no step of the policy, so it is not discounted
    either (as GAE skips it): with gamma 1 this is verl's sum exactly; a row with holes gives the returns of
    the same row with its holes cut out."""
    keep = mask.bool()
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(keep[:, t], running, torch.zeros_like(running))
    return out


@torch.no_grad()
def reinforce_plus_plus_advantage(inp: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: token-level discounted returns of ``token_rewards`` (gamma), advantages = those returns
    whitened over the batch; returns are the un-whitened returns. Groups play no part."""
    returns = _discounted_returns(inp.token_rewards, inp.mask, inp.gamma)
    return masked_whiten(returns, inp.mask), returns


@torch.no_grad()
def gae_advantage(inp: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al.): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, with V
    and A beyond the last real token 0. returns = A + V (the critic's target, un-whitened); advantages are
    then whitened over the batch, as verl. A masked position is skipped (V and A carry over it, verl's
    rule for observation tokens); with right padding that means nothing after the last real token counts.
    Padding of both outputs is 0.
    """
    if inp.values is None:
        raise ValueError("the gae estimator needs critic values (AdvantageInputs.values)")
    keep = inp.mask.bool()
    rewards = torch.where(keep, inp.token_rewards, torch.zeros_like(inp.token_rewards))
    values = torch.where(keep, inp.values, torch.zeros_like(inp.values))
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + inp.gamma * next_value - values[:, t]
        a_t = delta + inp.gamma * inp.lam * next_adv
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        next_adv = torch.where(keep[:, t], a_t, next_adv)
        adv[:, t] = torch.where(keep[:, t], a_t, torch.zeros_like(a_t))
    returns = torch.where(keep, adv + values, torch.zeros_like(adv))
    return masked_whiten(adv, inp.mask), returns


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
    log_prob, old_log_prob, advantages = (_real(x, keep) for x in (log_prob, old_log_prob, advantages))
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
    vpreds, values, returns = (_real(x, keep) for x in (vpreds, values, returns))
    vpred_clipped = torch.clamp(vpreds, values - clip_range_value, values + clip_range_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpred_clipped - returns).square()
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), mask, agg_mode, horizon)
    vf_clipfrac = masked_mean(torch.gt(clipped, unclipped).to(unclipped.dtype), mask)
    return vf_loss, vf_clipfrac.detach()


@torch.no_grad()
def apply_kl_penalty(
    token_rewards: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    estimator: str,
) -> tuple[torch.Tensor, float]:
    """Fold the KL to the reference into the reward (verl's ``apply_kl_penalty``).

    (B, T) token rewards, (B, T) log pi_old(a|s), (B, T) log pi_ref(a|s), (B, T) mask ->
    ((B, T) token_rewards - beta kld, current_kl), kld = kl_penalty(old, ref, estimator) on real tokens
    and 0 on padding; current_kl = the mean over sequences of each sequence's masked mean of kld (the
    value to feed the KL controller; verl updates it with n_steps = B). Sequences with no real token
    are left out of that mean.
    """
    keep = mask.bool()
    kld = kl_penalty(old_log_prob, ref_log_prob, estimator)
    kld = torch.where(keep, kld, torch.zeros_like(kld))
    n_tokens = keep.sum(dim=-1)
    per_seq = kld.sum(dim=-1) / n_tokens.clamp(min=1).to(kld.dtype)
    current_kl = per_seq.sum() / (n_tokens > 0).sum().clamp(min=1).to(kld.dtype)
    return token_rewards - beta * kld, float(current_kl.item())


def tied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) scores, consecutive groups of ``group_size`` -> (B/G,) bool, True where every reward of the
    group is the same: no learning signal, the groups DAPO's dynamic sampling drops. A group of one
    always ties."""
    return ties(grouped(scores, group_size)).squeeze(1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """(B,) response lengths -> (B,) DAPO's soft overlong punishment, added to the reward.

    0 for L <= max_len - buffer_len; ((max_len - buffer_len) - L) / buffer_len * factor in the buffer zone
    (reaching -factor at L = max_len); -factor beyond max_len. (verl's DAPO reward manager computes
    min(-(L - (max_len - buffer_len)) / buffer_len * factor, 0) without the floor, since its responses
    never exceed max_len; the DAPO paper floors at -1.)
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in 1..max_len ({max_len}), got {buffer_len}")
    if factor < 0:
        raise ValueError(f"overlong penalty factor must be >= 0, got {factor}")
    length = lengths.to(torch.get_default_dtype() if not lengths.is_floating_point() else lengths.dtype)
    penalty = ((max_len - buffer_len) - length) / buffer_len * factor
    return penalty.clamp(min=-factor, max=0.0)
