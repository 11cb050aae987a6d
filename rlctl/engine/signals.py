"""Degeneration signals of a rollout batch, from its response token ids alone (no forward pass).

A run that collapses into ``!!!!!!!!`` (verl #721, #747, #2626, #3159) shows it in its samples before
anything else. Per response of L real tokens (positions where the response mask is 1; padding is
ignored, and breaks a run):

- **repetition**: the share of its tokens taken by its most frequent token, ``c_1 / L``.
- **longest run**: the longest stretch of one token repeated back to back, as a share of L.
- **n-gram share** ``s_n`` for n = 1..4: the share of its tokens covered by the occurrences of its most
  frequent n-gram (the one that starts at the most positions; overlapping occurrences cover a token
  once: ``7 7 7`` is covered 3/3 by ``7 7``, not 4/3). An n-gram (n >= 2) that occurs only once
  covers nothing: a single occurrence is no repetition. ``s_1`` is the repetition share.
- **degenerate**: ``L >= MIN_TOKENS`` (8) and ``max_n s_n >= SHARE`` (0.5): one token, or one n-gram of
  up to four tokens, covers at least half of the response. ``!!!!!!!!`` and ``abababab`` are degenerate,
  ``aaab cde fg`` is not (4 of 11); a response of fewer than 8 tokens never is (an answer like ``42`` repeats by
  necessity).

A response with no real token has shares 0. Everything is vectorised over the (B, T) batch: n-grams
are counted by sorting their windows (packed into int64 keys) and measuring the longest run of equal
neighbours, so the cost is a few sorts of a (B, T) tensor, with no Python loop over tokens (about
30 ms for 256 responses of 512 tokens on one CPU thread).
"""

from __future__ import annotations

import torch

MIN_TOKENS = 8  # shorter responses are never called degenerate
SHARE = 0.5  # the n-gram share at or above which a response is degenerate
MAX_N = 4  # the longest n-gram looked at
_BITS = 62  # bits of an int64 key the packed columns may use (non-negative, -1 marks an invalid window)


def longest_equal_run(cols: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """(B, W) key columns, (B, W) bool valid -> (B,) the longest run of consecutive valid positions whose
    keys (all columns) equal their left neighbour's, counted in positions (0 for a row with none valid)."""
    if valid.shape[1] == 0:
        return torch.zeros(valid.shape[0], dtype=torch.long, device=valid.device)
    return _runs(cols, valid).max(dim=1).values


def _runs(cols: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """(B, W) the length of the run of equal keys ending at each valid position (0 where not valid)."""
    B, W = valid.shape
    same = valid[:, 1:] & valid[:, :-1]
    for c in cols:
        same = same & (c[:, 1:] == c[:, :-1])
    same = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=valid.device), same], dim=1)
    idx = torch.arange(W, device=valid.device).expand(B, W)
    start = torch.where(same, torch.zeros_like(idx), idx).cummax(dim=1).values  # where each run began
    return torch.where(valid, idx - start + 1, torch.zeros_like(idx))


def _windows(ids: torch.Tensor, keep: torch.Tensor, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(B, T) ids and mask -> the n columns of the (B, T-n+1) n-gram windows, and which windows lie on
    real tokens only."""
    W = ids.shape[1] - n + 1
    cols = [ids[:, k : k + W] for k in range(n)]
    valid = keep[:, :W].clone()
    for k in range(1, n):
        valid &= keep[:, k : k + W]
    return cols, valid


def _packed(cols: list[torch.Tensor], valid: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """The columns packed into as few int64 keys as fit in ``_BITS`` bits each, most significant first;
    an invalid window is -1 in every key (so invalid windows sort together, apart from the valid)."""
    per = max(1, _BITS // bits)
    keys = []
    for lo in range(0, len(cols), per):
        key = torch.zeros_like(cols[0])
        for c in cols[lo : lo + per]:
            key = (key << bits) | c
        keys.append(torch.where(valid, key, torch.full_like(key, -1)))
    return keys


def mode_cover(cols: list[torch.Tensor], valid: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) how often each row's most frequent valid window starts, and (B,) how many positions its
    occurrences cover together (overlaps counted once). Windows are sorted lexicographically (one
    sort per packed key, stable, least significant key first); the longest run of equal neighbours is
    the most frequent window (on a tie, the smallest)."""
    keys = _packed(cols, valid, bits)
    if len(keys) == 1:
        ranked = [keys[0].sort(dim=1).values]
    else:
        order = keys[-1].argsort(dim=1, stable=True)
        for key in reversed(keys[:-1]):
            order = order.gather(1, key.gather(1, order).argsort(dim=1, stable=True))
        ranked = [key.gather(1, order) for key in keys]
    count, at = _runs(ranked, ranked[0] >= 0).max(dim=1)
    starts = valid.clone()
    for key, sorted_key in zip(keys, ranked):
        starts &= key == sorted_key.gather(1, at.unsqueeze(1))
    n = len(cols)
    seen = torch.nn.functional.pad(starts.long(), (n, n - 1)).cumsum(dim=1)  # (B, T + n): starts up to t - n
    covered = (seen[:, n:] - seen[:, :-n]) > 0  # position t is covered by a start in [t - n + 1, t]
    return count, covered.sum(dim=1)


def ngram_shares(ids: torch.Tensor, mask: torch.Tensor, max_n: int = MAX_N) -> torch.Tensor:
    """(B, T) token ids, (B, T) mask -> (B, max_n) share ``s_n`` of each response's tokens that its most
    frequent n-gram covers, n = 1..max_n (0 where the response is empty, shorter than n, or has no
    n-gram twice)."""
    keep = mask.bool()
    ids = torch.where(keep, ids.long(), torch.zeros_like(ids, dtype=torch.long))
    lengths = keep.sum(dim=1).clamp(min=1)
    bits = max(1, int(ids.max()).bit_length()) if ids.numel() else 1
    shares = []
    for n in range(1, max_n + 1):
        if n > ids.shape[1]:
            shares.append(torch.zeros(ids.shape[0], device=ids.device))
            continue
        cols, valid = _windows(ids, keep, n)
        count, covered = mode_cover(cols, valid, bits)
        if n > 1:  # an n-gram seen once is no repetition (else 4 / 8 for any 8 distinct tokens)
            covered = torch.where(count >= 2, covered, torch.zeros_like(covered))
        shares.append(covered / lengths)
    return torch.stack(shares, dim=1).float()


def degeneration_metrics(responses: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """(B, T) response token ids, (B, T) response mask -> the batch's degeneration metrics: means and
    maxima over responses of the repetition and longest-run shares, and the share of degenerate
    responses (see the module docstring for the exact definitions)."""
    keep = mask.bool()
    lengths = keep.sum(dim=1)
    shares = ngram_shares(responses, keep)
    run = longest_equal_run([responses], keep) / lengths.clamp(min=1)
    degenerate = (lengths >= MIN_TOKENS) & (shares.max(dim=1).values >= SHARE)
    repetition = shares[:, 0]
    return {
        "response/repetition/mean": repetition.mean().item(),
        "response/repetition/max": repetition.max().item(),
        "response/longest_run/mean": run.float().mean().item(),
        "response/longest_run/max": run.float().max().item(),
        "response/degenerate_frac": degenerate.float().mean().item(),
    }
