"""The counter sampler (rollout.sampler: counter): its hash and table against references computed apart,
the distribution it draws, its independence of the batch and of compaction, the same tokens in another
process, the host-device traffic of a decode step, and the decode loop that looks at the batch every k
tokens giving what looking every token gives."""

import json
import math
import random
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from rlctl.engine.model import build_char_tokenizer
from rlctl.engine.rollout import noise
from rlctl.engine.rollout.hf import SeededGumbelSampler, decode
from rlctl.engine.rollout.noise import CounterSampler
from rlctl.engine.rollout.sampling import StopStrings
from rlctl.engine.rollout.seeds import sample_seed

sys.path.insert(0, str(Path(__file__).parents[1]))
from device_mix import DEVICE, RLCTL, DeviceMix  # noqa: E402

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("tiny",)


def test_the_tensor_hash_is_lowbias32_in_wrapping_arithmetic():
    rng = random.Random(0)
    words = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [rng.getrandbits(32) for _ in range(5000)]
    x = torch.tensor([noise._i32(w) for w in words], dtype=torch.int32)
    assert [w & noise._M32 for w in noise.mix32(x).tolist()] == [noise.mix32_py(w) for w in words]


def test_the_noise_is_what_it_was_when_counter_runs_began():
    """Frozen values: a change to the hash, the keys or the table would change the tokens of every run
    that started with this sampler, and its resumes would no longer be exact."""
    assert noise.mix32_py(0x12345678) == 0xF5E71C96
    keys = noise.step_keys(noise.row_keys([1, 2**62 + 3], "cpu"), 5)
    want = [
        [-0.647135317325592, -0.7650964856147766, -1.8634512424468994, 0.6421878933906555, 1.6520609855651855],
        [1.5200293064117432, 1.7783126831054688, -0.09927143901586533, 0.1691136211156845, 0.05422322824597359],
    ]
    assert noise.gumbel_noise(keys, 5).tolist() == want


def test_every_integer_falls_in_the_bin_the_table_was_built_for():
    """The table's bins are the float32 roundings of w: each w lies between its bin's first integer and
    the next bin's, at every power of two (where the spacing of floats doubles) and at random."""
    starts = [noise._first_int_of_bin(noise._FIRST_BIN + i) for i in range(noise._BINS)] + [2**31 + 1]
    rng = random.Random(1)
    ws = [w for k in range(1, 32) for w in (2**k - 3, 2**k - 2, 2**k - 1, 2**k, 2**k + 1)]
    ws += [rng.randrange(1, 2**31) for _ in range(20000)]
    for w in (w for w in ws if 1 <= w <= 2**31):
        b = noise.bin_of(w) - noise._FIRST_BIN
        assert starts[b] <= w < starts[b + 1], w


def test_the_table_built_at_once_is_the_table_built_bin_by_bin_to_the_bit():
    """The table is built for all bins at once (0.03 s of CPU at every process's first sample, not 0.2 s):
    it is the table every run before was sampled with, bin by bin with the scalar bounds, to the last bit
    (a run of the counter sampler resumes bit for bit only with that table)."""
    starts = [noise._first_int_of_bin(noise._FIRST_BIN + i) for i in range(noise._BINS)] + [2**31 + 1]
    assert (
        noise._first_ints_of_bins(np.arange(noise._FIRST_BIN, noise._FIRST_BIN + noise._BINS)).tolist() == starts[:-1]
    )
    table = np.zeros(noise._BINS, dtype=np.float64)
    for i in range(noise._BINS):
        lo, hi = starts[i] | 1, starts[i + 1]
        if lo < hi:
            table[i] = -math.log(-math.log1p(-(lo + (hi - 1 if (hi - 1) & 1 else hi - 2)) / 2 / 2**31))
    assert np.array_equal(noise.gumbel_table().view(np.int32), table.astype(np.float32).view(np.int32))


def test_the_table_is_gumbel_at_its_bins():
    table = noise.gumbel_table()
    w = 2**11 + 1  # a bin of one integer (below 2^12 every integer has its own): exactly -log(-log(1 - w / 2^31))
    assert table[noise.bin_of(w) - noise._FIRST_BIN] == np.float32(-np.log(-np.log1p(-w / 2**31)))
    assert 21 < table.max() < 22 and -3.2 < table[table != 0].min() < -2.8


