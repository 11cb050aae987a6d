"""How a rank's share of a mini-batch is cut into micro-batches, and what each one weighs.

Two ways. A fixed number of sequences per micro-batch (``actor.micro_batch_size``; the whole share
when unset), in batch order. Or a token budget (``actor.max_tokens_per_micro_batch``, verl's
``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``): the sequences sorted by length, longest
first, and cut so that no micro-batch's padded size (its rows x its longest prompt plus its longest
response) exceeds the budget; each micro-batch then drops the prompt columns that are padding in all
its rows and the response columns past its longest response (a response's extent: up to its last
attended token, the tools' tokens of a multi-turn response included). Sequences of like length travel
together, so the padding every forward and backward computes shrinks to what is left inside a
micro-batch. A sequence longer than the budget is a micro-batch of its own. The ranks agree on a
count (the largest any rank needs; the others split their largest micro-batches), because every
backward is a collective under ZeRO.

The loss stays the mini-batch's exactly (``weights``): a micro-batch's token mean is weighted by its
share of the mini-batch's tokens on all ranks, a sequence mean by its share of the sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlctl.engine.batch import Sequences


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward: ``rows`` of the batch (a slice, or indices), its columns (``prompt_from``:
    the first prompt column kept; ``response_to``: response columns kept), and its weights.

    ``token_weight``: its tokens x ``pieces`` x ranks / the mini-batch's tokens on all ranks;
    ``seq_weight``: the same over sequences. ``pieces``: the number of micro-batches the weights count,
    which the backward divides by (DeepSpeed averages over ranks), so that the weighted per-micro-batch
    means add up to the mini-batch's. ``index`` of ``count`` in its mini-batch: the optimizer steps
    after the last. ``real_size`` and ``padded_size``: its real tokens (prompts and responses) and the
    token positions a forward of it computes (its rows x its columns)."""

    rows: slice | torch.Tensor
    prompt_from: int
    response_to: int
    token_weight: float
    seq_weight: float
    pieces: float
    index: int
    count: int
    real_size: int
    padded_size: int

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def weight(self, agg_mode: str) -> float:
        """The weight of a loss aggregated by ``agg_mode`` (a token mean, or a mean over sequences)."""
        return self.token_weight if agg_mode == "token-mean" else self.seq_weight

    def seqs(self, seqs: Sequences) -> Sequences:
        """This micro-batch's sequences, cut to its own columns."""
        part = seqs.select(self.rows)
        if self.prompt_from == 0 and self.response_to == part.responses.shape[1]:
            return part
        stop = seqs.prompt_len + self.response_to
        lp = None if part.rollout_log_probs is None else part.rollout_log_probs[:, : self.response_to]
        return Sequences(
            part.input_ids[:, self.prompt_from : stop],
            part.attention_mask[:, self.prompt_from : stop],
            part.response_mask[:, : self.response_to],
            seqs.prompt_len - self.prompt_from,
            lp,
        )

    def tokens(self, values: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part of a (B, T) per-response-token tensor."""
        return values[self.rows][:, : self.response_to]


def by_count(start: int, stop: int, size: int) -> list[slice]:
    """Rows ``start:stop`` cut into consecutive micro-batches of ``size`` sequences."""
    return [slice(i, min(i + size, stop)) for i in range(start, stop, size)]


def by_tokens(sizes: tuple[list[int], list[int]], start: int, stop: int, budget: int) -> list[list[int]]:
    """Rows ``start:stop`` sorted by length (longest first; ties keep batch order) and cut so that each
    micro-batch's padded size, rows x (longest prompt + longest response), stays within ``budget``.
    ``sizes``: every row's prompt length and response extent (``lengths``)."""
    prompt, response = sizes
    order = sorted(range(start, stop), key=lambda i: -(prompt[i] + response[i]))
    groups: list[list[int]] = []
    p_max = r_max = 0
    for i in order:
        p, r = max(p_max, prompt[i]), max(r_max, response[i])
        if groups and (len(groups[-1]) + 1) * (p + r) <= budget:
            groups[-1].append(i)
            p_max, r_max = p, r
        else:
            groups.append([i])
            p_max, r_max = prompt[i], response[i]
    return groups


def split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` split until there are ``count``: the one with the most rows (the first of equals) is
    halved each time. Needs ``count`` <= the number of rows."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        k = max(range(len(groups)), key=lambda j: len(groups[j]))
        g = groups[k]
        groups[k : k + 1] = [g[: (len(g) + 1) // 2], g[(len(g) + 1) // 2 :]]
    return groups


def lengths(seqs: Sequences) -> tuple[list[int], list[int]]:
    """Each sequence's real prompt tokens and the extent of its response: the columns up to its last
    attended token. The columns a forward needs, whatever the loss trains on: a multi-turn response
    holds the tools' tokens (attended, masked out of the loss) between the model's, so its trained
    count (``trained``) can be far below its extent."""
    prompt = seqs.attention_mask[:, : seqs.prompt_len].sum(-1).tolist()
    attended = seqs.attention_mask[:, seqs.prompt_len :].bool()
    columns = torch.arange(1, attended.shape[1] + 1, device=attended.device)
    return prompt, (attended * columns).amax(-1).tolist() if attended.shape[1] else [0] * len(seqs)


def trained(seqs: Sequences) -> list[int]:
    """Each sequence's response tokens that the loss trains on (``response_mask``): what weighs a
    micro-batch's token mean."""
    return seqs.response_mask.sum(-1).tolist()


def plan(
    seqs: Sequences,
    mini_batch: int,
    *,
    micro_batch: int | None,
    max_tokens: int | None,
    world: int,
    total: Callable[[int], int],
    most: Callable[[int], int],
) -> list[list[MicroBatch]]:
    """The micro-batches of every mini-batch of this rank's ``seqs`` (``mini_batch`` rows each): by
    ``max_tokens`` when set, else by ``micro_batch`` rows. ``total`` sums a count over the ranks and
    ``most`` takes its maximum (the ranks' collectives; identity in a world of one)."""
    n, sizes = len(seqs), lengths(seqs)
    cuts = []
    for start in range(0, n, mini_batch):
        stop = min(start + mini_batch, n)
        if max_tokens is None:
            cuts.append(by_count(start, stop, micro_batch or mini_batch))
        else:
            groups = by_tokens(sizes, start, stop, max_tokens)
            cuts.append(split_to(groups, most(len(groups))))
    pieces = sum(len(c) for c in cuts) / len(cuts)
    return [weigh(seqs, sizes, c, pieces, world, total) for c in cuts]


def weigh(
    seqs: Sequences, sizes: tuple[list[int], list[int]], cut: list, pieces: float, world: int, total: Callable
) -> list[MicroBatch]:
    """The micro-batches of one mini-batch (``cut``: their rows, a slice or a list each) with their
    columns, weights and sizes (``sizes``: every row's prompt length and response extent, ``lengths``).
    The token weights count the trained tokens (``trained``); the columns and sizes, the attended ones."""
    prompt, response = sizes
    counts = trained(seqs)
    members = [list(range(*r.indices(len(seqs)))) if isinstance(r, slice) else r for r in cut]
    tokens = [sum(counts[i] for i in m) for m in members]
    all_tokens, all_rows = total(sum(tokens)), total(sum(len(m) for m in members))
    out = []
    for index, (rows, m, tok) in enumerate(zip(cut, members, tokens)):
        if isinstance(rows, slice):  # fixed micro-batches keep every column
            prompt_from, response_to = 0, seqs.response_mask.shape[1]
        else:
            rows = torch.tensor(rows, dtype=torch.long)
            prompt_from = seqs.prompt_len - max(prompt[i] for i in m)
            response_to = max(1, max(response[i] for i in m))
        tw = tok * pieces * world / all_tokens if all_tokens else 1.0
        sw = len(m) * pieces * world / all_rows
        real = sum(prompt[i] + response[i] for i in m)
        padded = len(m) * (seqs.prompt_len - prompt_from + response_to)
        out.append(MicroBatch(rows, prompt_from, response_to, tw, sw, pieces, index, len(cut), real, padded))
    return out
