"""Micro-batches by token budget (``rlctl.engine.microbatch``): what goes together, what each one keeps
of the batch, and the count the ranks agree on."""

import torch

from rlctl.engine import microbatch
from rlctl.engine.batch import Sequences


def batch(prompts: list[int], responses: list[int], P: int = 6, T: int = 10) -> Sequences:
    """Left-padded prompts of the given lengths and right-padded responses of the given lengths."""
    n = len(prompts)
    ids = torch.arange(n * (P + T)).view(n, P + T) + 10
    attn = torch.zeros(n, P + T, dtype=torch.long)
    resp = torch.zeros(n, T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attn[i, P - p : P + r] = 1
        resp[i, :r] = 1
    return Sequences(ids, attn, resp, P)


def test_budget_groups_like_lengths_longest_first_and_is_never_exceeded():
    seqs = batch([2, 3, 2, 4, 1, 2], [9, 1, 8, 2, 3, 10])
    groups = microbatch.by_tokens(microbatch.lengths(seqs), 0, 6, budget=24)
    assert groups == [[5, 0], [2, 3], [1, 4]]  # lengths 12, 11 | 10, 6 (2 x (4 + 8) = 24) | 4, 4
    prompt, response = microbatch.lengths(seqs)
    for g in groups:
        width = max(prompt[i] for i in g) + max(response[i] for i in g)
        assert len(g) * width <= 24 or len(g) == 1
    assert microbatch.by_tokens(microbatch.lengths(seqs), 0, 6, budget=1) == [
        [5],
        [0],
        [2],
        [3],
        [1],
        [4],
    ]  # each alone
    assert microbatch.by_tokens(microbatch.lengths(seqs), 0, 6, budget=1000) == [[5, 0, 2, 3, 1, 4]]


def test_ranks_that_need_fewer_split_their_largest():
    assert microbatch.split_to([[0, 1, 2, 3], [4]], 2) == [[0, 1, 2, 3], [4]]
    assert microbatch.split_to([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert microbatch.split_to([[0, 1, 2], [3, 4]], 5) == [[0], [1], [2], [3], [4]]


def test_a_micro_batch_keeps_only_its_own_columns():
    seqs = batch([2, 3, 2, 4, 1, 2], [9, 1, 8, 2, 3, 10])
    [mbs] = microbatch.plan(seqs, 6, micro_batch=None, max_tokens=24, world=1, total=lambda n: n, most=lambda n: n)
    assert [mb.count for mb in mbs] == [3, 3, 3] and [mb.last for mb in mbs] == [False, False, True]
    last = mbs[2]  # rows 1, 4: prompts of 3 and 1 tokens, responses of 1 and 3
    assert (last.prompt_from, last.response_to) == (3, 3)
    part = last.seqs(seqs)
    assert part.prompt_len == 3 and part.input_ids.shape == (2, 6)
    assert part.input_ids.tolist() == seqs.input_ids[[1, 4], 3:9].tolist()
    assert part.attention_mask.sum().item() == seqs.attention_mask[[1, 4]].sum().item()  # nothing real cut
    assert last.tokens(seqs.response_mask).tolist() == seqs.response_mask[[1, 4], :3].tolist()
    assert last.padded_size == 2 * 6 and last.real_size == 3 + 1 + 1 + 3
    # the weights: tokens and sequences of the mini-batch, times the pieces they count (3 micro-batches)
    assert sum(mb.token_weight for mb in mbs) == 3.0 and sum(mb.seq_weight for mb in mbs) == 3.0
    assert last.token_weight == 4 * 3 / 33  # 4 of the 33 response tokens, 3 pieces


def test_fixed_micro_batches_keep_every_column_and_weigh_one():
    seqs = batch([2, 3, 2, 4], [9, 1, 8, 2])
    [mbs] = microbatch.plan(seqs, 4, micro_batch=2, max_tokens=None, world=1, total=lambda n: n, most=lambda n: n)
    assert [mb.rows for mb in mbs] == [slice(0, 2), slice(2, 4)] and all(mb.pieces == 2 for mb in mbs)
    assert all(mb.seq_weight == 1.0 for mb in mbs) and mbs[0].seqs(seqs).input_ids.shape == (2, 16)


def test_a_response_with_holes_keeps_its_columns_and_weighs_its_trained_tokens():
    """A multi-turn response: the model's tokens, the tools' (attended, masked out of the loss), the
    model's again. Its columns are its extent, not its trained count; its weight is its trained count."""
    seqs = batch([2, 3, 2], [9, 2, 3])
    seqs.response_mask[0, 2:7] = 0  # row 0: 4 trained tokens over 9 attended columns
    prompt, response = microbatch.lengths(seqs)
    assert response == [9, 2, 3] and microbatch.trained(seqs) == [4, 2, 3]
    [mbs] = microbatch.plan(seqs, 3, micro_batch=None, max_tokens=12, world=1, total=lambda n: n, most=lambda n: n)
    [holed] = [mb for mb in mbs if 0 in mb.rows.tolist()]
    assert holed.rows.tolist() == [0] and holed.response_to == 9  # 2 + 9 > 12 / 2: alone, nothing cut
    part = holed.seqs(seqs)
    assert part.attention_mask.sum().item() == seqs.attention_mask[0].sum().item() == 11
    assert holed.tokens(seqs.response_mask).sum().item() == 4
    assert holed.token_weight == 4 * len(mbs) / 9  # 4 of the batch's 9 trained tokens
    assert holed.real_size == 11 and holed.padded_size == 11
    assert sum(mb.token_weight for mb in mbs) == len(mbs)
