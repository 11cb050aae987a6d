"""The decode loop's KV caches (rlctl/engine/rollout/kv_cache.py): the static cache in batch-size buckets gives
the dynamic cache's tokens and log-probs (prompts of mixed lengths, eos, stop strings, compaction across
buckets); attention over grouped KV heads without repeating them equals transformers' SDPA attention; the
static path moves O(B) numbers between host and device and mixes no devices; on CUDA (marked gpu) the
decode step replayed as a CUDA graph gives the eager step's tokens and log-probs bit for bit."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlctl.engine.model import build_char_tokenizer
from rlctl.engine.rollout import kv_cache, noise
from rlctl.engine.rollout.hf import SeededGumbelSampler, decode
from rlctl.engine.rollout.kv_cache import bucket_for, grouped_attention, grouped_attention_forward
from rlctl.engine.rollout.noise import CounterSampler
from rlctl.engine.rollout.sampling import StopStrings
from rlctl.engine.rollout.seeds import sample_seed

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_counter_sampler import Transfers  # noqa: E402

from device_mix import DEVICE  # noqa: E402

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("tiny",)

PROMPTS = ["3+4=", "hello there, ", "x", "a longer prompt here: ", "12", "q", "abc", "zz top", "1", "22", "333", "5"]


@pytest.fixture(scope="module")
def tiny():
    from rlctl.config import RunConfig
    from rlctl.engine.model import build_tiny_model

    tok = build_char_tokenizer()
    tok.padding_side = "left"
    return tok, build_tiny_model(RunConfig().model.builtin, tok, 0).eval()


def grouped_model(tok, seed=0):
    """A tiny Qwen2 whose 4 query heads share 2 KV heads (as Qwen2.5's 14 share 2)."""
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture
def buckets(monkeypatch):
    """The (running rows, bucket size) of every move of a static cache to a smaller bucket."""
    moves, keep = [], kv_cache.StaticKV.keep

    def recorded(self, rows):
        keep(self, rows)
        moves.append((self.live, self.size))

    monkeypatch.setattr(kv_cache.StaticKV, "keep", recorded)
    return moves


def test_buckets_are_the_batch_then_two_sizes_an_octave():
    assert [bucket_for(n, 512) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 25, 33, 300, 385, 512)] == [
        1, 2, 3, 4, 6, 6, 8, 8, 12, 16, 24, 32, 48, 384, 512, 512,
    ]  # fmt: skip
    assert bucket_for(11, 12) == 12 and bucket_for(100, 100) == 100  # never above the batch
    assert all(bucket_for(n, 512) >= n for n in range(1, 513))
    assert len({bucket_for(n, 512) for n in range(1, 513)}) == 18


def run(model, tok, sampler, k=8, new=40, prompts=PROMPTS, device=None, **how):
    enc = tok(prompts, return_tensors="pt", padding=True)
    eos = [tok.convert_tokens_to_ids("e"), tok.eos_token_id]
    stops = StopStrings(tok, ["a", " 1"])
    device = device or model.device
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    return decode(model, ids, mask, new, eos, tok.pad_token_id, sampler, stops, k, **how)


@pytest.mark.parametrize("k", [1, 8])
def test_the_static_cache_gives_the_dynamic_caches_tokens_and_log_probs(tiny, buckets, k):
    """Prompts of 1 to 22 characters, rows ending at eos and at stop strings between two looks, the batch of
    12 moving through smaller buckets (filler rows included): the same tokens and kept lengths, and
    log-probs equal within fp32 rounding (the attention runs over the whole static length, masked, and the
    forward's batch is a bucket)."""
    tok, model = tiny
    seeds = [sample_seed(0, 11, i, 0) for i in range(len(PROMPTS))]
    dynamic = run(model, tok, CounterSampler(seeds, 1.3), k, static=False)
    assert not buckets
    static = run(model, tok, CounterSampler(seeds, 1.3), k, static=True)
    kept, width = dynamic[2].tolist(), dynamic[0].shape[1]
    assert len(set(kept)) > 1 and min(kept) < width  # some rows stopped at stop strings, at different tokens
    assert (dynamic[0] == tok.convert_tokens_to_ids("e")).any()  # and some at eos
    assert len(buckets) >= 2 and any(live < size for live, size in buckets)  # buckets with filler rows
    assert torch.equal(static[0], dynamic[0]) and torch.equal(static[2], dynamic[2])
    torch.testing.assert_close(static[1], dynamic[1], atol=2e-6, rtol=1e-6)


def test_a_row_samples_the_same_tokens_in_any_bucket(tiny):
    """One prompt alone (a bucket of 1 from the start) samples what it samples among the batch."""
    tok, model = tiny
    seeds = [sample_seed(0, 3, i, 0) for i in range(len(PROMPTS))]
    batch = run(model, tok, CounterSampler(seeds, 1.3), static=True)
    alone = run(model, tok, CounterSampler(seeds[3:4], 1.3), prompts=PROMPTS[3:4], static=True)
    width = alone[0].shape[1]
    assert torch.equal(alone[0][0], batch[0][3, :width]) and (batch[0][3, width:] == tok.pad_token_id).all()