def draws(logits: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """(n,) tokens: one pick of n sequences (seeds 0..n-1) from the same (V,) logits."""
    return CounterSampler([sample_seed(7, 1, i, 0) for i in range(n)], 0.8, **kw).pick(logits.expand(n, -1))[0]


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test's p-value (the upper regularised gamma function of the statistic)."""
    statistic = ((counts - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2.0), statistic / 2).item()


def test_it_samples_the_softmax_of_the_scaled_logits():
    """200,000 draws over 12 tokens (probabilities from 0.35 down to 0.001) against softmax(logits / T): a
    chi-square test, and every token's frequency within 4 standard errors."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0])
    n = 200_000
    p = torch.softmax(logits / 0.8, -1).double()
    counts = torch.bincount(draws(logits, n), minlength=12).double()
    assert chi_square_p(counts, p * n) > 1e-3
    se = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() < 4 * se).all(), (counts / n, p)


def test_with_top_k_it_samples_the_truncated_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.5, 0.0])
    n = 100_000
    counts = torch.bincount(draws(logits, n, top_k=3), minlength=6).double()
    p = torch.softmax(logits[:3] / 0.8, -1).double()
    assert counts[3:].sum() == 0
    assert chi_square_p(counts[:3], p * n) > 1e-3


def test_rows_do_not_depend_on_their_batch_nor_on_compaction():
    """Eight rows picked together, then the rows left after compaction (keep), give each row the tokens it
    gets when picked alone; other seeds beside it change nothing."""
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(8, 50, generator=gen) for _ in range(4)]
    seeds = [sample_seed(3, 2, i, 0) for i in range(8)]
    together = CounterSampler(seeds, 1.0)
    got = [together.pick(steps[0])[0], together.pick(steps[1])[0]]
    rows = torch.tensor([1, 4, 6])
    together.keep(rows)
    got += [together.pick(steps[2][rows])[0], together.pick(steps[3][rows])[0]]
    for i, seed in enumerate(seeds):
        alone = CounterSampler([seed], 1.0)
        mine = [alone.pick(step[i : i + 1])[0].item() for step in steps]
        assert mine[:2] == [got[0][i].item(), got[1][i].item()]
        if i in rows.tolist():
            j = rows.tolist().index(i)
            assert mine[2:] == [got[2][j].item(), got[3][j].item()]
    other = CounterSampler([seeds[1], 12345, 678], 1.0).pick(steps[0][[1, 2, 3]])[0]
    assert other[0] == got[0][1]


PICK_IN_ANOTHER_PROCESS = """
import json, sys, torch
from rlctl.engine.rollout.noise import CounterSampler
seeds, shape = json.loads(sys.argv[1]), json.loads(sys.argv[2])
logits = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
s = CounterSampler(seeds, 0.6, top_p=0.9)
print(json.dumps([s.pick(logits[:, t])[0].tolist() for t in range(shape[1])]))
"""


@pytest.mark.slow
def test_two_processes_sample_the_same_tokens():
    seeds, shape = [sample_seed(1, 9, i, 0) for i in range(6)], [6, 5, 3000]
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    s = CounterSampler(seeds, 0.6, top_p=0.9)
    here = [s.pick(logits[:, t])[0].tolist() for t in range(shape[1])]
    out = subprocess.run(
        [sys.executable, "-c", PICK_IN_ANOTHER_PROCESS, json.dumps(seeds), json.dumps(shape)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == here
    assert len({tuple(step) for step in here}) > 1  # (not one token everywhere)


def test_temperature_is_a_multiplication_by_the_fp32_reciprocal():
    logits = torch.randn(3, 40, dtype=torch.bfloat16)
    _, scaled = CounterSampler([1, 2, 3], 0.7).pick(logits)
    assert torch.equal(scaled, logits.float() * torch.tensor(1 / 0.7, dtype=torch.float32))
    tokens, scaled = CounterSampler([1, 2, 3], 0.0).pick(logits)  # greedy: the argmax, no noise
    assert torch.equal(tokens, logits.float().argmax(-1)) and torch.equal(scaled, logits.float())


class Transfers(DeviceMix):
    """The device-mix watch, counting the numbers that cross between host and device in rlctl's own calls:
    a device tensor read by the host (tolist, item, bool, cpu, numpy), a CPU tensor moved to the device,
    and a tensor made on the device from host data."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.numbers = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if not self._in_rlctl():
            pass
        elif first is not None and self._moves(first, name, args, kwargs):
            self.numbers += first.numel()
        elif name == "tensor" and self._target(name, args, kwargs):
            self.numbers += torch.tensor(args[0]).numel()
        return super().__torch_function__(func, types, args, kwargs)

    @staticmethod
    def _in_rlctl() -> bool:
        """Whether the call is rlctl's own (the model's calls in transformers are not: the watch takes a
        buffer such as the rotary frequencies, on the device on a GPU, for a CPU tensor)."""
        frames = [
            f.filename for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__
        ]
        return bool(frames) and frames[-1].startswith(RLCTL)

    def _moves(self, t: torch.Tensor, name: str, args, kwargs) -> bool:
        """Whether this call moves ``t`` across: read by the host, or sent to the device."""
        if self._on(t):
            return name in self.READS or self._target(name, args, kwargs) is False
        return bool(self._target(name, args, kwargs))


@pytest.fixture(scope="module")
def tiny():
    from rlctl.config import RunConfig
    from rlctl.engine.model import build_tiny_model

    tok = build_char_tokenizer()
    return tok, build_tiny_model(RunConfig().model.builtin, tok, 0).eval()


def decoded_on_device(tiny, sampler, steps=24, vocab=None):
    """The numbers that crossed during one decode of 4 prompts (after one to warm the tables up)."""
    tok, model = tiny
    tok.padding_side = "left"
    enc = tok(["3+4=", "hi", "x", "ab"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"].to(DEVICE), enc["attention_mask"].to(DEVICE)
    watch = Transfers()
    with watch:
        decode(model, ids, mask, 8, [], tok.pad_token_id, sampler(), check_every=8)  # (the tables made once)
        watch.numbers = 0
        decode(model, ids, mask, steps, [], tok.pad_token_id, sampler(), check_every=8)
    return watch.numbers


@pytest.mark.slow
def test_a_decode_step_moves_a_few_numbers_per_row_not_a_vocabulary(tiny):
    """The counter sampler's decode moves O(B) numbers per step between host and device (its keys once, a
    look at the batch every 8 steps): at most 2 per row and step here, whatever the vocabulary; the
    generator sampler copies its (B, V) noise to the device at every step (the test sees it)."""
    seeds = [sample_seed(0, 1, i, 0) for i in range(4)]
    vocab = tiny[1].config.vocab_size
    counter = decoded_on_device(tiny, lambda: CounterSampler(seeds, 1.0))
    generator = decoded_on_device(tiny, lambda: SeededGumbelSampler(seeds, 1.0))
    assert counter <= 2 * 4 * 24 < vocab * 4
    assert generator >= 24 * 4 * vocab


@pytest.mark.parametrize("sampler", [CounterSampler, SeededGumbelSampler])
def test_looking_every_k_tokens_gives_what_looking_every_token_gives(tiny, sampler):
    """Tokens and kept lengths are equal whether the host looks at the batch every token or every 3 or 8
    (rows that end at eos or at a stop string between two looks included), and so are the log-probs within
    fp32 rounding: rows leave the batch at other steps, and the CPU's matrix products round a row alike
    in batches of other sizes only nearly."""
    tok, model = tiny
    tok.padding_side = "left"
    prompts = ["3+4=", "hello there, ", "x", "a longer prompt here: ", "12", "q"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    seeds = [sample_seed(0, 1, i, 0) for i in range(len(prompts))]
    eos = [tok.convert_tokens_to_ids("e"), tok.eos_token_id]
    stops = StopStrings(tok, ["a", " 1"])
    results = [
        decode(model, enc["input_ids"], enc["attention_mask"], 30, eos, tok.pad_token_id, sampler(seeds, 1.3), stops, k)
        for k in (1, 3, 8)
    ]
    kept = results[0][2].tolist()
    assert len(set(kept)) > 1 and min(kept) < results[0][0].shape[1]  # some rows stopped, at different tokens
    for ids, lps, kept_k in results[1:]:
        assert torch.equal(ids, results[0][0]) and torch.equal(kept_k, results[0][2])
        torch.testing.assert_close(lps, results[0][1], atol=1e-5, rtol=1e-5)  # (the forward's batch differs)


def test_the_expression_for_the_compiler_is_the_eager_path():
    """``_noisy_argmax`` (what CUDA compiles into one kernel) picks what the blocked in-place path picks,
    truncated logits (-inf) included."""
    gen = torch.Generator().manual_seed(3)
    scaled = torch.randn(5, 3001, generator=gen)
    scaled[:, ::7] = float("-inf")
    keys = noise.step_keys(noise.row_keys([sample_seed(0, 4, i, 0) for i in range(5)], "cpu"), 11)
    table, counters = noise._device_tables("cpu", 3001)
    eager = noise.gumbel_noise(keys, 3001).add_(scaled).argmax(-1)
    assert torch.equal(noise._noisy_argmax(scaled, keys, counters, table), eager)


@pytest.mark.gpu
def test_cuda_picks_the_cpus_tokens():
    """On a GPU: the same logits give the same tokens on CUDA (the compiled kernel) and on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    logits = torch.randn(64, 151_936, generator=torch.Generator().manual_seed(0)).bfloat16()
    seeds = [sample_seed(0, 1, i, 0) for i in range(64)]
    cpu, cuda = CounterSampler(seeds, 0.7), CounterSampler(seeds, 0.7)
    for _ in range(3):
        assert torch.equal(cpu.pick(logits)[0], cuda.pick(logits.cuda())[0].cpu())
