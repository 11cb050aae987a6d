"""rollout.top_p/top_k/min_p and rollout.stop: the filters on hand-made logits (vLLM's rules and order),
the seeded sampler with filters, stop strings ending, masking and cutting completions the same way on
both backends."""

from types import SimpleNamespace

import pytest
import torch

from rlctl.config.sections import RolloutConfig
from rlctl.engine.batch import Sequences
from rlctl.engine.model import build_char_tokenizer
from rlctl.engine.rollout.hf import HFRollout, SeededGumbelSampler, decode, response_mask_for
from rlctl.engine.rollout.sampling import StopStrings, apply_min_p, apply_top_k, apply_top_p, truncate
from rlctl.engine.rollout.seeds import sample_seed
from rlctl.engine.rollout.vllm import VLLMRollout, logprobs_mode_for

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("tok",)

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def kept(logits: torch.Tensor) -> list[int]:
    """Indices of the first row that a filter left finite."""
    return torch.isfinite(logits[0]).nonzero()[:, 0].tolist()


def test_top_k_keeps_k_and_ties():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 2.0]])
    assert kept(apply_top_k(logits, 1)) == [0]
    assert kept(apply_top_k(logits, 2)) == [0, 2, 4]  # the 2nd largest is tied: both stay (vLLM)
    assert kept(apply_top_k(logits, 5)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = PROBS.log()
    assert kept(apply_top_p(logits, 0.4)) == [0]
    assert kept(apply_top_p(logits, 0.75)) == [0, 1]
    assert kept(apply_top_p(logits, 0.85)) == [0, 1, 2]
    assert kept(apply_top_p(logits, 1e-6)) == [0]  # the top token always stays


def test_min_p_is_relative_to_the_most_probable():
    logits = PROBS.log()
    assert kept(apply_min_p(logits, 0.4)) == [0, 1]  # threshold 0.2
    assert kept(apply_min_p(logits, 0.25)) == [0, 1, 2]  # threshold 0.125
    assert kept(apply_min_p(logits, 1.0)) == [0]


def test_filters_combine_in_vllms_order():
    """min_p, then top_k, then top_p on the renormalised survivors (vllm/v1/sample/sampler.py)."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top_p alone keeps {0, 1}; after top_k=2 the survivors are 0.57/0.43, so top_p=0.5 keeps token 0
    assert kept(apply_top_p(logits, 0.5)) == [0, 1]
    assert kept(truncate(logits, top_p=0.5, top_k=2)) == [0]
    # min_p=0.6 (threshold 0.24) leaves {0, 1}; top_k=3 then changes nothing
    assert kept(truncate(logits, top_k=3, min_p=0.6)) == [0, 1]
    # the survivors keep their logits: renormalising them gives the truncated distribution
    out = truncate(logits, top_k=2)
    assert torch.allclose(out.softmax(-1)[0, :2], torch.tensor([4 / 7, 3 / 7]))


def test_filters_off_touch_nothing():
    logits = torch.randn(3, 11)
    assert truncate(logits) is logits
    assert truncate(logits, top_p=1.0, top_k=-1, min_p=0.0) is logits
    assert kept(apply_top_k(logits, 11)) == list(range(11))


def test_sampler_with_defaults_is_bit_identical_to_plain_gumbel_max():
    """With every filter off the sampler adds the same noise to the same scaled logits as before."""
    logits = torch.randn(4, 37)
    seeds = [sample_seed(0, 1, i, 0) for i in range(4)]
    new = SeededGumbelSampler(seeds, 0.7)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    u = torch.stack([torch.rand(16, 37, generator=g) for g in generators])
    old = logits / 0.7 - torch.log(-torch.log(u.clamp_(1e-20, 1.0 - 1e-7)))[:, 0]
    assert torch.equal(new(None, logits), old)


def test_sampler_with_filters_is_seeded_and_samples_the_truncated_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0]])
    n = 4000
    seeds = [sample_seed(3, 1, i, 0) for i in range(n)]
    picks = [
        SeededGumbelSampler(seeds, 0.8, top_k=3, top_p=0.95)(None, logits.expand(n, -1)).argmax(-1) for _ in range(2)
    ]
    assert torch.equal(picks[0], picks[1])  # same seeds, same samples
    want = truncate(logits / 0.8, top_k=3, top_p=0.95).softmax(-1)[0]
    freq = torch.bincount(picks[0], minlength=6).float() / n
    assert set(picks[0].tolist()) <= {0, 1, 2}
    assert torch.allclose(freq, want, atol=0.03), (freq, want)
    greedy = SeededGumbelSampler(seeds[:1], 0.0, top_k=1, min_p=0.9)
    assert greedy(None, logits).argmax(-1).item() == 0 and greedy._noise is None


class Scripted(torch.nn.Module):
    """A stand-in causal LM for ``decode``: row i emits ``script[i]`` one token per step (its logits
    put all mass there), whatever the input. Like a real model it keeps its state in the KV cache: the
    prefill stores each row's index there, so rows that ``decode`` drops from the batch (and the
    cache) leave the others their own scripts."""

    def __init__(self, script: list[list[int]], vocab: int):
        super().__init__()
        self.script, self.vocab, self.calls = script, vocab, 0
        self.batch_sizes: list[int] = []

    def forward(self, input_ids, past_key_values, **_):
        if past_key_values.get_seq_length() == 0:
            ids = torch.arange(len(self.script), dtype=torch.float32).view(-1, 1, 1, 1)
            past_key_values.update(ids, ids, 0)
        rows = past_key_values.layers[0].keys[:, 0, 0, 0].long().tolist()
        self.batch_sizes.append(len(rows))
        logits = torch.full((len(rows), input_ids.shape[1], self.vocab), -30.0)
        for i, row in enumerate(rows):
            script = self.script[row]
            logits[i, -1, script[min(self.calls, len(script) - 1)]] = 30.0
        self.calls += 1
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_stop_strings_end_mask_and_cut_as_vllm_does(tok):
    """The HF loop stops a sequence at the token completing a stop string, masks what follows, and the
    text leaves the stop string out; the post-hoc rule the vLLM backend applies keeps the same tokens."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    texts = ["ab##cd", "x=1 ##", "no stop", "abc"]
    script = [tok.convert_tokens_to_ids(list(t)) + [eos] for t in texts]
    stops = StopStrings(tok, ["##", "=1 #"])
    enc = tok(["q"] * 4, return_tensors="pt")
    responses, log_probs, kept_n = decode(
        Scripted(script, len(tok)),
        enc["input_ids"],
        enc["attention_mask"],
        8,
        [eos],
        pad,
        SeededGumbelSampler([1, 2, 3, 4], 0.0),
        stops,
    )
    assert kept_n.tolist() == [4, 5, 8, 8]  # "ab##" and "x=1 #" (the earliest to complete), no stop, no stop
    for row, want in zip(responses.tolist(), [texts[0][:4], texts[1][:5]]):
        assert tok.decode(row[: len(want)]) == want
    mask = response_mask_for(responses, [eos], kept_n)
    assert mask.sum(-1).tolist() == [4, 5, 8, 4]  # after a stop nothing is response; eos stays in
    assert all(stops.length(s, [eos]) == n for s, n in zip(script, [4, 5, 8, 4]))

    rollout = object.__new__(HFRollout)
    rollout.tokenizer, rollout.eos_ids, rollout.stops = tok, [eos], stops
    seqs = Sequences(responses, mask, mask, 0, log_probs)
    assert rollout.decode(seqs) == ["ab", "x", "no stop", "abc"]