def test_grouped_attention_is_sdpa_within_rounding():
    """A one-token query over 2 KV heads shared by 14 query heads, with a padding mask and without: the
    output of transformers' SDPA path (which repeats the KV heads) within fp32 rounding; a longer query
    goes to that path itself."""

    class Attention:
        num_key_value_groups = 7

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 14, 1, 64, generator=gen)
    k, v = torch.randn(5, 2, 37, 64, generator=gen), torch.randn(5, 2, 37, 64, generator=gen)
    mask = torch.rand(5, 1, 1, 37, generator=gen) > 0.3
    for m in (mask, None):
        want, _ = sdpa_attention_forward(Attention(), q, k, v, m, scaling=0.125)
        got, _ = grouped_attention_forward(Attention(), q, k, v, m, scaling=0.125)
        assert got.shape == want.shape == (5, 1, 14, 64)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    q6 = torch.randn(5, 14, 6, 64, generator=gen)
    both = [
        f(Attention(), q6, k, v, None, scaling=0.125, is_causal=True)[0]
        for f in (sdpa_attention_forward, grouped_attention_forward)
    ]
    assert torch.equal(*both)


def test_a_model_with_grouped_kv_heads_decodes_as_with_sdpa():
    """A model whose query heads share KV heads: a decode step's logits under grouped attention are SDPA's
    within rounding, the implementation is SDPA again after, and a decode's tokens on either cache are equal."""
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    model = grouped_model(tok)
    enc = tok(PROMPTS[:4], return_tensors="pt", padding=True)
    cache, _, position = kv_cache.prefill(model, enc["input_ids"], enc["attention_mask"])
    kv = kv_cache.DynamicKV(model, cache, enc["attention_mask"], position)
    step = dict(input_ids=torch.tensor([[5], [6], [7], [8]]), position_ids=position + 1, use_cache=False)
    mask = torch.cat([enc["attention_mask"], torch.ones(4, 1, dtype=torch.long)], dim=1)
    want = model(attention_mask=mask, past_key_values=kv.cache, **step).logits
    with grouped_attention(model):
        assert model.config._attn_implementation == kv_cache.GROUPED
        got = model(attention_mask=mask, past_key_values=kv.cache, **step).logits
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    seeds = [sample_seed(0, 4, i, 0) for i in range(len(PROMPTS))]
    dynamic = run(model, tok, CounterSampler(seeds, 1.3), static=False)
    static = run(model, tok, CounterSampler(seeds, 1.3), static=True)
    assert torch.equal(static[0], dynamic[0]) and torch.equal(static[2], dynamic[2])
    torch.testing.assert_close(static[1], dynamic[1], atol=2e-6, rtol=1e-6)


def test_the_generator_samplers_decode_keeps_the_dynamic_cache_and_sdpa(tiny, monkeypatch):
    """Old runs resume bit for bit: the generator sampler's decode never builds a static cache nor switches
    the attention, whatever it is asked."""
    tok, _ = tiny
    model = grouped_model(tok)
    seen = []
    forward = model.forward
    monkeypatch.setattr(
        model, "forward", lambda *a, **kw: seen.append(model.config._attn_implementation) or forward(*a, **kw)
    )
    monkeypatch.setattr(kv_cache.StaticKV, "after_prefill", None)  # (any call fails)
    seeds = [sample_seed(0, 3, i, 0) for i in range(4)]
    run(model, tok, SeededGumbelSampler(seeds, 1.3), k=1, new=12, prompts=PROMPTS[:4], static=True, cuda_graphs=True)
    assert len(seen) > 2 and set(seen) == {"sdpa"}


@pytest.mark.slow
def test_the_static_decode_moves_a_few_numbers_per_row_and_mixes_no_devices(tiny, buckets):
    """On the device (the watch's), a static decode of 12 rows moving through buckets: at most 2 numbers per
    row and step cross between host and device, and no call of rlctl's mixes the device with the CPU."""
    tok, model = tiny
    seeds = [sample_seed(0, 3, i, 0) for i in range(len(PROMPTS))]
    noise._device_tables.cache_clear()  # (made again under this watch, which then knows them on the device)
    watch = Transfers()
    with watch:
        run(model, tok, CounterSampler(seeds, 1.3), new=8, device=DEVICE, static=True)  # (the tables made once)
        watch.numbers = 0
        buckets.clear()
        run(model, tok, CounterSampler(seeds, 1.3), device=DEVICE, static=True)
    assert len(buckets) >= 2  # (it moved through buckets)
    assert watch.numbers <= 2 * len(PROMPTS) * 40
    assert not watch.mixes, watch.mixes


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_steps_tokens_and_log_probs_bit_for_bit(buckets):
    """On CUDA, the counter sampler's static decode with its steps replayed as CUDA graphs (one per bucket)
    against the same decode run eagerly: equal tokens, kept lengths and log-probs, bit for bit; in fp32 and
    in bf16, on a model with grouped KV heads."""
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    prompts = PROMPTS * 3  # 36 rows: buckets 36, 32, 24, ...
    seeds = [sample_seed(0, 5, i, 0) for i in range(len(prompts))]
    for dtype in (torch.float32, torch.bfloat16):
        model = grouped_model(tok).to("cuda", dtype)
        eager = run(model, tok, CounterSampler(seeds, 1.3), new=60, prompts=prompts, static=True)
        moves = len(buckets)
        graphs = run(model, tok, CounterSampler(seeds, 1.3), new=60, prompts=prompts, static=True, cuda_graphs=True)
        assert len(buckets) - moves == moves >= 2
        for a, b in zip(eager, graphs):
            assert torch.equal(a, b)
