"""What cuts a sampling distribution and what ends a completion, shared by both rollout backends.

Filters act on temperature-scaled logits in vLLM's order (``vllm/v1/sample/sampler.py``): temperature,
then min_p, then top_k, then top_p; a filtered-out token gets -inf, so Gumbel-max over the result samples
the truncated distribution renormalised. With every filter off nothing is touched (bit-identical
sampling). Log-probs never see the filters: the rollout's and the actor's both refer to the untruncated
softmax(logits / T) (see docs/sampling.md).

Stop strings are found on decoded text, a sliding window of each completion's last tokens: the
completion ends at the first token after which the window's text holds a stop string. The rule is one
function of the token ids, so the HF loop (checking as it goes) and vLLM (checked after generation)
end the same completion at the same token.
"""

from __future__ import annotations

import torch


def apply_min_p(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """(B, V) temperature-scaled logits -> the same with -inf where a token's probability is below
    ``min_p`` times the row's highest (vLLM's MinPLogitsProcessor)."""
    probs = scaled.softmax(-1)
    threshold = probs.amax(-1, keepdim=True) * min_p
    return scaled.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(scaled: torch.Tensor, k: int) -> torch.Tensor:
    """(B, V) logits -> -inf below the k-th largest of each row (ties with it are kept, as vLLM)."""
    if k >= scaled.shape[-1]:
        return scaled
    kth = scaled.topk(k, dim=-1).values[:, -1:]
    return scaled.masked_fill(scaled < kth, float("-inf"))


def apply_top_p(scaled: torch.Tensor, p: float) -> torch.Tensor:
    """(B, V) logits -> -inf outside the smallest set of most probable tokens whose mass reaches ``p``
    (vLLM's rule: sort ascending, drop while the cumulative mass stays <= 1 - p, keep the top token)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative <= 1 - p
    drop[:, -1] = False
    return scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def truncate(scaled: torch.Tensor, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """(B, V) temperature-scaled logits with min_p, top_k and top_p applied in that order (vLLM's); the
    very tensor given back when all are off (top_p 1, top_k 0 or -1, min_p 0)."""
    if min_p > 0:
        scaled = apply_min_p(scaled, min_p)
    if top_k > 0:
        scaled = apply_top_k(scaled, top_k)
    if top_p < 1:
        scaled = apply_top_p(scaled, top_p)
    return scaled


class StopStrings:
    """Stop strings checked on the text of a completion's last ``window`` tokens: 4 tokens per character
    of the longest stop string (a character spans at most 4 byte-level tokens) and one more for context,
    so decoding stays cheap whatever the completion's length. Empty (falsy) without stop strings."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.window = 4 * max(map(len, self.stops)) + 1 if self.stops else 0

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hits(self, tails: list[list[int]]) -> list[bool]:
        """For each list of token ids (a completion so far), whether its last ``window`` tokens' text
        holds a stop string."""
        texts = self.tokenizer.batch_decode([t[-self.window :] for t in tails], skip_special_tokens=False)
        return [any(s in text for s in self.stops) for text in texts]

    def length(self, ids: list[int], eos_ids: list[int]) -> int:
        """How many of a finished completion's tokens stay: up to and including the first token that
        completes a stop string (eos tokens are never checked: they end a completion themselves), else
        all of them."""
        ends = [k for k, t in enumerate(ids) if t not in eos_ids]
        if not self.stops or not ends:
            return len(ids)
        hit = self.hits([ids[: k + 1] for k in ends])
        return next((k + 1 for k, h in zip(ends, hit) if h), len(ids))

    def cut_text(self, text: str) -> str:
        """The text before the earliest stop string in it (vLLM's include_stop_str_in_output=False)."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return text[: min(found)] if found else text