def test_stop_strings_window_and_cut(tok):
    stops = StopStrings(tok, ["#a#", "z"])
    assert stops.window == 13 and not StopStrings(tok, [])
    ids = tok.convert_tokens_to_ids(list("q" * 40 + "#a#"))
    assert stops.hits([ids, ids[:-1]]) == [True, False]
    assert stops.length(ids, [tok.eos_token_id]) == len(ids)
    assert stops.cut_text("xx#a#yz") == "xx" and stops.cut_text("yz#a#") == "y" and stops.cut_text("abc") == "abc"


def test_config_keys():
    r = RolloutConfig()
    assert (r.top_p, r.top_k, r.min_p, r.stop, r.truncates()) == (1.0, 0, 0.0, [], False)
    assert RolloutConfig(top_k=-1).truncates() is False
    assert RolloutConfig(top_k=20).truncates() and RolloutConfig(top_p=0.9).truncates()
    assert RolloutConfig(min_p=0.1).truncates()
    for bad in ({"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"min_p": 1.1}, {"stop": [""]}, {"stop": "##"}):
        with pytest.raises(ValueError):
            RolloutConfig(**bad)


def test_vllm_sampling_params_and_logprobs_mode():
    """What the vLLM backend asks for, without an engine: the filters (top_k -1 as vLLM's 0), a seed per
    sample, log-probs before truncation once a filter is on."""
    assert logprobs_mode_for(False) == "processed_logprobs" and logprobs_mode_for(True) == "raw_logprobs"
    rollout = object.__new__(VLLMRollout)
    rollout.cfg = SimpleNamespace(seed=5, rollout=RolloutConfig(top_p=0.9, top_k=-1, min_p=0.05, max_new_tokens=7))
    rollout.eos_ids = [2]
    rollout.vllm = SimpleNamespace(SamplingParams=lambda **kw: kw)
    params = rollout.sampling_params([(3, 0), (3, 1)], step=4, temperature=0.6)
    assert params[0] | {"seed": None} == {
        "max_tokens": 7,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.05,
        "seed": None,
        "stop_token_ids": [2],
        "logprobs": 0,
        "detokenize": False,
    }
    assert [p["seed"] for p in params] == [sample_seed(5, 4, 3, 0), sample_seed(5, 4, 3, 1)]


@pytest.mark.parametrize("check_every", [1, 2])
def test_finished_sequences_leave_the_batch(tok, check_every):
    """Rows that end at eos leave the forward batch once an eighth of it is done, and every row still
    gets its own script: the batch shrinks 8 -> 6 -> 4 -> 2 as pairs of rows end (at odd steps, which
    the host looks at whether it checks every token or every second one)."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    a = tok.convert_tokens_to_ids("a")
    script = [[a] * n + [eos] for n in (1, 1, 3, 3, 5, 5, 7, 7)]
    model = Scripted(script, len(tok))
    enc = tok(["q"] * 8, return_tensors="pt")
    responses, _, _ = decode(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        10,
        [eos],
        pad,
        SeededGumbelSampler(list(range(8)), 0.0),
        check_every=check_every,
    )
    assert model.batch_sizes == [8, 8, 6, 6, 4, 4, 2, 2]
    mask = response_mask_for(responses, [eos])
    assert mask.sum(-1).tolist() == [2, 2, 4, 4, 6, 6, 8, 8]
    assert (responses[mask == 0] == pad).all() and responses.shape[1] == 8


def test_batched_decode_samples_each_sequence_as_alone(tok):
    """On a real model, sampling a batch (finished rows dropped along the way) gives every sequence the
    tokens it gets when decoded alone, with the same log-probs: the seeded noise follows its row."""
    from rlctl.config import RunConfig
    from rlctl.engine.model import build_tiny_model

    model = build_tiny_model(RunConfig().model.builtin, tok, 0).eval()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    tok.padding_side = "left"
    prompts = ["3+4=", "hello there, ", "x", "a longer prompt here: "] * 2
    seeds = [sample_seed(0, 1, i, 0) for i in range(len(prompts))]
    enc = tok(prompts, return_tensors="pt", padding=True)
    sampler = SeededGumbelSampler(seeds, 1.0)
    ids, lps, _ = decode(model, enc["input_ids"], enc["attention_mask"], 24, [eos], pad, sampler)
    lengths = response_mask_for(ids, [eos]).sum(-1)
    assert len(set(lengths.tolist())) > 1  # mixed lengths: rows did leave the batch
    for i, prompt in enumerate(prompts):
        one = tok([prompt], return_tensors="pt")
        ids1, lps1, _ = decode(
            model, one["input_ids"], one["attention_mask"], 24, [eos], pad, SeededGumbelSampler(seeds[i : i + 1], 1.0)
        )
        n = int(lengths[i])
        assert ids[i, :n].tolist() == ids1[0, :n].tolist()
        torch.testing.assert_close(lps[i, :n], lps1[0, :n], atol=1e-5, rtol=1e-5)
