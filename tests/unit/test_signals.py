"""The degeneration signals (response/repetition, longest_run, degenerate_frac) on hand-made token ids,
the degenerate drill's batch, and how the actor combines actor/ppo_ratio/max and actor/log_prob/min over
micro-batches (a real tiny actor)."""

import math
import random

import pytest
import torch

from rlctl import faults
from rlctl.config import RunConfig
from rlctl.engine.actor import Actor, accumulate, sequence_log_probs
from rlctl.engine.batch import Sequences
from rlctl.engine.degeneration import degeneration_metrics, longest_equal_run, ngram_shares
from rlctl.engine.dist import reduce_rows
from rlctl.engine.experience import REDUCTIONS, Experience, repeated_token
from rlctl.engine.model import build_char_tokenizer, load_tokenizer, prepare_model_dir
from rlctl.engine.rollout.hf import HFRollout
from rlctl.errors import ConfigError
from rlctl.rundir.handle import RunDir
from rlctl.storage import Storage

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("tiny",)


def batch(rows: list[list[int]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids (padding 0, a real id too, so padding that leaked in would show) and mask."""
    T = width or max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    return ids, mask


def test_one_token_repeated_is_degenerate_and_padding_is_ignored():
    ids, mask = batch([[5] * 8, [0, 0, 1, 2]], width=12)  # row 1: a 0-token pair, then padding 0s
    m = degeneration_metrics(ids, mask)
    # row 0: 8/8 of one token; row 1: 2 of 4 are the same token, run 2 of 4
    assert m["response/repetition/mean"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["response/repetition/max"] == 1.0
    assert m["response/longest_run/mean"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["response/longest_run/max"] == 1.0
    assert m["response/degenerate_frac"] == 0.5  # row 1 is short (4 tokens): never degenerate


def test_bigram_repeated_is_degenerate_without_any_token_at_half():
    # 1 2 1 2 1 2 1 2 3 4 5 6 (12 tokens): token 1 has 4/12, the bigram (1,2) starts 4 times -> 8/12;
    # (1,2,1) starts at 0, 2, 4 and covers 0..6 (7/12); (1,2,1,2) at 0, 2, 4 covers 0..7 (8/12)
    ids, mask = batch([[1, 2] * 4 + [3, 4, 5, 6]])
    shares = ngram_shares(ids, mask)
    assert shares[0].tolist() == pytest.approx([4 / 12, 8 / 12, 7 / 12, 8 / 12])
    m = degeneration_metrics(ids, mask)
    assert m["response/repetition/max"] == pytest.approx(4 / 12)
    assert m["response/longest_run/max"] == pytest.approx(1 / 12)  # no token twice in a row
    assert m["response/degenerate_frac"] == 1.0


def test_distinct_tokens_are_not_degenerate_and_an_ngram_seen_once_counts_nothing():
    ids, mask = batch([list(range(1, 9)), list(range(10, 26))])
    shares = ngram_shares(ids, mask)
    assert shares[:, 1:].eq(0).all()  # each n-gram occurs once: not a repetition (else 4/8 for n=4)
    assert shares[:, 0].tolist() == pytest.approx([1 / 8, 1 / 16])
    assert degeneration_metrics(ids, mask)["response/degenerate_frac"] == 0.0


def test_overlapping_occurrences_cover_a_token_once():
    # 7 7 7 1 2 3 4 5: the bigram (7,7) starts twice but covers 3 tokens, not 4 (3/8 < 0.5)
    ids, mask = batch([[7, 7, 7, 1, 2, 3, 4, 5], [7, 7, 1, 7, 7, 2, 3, 4]])
    shares = ngram_shares(ids, mask)
    assert shares[0].tolist() == pytest.approx([3 / 8, 3 / 8, 0.0, 0.0])
    assert shares[1].tolist() == pytest.approx([4 / 8, 4 / 8, 0.0, 0.0])  # two apart (7,7)s: 4 tokens
    assert degeneration_metrics(ids, mask)["response/degenerate_frac"] == 0.5


def test_threshold_is_half_at_exactly_eight_tokens():
    at_half = [7, 7, 7, 7, 1, 2, 3, 4]  # one token covers 4/8: degenerate
    below = [7, 7, 7, 1, 2, 3, 4, 5]  # 3/8, no repeated n-gram
    short = [7] * 7  # 7 tokens: never
    ids, mask = batch([at_half, below, short])
    m = degeneration_metrics(ids, mask)
    assert m["response/degenerate_frac"] == pytest.approx(1 / 3)
    assert m["response/longest_run/mean"] == pytest.approx((4 / 8 + 3 / 8 + 1.0) / 3)


def test_runs_do_not_cross_padding_and_empty_rows_read_zero():
    ids = torch.tensor([[3, 3, 3, 3], [3, 3, 3, 3]])
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0]])  # a hole breaks the run; row 1 has no real token
    assert longest_equal_run([ids], mask.bool()).tolist() == [2, 0]
    m = degeneration_metrics(ids, mask)
    assert m["response/longest_run/max"] == pytest.approx(2 / 3)
    assert m["response/repetition/mean"] == pytest.approx((1.0 + 0.0) / 2)


def test_large_ids_pack_exactly_for_four_grams():
    # ids near 2^17 (a 150k vocabulary): a 4-gram takes 72 bits, packed into two keys and sorted twice
    big = [131000, 131001, 131002, 131003]
    ids, mask = batch([big * 3, [131000, 131001, 131002, 130999] * 3])
    shares = ngram_shares(ids, mask)
    assert shares[0, 3].item() == 1.0  # the 4-gram starts 3 times in 12 tokens
    assert shares[1, 3].item() == 1.0
    assert shares[1, 0].item() == pytest.approx(3 / 12)


def brute_shares(row: list[int], max_n: int = 4) -> list[float]:
    """The n-gram shares of one unpadded response by counting every n-gram's starts in Python."""
    shares = []
    for n in range(1, max_n + 1):
        starts: dict[tuple[int, ...], list[int]] = {}
        for i in range(len(row) - n + 1):
            starts.setdefault(tuple(row[i : i + n]), []).append(i)
        top = max((len(v) for v in starts.values()), default=0)
        cover = max((len({p for s in v for p in range(s, s + n)}) for v in starts.values() if len(v) == top), default=0)
        shares.append(0.0 if n > 1 and top < 2 else cover / max(1, len(row)))
    return shares


def test_equally_frequent_ngrams_take_the_largest_cover_whatever_the_order():
    # a a a b c b c: (a,a) and (b,c) both start twice; (a,a) covers 3 tokens, (b,c) 4. Either order in
    # the response, and (a,a) sorting first or last, gives 4/7 (not the index .max() happened to return)
    a, b, c = 1, 2, 3
    for row in ([a, a, a, b, c, b, c], [b, c, b, c, a, a, a], [c, c, c, a, b, a, b]):
        ids, mask = batch([row])
        assert ngram_shares(ids, mask)[0].tolist() == pytest.approx([3 / 7, 4 / 7, 0.0, 0.0]), row
    rng = random.Random(7)  # small vocabularies: ties everywhere; 2^20 ids: 4-grams in two keys
    for vocab in (2, 3, 2**20):
        rows = [[rng.randrange(vocab) for _ in range(rng.randint(1, 16))] for _ in range(40)]
        ids, mask = batch(rows)
        got = ngram_shares(ids, mask).tolist()
        assert got == [pytest.approx(brute_shares(r)) for r in rows]


def test_batch_metrics_reduce_over_equal_rank_shares_like_the_whole_batch():
    rows = [[5] * 8, [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 1], [4, 4, 4, 4, 4, 1, 2, 3]]
    ids, mask = batch(rows)
    whole = degeneration_metrics(ids, mask)
    halves = [degeneration_metrics(ids[i : i + 2], mask[i : i + 2]) for i in (0, 2)]
    merged = reduce_rows(halves, REDUCTIONS)
    assert merged == pytest.approx(whole)


def test_repeated_token_drill_batch():
    seqs = Sequences(
        input_ids=torch.tensor([[0, 7, 8, 20, 2, 0], [9, 7, 8, 21, 22, 23]]),
        attention_mask=torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]),
        response_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
        prompt_len=3,
        rollout_log_probs=torch.zeros(2, 3),
    )
    out = repeated_token(seqs, 44, 10)
    assert out.prompt_len == 3 and out.rollout_log_probs is None
    assert out.input_ids[:, :3].tolist() == [[0, 7, 8], [9, 7, 8]]
    assert out.responses.tolist() == [[44] * 10] * 2 and out.response_mask.eq(1).all()
    assert out.attention_mask[:, :3].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert degeneration_metrics(out.responses, out.response_mask)["response/degenerate_frac"] == 1.0


