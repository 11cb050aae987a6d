"""From rewards to advantages (verl's ``core_algos`` semantics, written anew): sequence scores as token
rewards, the KL to the reference folded into them, every estimator of ``ADVANTAGES`` behind one
signature, and DAPO's reward-side helpers (tied groups, the overlong penalty)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlctl.algos.divergence import kl_penalty
from rlctl.algos.groups import (
    baseline,
    grouped,
    present_mean,
    present_members,
    present_std,
    present_ties,
    ties,
)
from rlctl.algos.masked import masked_whiten, real_only


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores, (B, T) mask -> (B, T) token rewards: each score on its sequence's last real
    response token, zeros elsewhere (a row with no real token gets no reward)."""
    keep = mask.bool()
    dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
    pos = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    last = torch.where(keep, pos, torch.zeros_like(pos)).argmax(dim=-1)
    at_last = torch.nn.functional.one_hot(last, mask.shape[-1]).bool() & keep.any(dim=-1, keepdim=True)
    return real_only(scores.to(dtype).unsqueeze(-1).expand(-1, mask.shape[-1]), at_last)


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
    return real_only(adv.expand(-1, mask.shape[-1]), mask.bool())


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
