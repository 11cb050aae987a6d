"""Per-token KL estimators to the reference policy (Schulman's k1, k2, k3) and the entropy of a
distribution, from log-probs."""

from __future__ import annotations

import torch

from rlctl.algos.registry import KL_ESTIMATORS


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
