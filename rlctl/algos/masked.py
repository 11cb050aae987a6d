"""Reductions over a batch's response mask and the loss's aggregation modes: means, extremes and
whitening over real tokens only (padding never leaks in, NaN included), and verl's ``loss_agg_mode``."""

from __future__ import annotations

import torch

from rlctl.algos.registry import AGG_MODES, POLICY_LOSS_LEVELS


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


def real_only(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
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
    centered = real_only(x - mean, keep)
    var = centered.square().sum() / (keep.sum() - 1).clamp(min=1).to(x.dtype)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return real_only(out, keep)


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