def test_drill_token_is_one_token_of_the_tokenizer():
    tok = build_char_tokenizer()
    exp = Experience(RunConfig(), None, None, None, 0, None, tokenizer=tok)
    assert exp.drill_token("") == tok.convert_tokens_to_ids("!")
    assert exp.drill_token("a") == tok.convert_tokens_to_ids("a")
    with pytest.raises(ConfigError, match=r"fault drill degenerate \(RLCTL_FAULTS or 'faults'\): 'ab' is 2 tokens"):
        exp.drill_token("ab")
    assert faults.parse("degenerate@4,degenerate@6=a") == [
        faults.Fault("degenerate", 4, None),
        faults.Fault("degenerate", 6, "a"),
    ]


def test_accumulate_takes_extremes_and_nan_wins():
    totals: dict[str, float] = {}
    for stats in (
        {"actor/ppo_ratio/max": 1.5, "actor/log_prob/min": -3.0, "actor/pg_loss": 1.0},
        {"actor/ppo_ratio/max": 4.0, "actor/log_prob/min": -9.0, "actor/pg_loss": 2.0},
        {"actor/ppo_ratio/max": 2.0, "actor/log_prob/min": -1.0, "actor/pg_loss": 3.0},
    ):
        accumulate(totals, stats)
    assert totals == {"actor/ppo_ratio/max": 4.0, "actor/log_prob/min": -9.0, "actor/pg_loss": 6.0}
    accumulate(totals, {"actor/ppo_ratio/max": math.nan, "actor/log_prob/min": -0.5})
    accumulate(totals, {"actor/ppo_ratio/max": 7.0, "actor/log_prob/min": math.nan})
    assert math.isnan(totals["actor/ppo_ratio/max"]) and math.isnan(totals["actor/log_prob/min"])


