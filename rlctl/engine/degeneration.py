"""Degeneration signals of a rollout batch, from its response token ids alone (no forward pass).

A run that collapses into ``!!!!!!!!`` (verl #721, #747, #2626, #3159) shows it in its samples before
anything else. Per response of L real tokens (positions where the response mask is 1; padding is
ignored, and breaks a run):

- **repetition**: the share of its tokens taken by its most frequent token, ``c_1 / L``.
- **longest run**: the longest stretch of one token repeated back to back, as a share of L.
- **n-gram share** ``s_n`` for n = 1..4: the share of its tokens covered by the occurrences of its most
  frequent n-gram (the one that starts at the most positions; overlapping occurrences cover a token
  once: ``7 7 7`` is covered 3/3 by ``7 7``, not 4/3). When several n-grams are equally frequent, the one
  whose occurrences cover the most tokens counts (``a a a b c b c``: ``a a`` and ``b c`` both start twice,
  ``a a`` covers 3 tokens, ``b c`` 4, so ``s_2`` is 4/7), whatever order the sort left them in. An n-gram
  (n >= 2) that occurs only once covers nothing: a single occurrence is no repetition. ``s_1`` is the
  repetition share.
- **degenerate**: ``L >= MIN_TOKENS`` (8) and ``max_n s_n >= SHARE`` (0.5): one token, or one n-gram of
  up to four tokens, covers at least half of the response. ``!!!!!!!!`` and ``abababab`` are degenerate;
  ``aaab cde fg`` (one token a character, the spaces too) is not: ``a`` and ``a a`` cover 3 of its 11
  tokens. A response of fewer than 8 tokens never is (an answer like ``42`` repeats by necessity).

A response with no real token has shares 0. Everything is vectorised over the (B, T) batch: n-grams
are counted by sorting their windows (packed into int64 keys) and measuring the runs of equal
neighbours, so the cost is a few sorts of a (B, T) tensor, with no Python loop over tokens (about
30-40 ms for 256 responses of 512 tokens on one CPU thread).
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
    idx = torch.arange(valid.shape[1], device=valid.device)
    return (idx - _run_starts(cols, valid) + 1) * valid


def _run_starts(cols: list[torch.Tensor], valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B, W) key columns -> (B, W) the position where the run of equal keys (all columns) that holds
    each position began; with ``valid``, an invalid position is a run of its own."""
    W = cols[0].shape[1]
    same = cols[0][:, 1:] == cols[0][:, :-1]
    for c in cols[1:]:
        same &= c[:, 1:] == c[:, :-1]
    if valid is not None:
        same &= valid[:, 1:] & valid[:, :-1]
    same = torch.nn.functional.pad(same, (1, 0), value=False)
    idx = torch.arange(W, device=same.device)
    return idx.masked_fill(same, 0).cummax(dim=1).values


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
    occurrences cover together (overlaps counted once); among equally frequent windows, the largest
    cover. Windows are sorted lexicographically (one stable sort per packed key, least significant key
    first), so equal windows lie together with their starts ascending. Along each group, the count so
    far and the overlap so far (a start less than n after the previous one overlaps it by n minus the
    distance) are running sums; cover = n x count - overlap. The largest (count, -overlap) pair is taken
    by value, never by the index of a maximum, so ties are settled the same on every device."""
    keys = _packed(cols, valid, bits)
    n, W = len(cols), valid.shape[1]
    if len(keys) == 1:
        first, order = keys[0].sort(dim=1, stable=True)
        ranked = [first]
    else:
        order = keys[-1].argsort(dim=1, stable=True)
        for key in reversed(keys[:-1]):
            order = order.gather(1, key.gather(1, order).argsort(dim=1, stable=True))
        ranked = [key.gather(1, order) for key in keys]
    start = _run_starts(ranked)  # an invalid window is -1 in every key: a group of its own, first
    since = torch.arange(W, device=valid.device) - start  # the count so far, less 1
    scale = n * W + 1  # above any overlap: rank = (count - 1) x scale - overlap orders by count, then cover
    rank = since * scale
    if n > 1:  # a single token never overlaps itself: its cover is its count
        overlap = torch.nn.functional.pad((n - order.diff(dim=1)).clamp_(min=0), (1, 0))
        overlap = overlap.masked_fill_(since == 0, 0).cumsum_(dim=1)
        rank -= overlap - overlap.gather(1, start)  # the group's overlap up to here
    worst = rank.masked_fill_(ranked[0] < 0, -scale).max(dim=1).values.neg_()  # scale: no valid window
    count = 1 - worst // scale
    return count, count * n - worst % scale


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
