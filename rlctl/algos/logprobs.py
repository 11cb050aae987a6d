"""Log-probs and entropy of the sampled tokens from a causal LM's logits, a chunk of positions at a time.

The full way (``log_softmax`` of the whole fp32 (B, T, V) logits, kept for the backward, and a second
pass for the entropy) holds several fp32 copies of the logits; at T = 1,024 and Qwen2.5's V = 151,936
each is 0.6 GB per sequence. Here the forward keeps only the (B, T) results and the backward recomputes
each chunk's softmax from the logits it was given (which the model holds anyway), so no more than one
chunk's fp32 temporaries exist at a time. Per position the operations are the full way's (scale,
``log_softmax``, gather; the entropy of the same log-softmax), so the values are the same bits; the
gradients are the same formulas (``log_softmax``'s backward, the entropy's derivative) up to fp32
rounding.

The temperature scales the logits as the run's sampler did (``scale_logits``), so that the log-probs are
those of the distribution the tokens were drawn from, to the last bit.
"""

from __future__ import annotations

import torch

from rlctl.algos.divergence import entropy_from_log_probs

# How the samplers of ``rollout.sampler`` divide logits by the temperature: the counter sampler multiplies
# by the reciprocal (the CPU and CUDA round it the same); the generator sampler (every run before the key
# existed) divides, and its runs resume bit for bit only if the actor keeps dividing.
SAMPLERS = ("counter", "generator")

# fp32 elements of one chunk's logits (rows x positions x V) at most: 2**25 is 128 MiB, a tenth of one
# fp32 copy of Qwen2.5's logits for two 1,024-token responses; a chunk holds at least one position.
CHUNK_ELEMENTS = 2**25


def scale_logits(logits: torch.Tensor, temperature: float, sampler: str) -> torch.Tensor:
    """(..., V) logits -> (..., V) fp32 logits scaled by the temperature as ``sampler`` did:
    ``logits.float() * (1.0 / temperature)`` for "counter", ``logits.float() / temperature`` for
    "generator". The two differ in the last bit of some values."""
    if sampler == "counter":
        return logits.float() * (1.0 / temperature)
    if sampler == "generator":
        return logits.float() / temperature
    raise ValueError(f"unknown sampler {sampler!r}; valid: {', '.join(SAMPLERS)}")


def _unscale(grad: torch.Tensor, temperature: float, sampler: str) -> torch.Tensor:
    """(..., V) fp32 gradient with respect to the scaled logits -> with respect to the logits, as
    autograd's backward of ``scale_logits`` computes it."""
    if sampler == "counter":
        return grad * (1.0 / temperature)
    return grad / temperature


def chunk_positions(rows: int, vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Positions per chunk: as many as keep rows x positions x ``vocab`` within ``elements``, at least 1."""
    return max(1, elements // max(1, rows * vocab))


class _TokenLogProbs(torch.autograd.Function):
    """(B, L, V) logits, (B, T) tokens, the position ``first`` whose logits predict token 0 ->
    (B, T) fp32 log-probs, (B, T) fp32 entropies (zeros when not asked for). Saves the logits (not a
    copy), the tokens and the entropies; the backward recomputes the softmax chunk by chunk, into a new
    tensor or, with ``in_place``, into the logits themselves (``token_log_probs``)."""

    @staticmethod
    def forward(ctx, logits, tokens, first, temperature, sampler, chunk, with_entropy, in_place):
        B, T = tokens.shape
        token_lp = torch.empty(B, T, dtype=torch.float32, device=logits.device)
        entropy = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            logp = torch.log_softmax(scale_logits(logits[:, first + s : first + e], temperature, sampler), dim=-1)
            token_lp[:, s:e] = logp.gather(-1, tokens[:, s:e].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropy[:, s:e] = entropy_from_log_probs(logp)
            del logp
        ctx.save_for_backward(logits, tokens, entropy)
        ctx.spec = (first, temperature, sampler, chunk, in_place)
        ctx.set_materialize_grads(False)
        return token_lp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, tokens, entropy = ctx.saved_tensors
        first, temperature, sampler, chunk, in_place = ctx.spec
        T = tokens.shape[1]
        if in_place:  # (an in-place write bumps the logits' version: a node that saved them fails loudly)
            grad = logits
            grad[:, :first].zero_()
            grad[:, first + T :].zero_()
        else:
            grad = torch.zeros_like(logits)
        if g_lp is None and g_ent is None:
            return grad.zero_(), None, None, None, None, None, None, None
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            grad[:, first + s : first + e] = _chunk_grad(
                logits[:, first + s : first + e],
                tokens[:, s:e],
                entropy[:, s:e],
                None if g_lp is None else g_lp[:, s:e],
                None if g_ent is None else g_ent[:, s:e],
                temperature,
                sampler,
            )
        return grad, None, None, None, None, None, None, None


def _chunk_grad(logits, tokens, entropy, g_lp, g_ent, temperature: float, sampler: str) -> torch.Tensor:
    """One chunk's gradient with respect to its (B, c, V) logits, in their dtype, from the (B, c)
    gradients of its log-probs and entropies (either may be None: unused). With p = softmax(z), z the
    scaled logits: d log p_y / dz = onehot(y) - p (``log_softmax``'s backward); dH / dz = -p (log p + H)."""
    logp = torch.log_softmax(scale_logits(logits, temperature, sampler), dim=-1)
    p = logp.exp()
    if g_lp is not None:
        gz = p * -g_lp.unsqueeze(-1)
        gz.scatter_add_(-1, tokens.unsqueeze(-1), g_lp.unsqueeze(-1))
    else:
        gz = torch.zeros_like(p)
    if g_ent is not None:
        gz -= p * (logp + entropy.unsqueeze(-1)) * g_ent.unsqueeze(-1)
    del logp, p
    return _unscale(gz, temperature, sampler).to(logits.dtype)


def token_log_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    sampler: str,
    *,
    first: int = 0,
    with_entropy: bool = False,
    chunk: int | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, L, V) logits of any float dtype, (B, T) sampled token ids -> (B, T) fp32 log-probs of the tokens
    under softmax(``scale_logits``), and the (B, T) fp32 entropy of that distribution when
    ``with_entropy`` (else None). Position ``first + t`` of the logits predicts ``tokens[:, t]``
    (L >= first + T). Gradients flow to the logits from both outputs when called with grad enabled.
    ``chunk``: positions per chunk (default ``chunk_positions``: about ``CHUNK_ELEMENTS`` fp32 values).

    ``in_place``: the backward writes the gradient into the logits' own memory (as Liger-kernel's cross
    entropy does), so the forward and backward together hold one (B, L, V) tensor, not two. Only for
    logits nothing else reads after the backward, such as a model output the caller drops; a graph node
    that saved them for its own backward then fails on autograd's version check rather than compute
    with the overwritten values."""
    B, T = tokens.shape
    if logits.shape[1] < first + T:
        raise ValueError(f"logits have {logits.shape[1]} positions; tokens need {first + T} from {first}")
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; valid: {', '.join(SAMPLERS)}")
    chunk = chunk or chunk_positions(B, logits.shape[-1])
    token_lp, entropy = _TokenLogProbs.apply(logits, tokens, first, temperature, sampler, chunk, with_entropy, in_place)
    return token_lp, entropy if with_entropy else None