@pytest.fixture(scope="module")
def tiny(runtime, tmp_path_factory):
    """A real tiny actor whose update runs 4 micro-batches of one sequence each, and a rollout batch."""
    cfg = RunConfig.model_validate(
        {
            "trainer": {"prompts_per_step": 2},
            "algorithm": {"group_size": 2},
            "rollout": {"max_new_tokens": 6},
            "actor": {"lr": 1e-6, "micro_batch_size": 1},
        }
    )
    model_dir = prepare_model_dir(cfg, RunDir(Storage(str(tmp_path_factory.mktemp("run")))))
    actor = Actor(cfg, model_dir, runtime)
    seqs = HFRollout(cfg, actor, load_tokenizer(model_dir)).generate(
        ["abc=", "de="] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], 1
    )
    return actor, seqs


def test_ratio_max_and_log_prob_min_over_micro_batches(tiny):
    actor, seqs = tiny
    mask = seqs.response_mask
    with torch.no_grad():
        logp = sequence_log_probs(actor.engine, seqs, 1.0)[0]
    adv = torch.zeros_like(logp)
    on = actor.update(seqs, adv, None, None, 0.0)
    assert on["actor/ppo_ratio/max"] == 1.0  # on-policy: old is this forward's own log-prob
    # off-policy: row 2 (the 3rd micro-batch) was 3 nats less likely under the old policy
    shift = torch.tensor([0.1, 0.5, 3.0, 0.2]).unsqueeze(1) * mask
    with torch.no_grad():
        logp = sequence_log_probs(actor.engine, seqs, 1.0)[0]
    off = actor.update(seqs, adv, logp - shift, None, 0.0)
    assert off["actor/ppo_ratio/max"] == pytest.approx(math.exp(3.0), rel=1e-4)
    lowest = torch.where(mask.bool(), logp, torch.full_like(logp, math.inf)).min().item()
    assert off["actor/log_prob/min"] == pytest.approx(lowest, abs=1e-4)
    poisoned = actor.update(seqs, adv, logp, None, 0.0, poison=True)  # a NaN log-prob in micro-batch 1
    assert math.isnan(poisoned["actor/ppo_ratio/max"]) and math.isnan(poisoned["actor/log_prob/min"])
