"""Log-probs and entropy a chunk of positions at a time (``rlctl.algos.logprobs``) against the full way
rlctl computed them before (an fp32 (B, T, V) log-softmax), values and gradients; the temperature by
``rollout.sampler``; a micro-batch's metrics read in one transfer; the GPU's default token budget."""

import math
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rlctl import algos
from rlctl.algos.logprobs import SAMPLERS, chunk_positions, scale_logits, token_log_probs
from rlctl.config import RunConfig
from rlctl.engine.actor import Actor, read_once, sequence_log_probs
from rlctl.engine.batch import position_ids_for
from rlctl.engine.model import load_tokenizer, prepare_model_dir
from rlctl.engine.rollout.hf import HFRollout
from rlctl.engine.token_budget import GRAIN, device_token_budget, token_budget
from rlctl.rundir.handle import RunDir
from rlctl.storage import Storage

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("tiny",)

B, L, V, T = 3, 11, 37, 7
FIRST = L - (T + 1)  # as a model's logits over the response's positions and one more


def full_way(logits, tokens, temperature, sampler, first=FIRST):
    """The log-probs and entropy as rlctl computed them before the chunks: one (B, T, V) log-softmax."""
    window = logits[:, first : first + tokens.shape[1]]
    z = window.float() * (1.0 / temperature) if sampler == "counter" else window.float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), algos.entropy_from_logits(z)


def case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, L, V, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    g_lp, g_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    return logits, tokens, g_lp, g_ent


def grads(fn, logits, g_lp, g_ent):
    """The gradient of sum(g_lp * log-prob + g_ent * entropy) with respect to a fresh leaf ``logits``."""
    x = logits.clone().requires_grad_(True)
    lp, ent = fn(x)
    loss = (lp * g_lp).sum() + (0 if g_ent is None else (ent * g_ent).sum())
    loss.backward()
    return x.grad


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 100])  # 3 and 4 do not divide T = 7
def test_chunked_values_are_the_full_ways_bits_and_gradients_agree(sampler, chunk):
    logits, tokens, g_lp, g_ent = case()
    want_lp, want_ent = full_way(logits, tokens, 0.7, sampler)
    lp, ent = token_log_probs(logits, tokens, 0.7, sampler, first=FIRST, with_entropy=True, chunk=chunk)
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
    want = grads(lambda x: full_way(x, tokens, 0.7, sampler), logits, g_lp, g_ent)
    for in_place in (False, True):

        def chunked(x, in_place=in_place):
            y = x * 1.0 if in_place else x  # (in place: logits that nothing else reads, not the leaf)
            return token_log_probs(
                y, tokens, 0.7, sampler, first=FIRST, with_entropy=True, chunk=chunk, in_place=in_place
            )

        got = grads(chunked, logits, g_lp, g_ent)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got[:, :FIRST].eq(0).all() and got[:, FIRST + T :].eq(0).all()  # positions predicting nothing


def test_the_entropys_gradient_and_the_log_probs_each_on_their_own():
    logits, tokens, g_lp, g_ent = case(seed=1)
    zero = torch.zeros_like(g_lp)
    for a, b in ((g_lp, zero), (zero, g_ent)):
        want = grads(lambda x: full_way(x, tokens, 1.3, "counter"), logits, a, b)
        got = grads(
            lambda x: token_log_probs(x, tokens, 1.3, "counter", first=FIRST, with_entropy=True, chunk=2),
            logits,
            a,
            b,
        )
        assert want.abs().max() > 1e-3  # each term has a gradient of its own
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the entropy unused (None in the backward): only the log-probs' gradient
    got = grads(lambda x: token_log_probs(x, tokens, 1.3, "counter", first=FIRST, chunk=2), logits, g_lp, None)
    torch.testing.assert_close(got, grads(lambda x: full_way(x, tokens, 1.3, "counter"), logits, g_lp, zero))


def test_masked_and_padded_positions_under_the_losss_masked_mean():
    logits, tokens, _, _ = case(seed=2)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0  # a short response: padding after it
    mask[2, :] = 0  # a response of nothing
    tokens = tokens.masked_fill(~mask.bool(), 0)  # pad ids
    adv = torch.linspace(-1, 1, T).expand(B, T)

    def loss_grad(fn):
        x = logits.clone().requires_grad_(True)
        lp, ent = fn(x)
        loss = algos.masked_mean(-lp * adv, mask) - 0.01 * algos.masked_mean(ent, mask)
        loss.backward()
        return loss.detach(), x.grad

    want_loss, want = loss_grad(lambda x: full_way(x, tokens, 0.7, "generator"))
    got_loss, got = loss_grad(
        lambda x: token_log_probs(x, tokens, 0.7, "generator", first=FIRST, with_entropy=True, chunk=3)
    )
    assert torch.equal(got_loss, want_loss)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert got[2].eq(0).all() and got[0, FIRST + 4 :].eq(0).all()  # no gradient where the mask is 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype):
    logits, tokens, g_lp, g_ent = case(dtype, seed=3)
    want_lp, want_ent = full_way(logits, tokens, 0.7, "counter")
    lp, ent = token_log_probs(logits, tokens, 0.7, "counter", first=FIRST, with_entropy=True, chunk=3)
    assert lp.dtype == ent.dtype == torch.float32
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
    want = grads(lambda x: full_way(x, tokens, 0.7, "counter"), logits, g_lp, g_ent)
    got = grads(
        lambda x: token_log_probs(x, tokens, 0.7, "counter", first=FIRST, with_entropy=True, chunk=3),
        logits,
        g_lp,
        g_ent,
    )
    assert got.dtype == dtype
    ulp = torch.finfo(dtype).eps * want.float().abs()  # both round the fp32 gradient to the dtype
    assert ((got.float() - want.float()).abs() <= ulp + 1e-6).all()


def test_in_place_refuses_logits_another_node_saved():
    logits, tokens, g_lp, _ = case()
    x = logits.clone().requires_grad_(True)
    y = x.exp()  # exp's backward reads its output: overwriting it must not go unnoticed
    lp, _ = token_log_probs(y, tokens, 0.7, "counter", first=FIRST, in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp * g_lp).sum().backward()


def test_the_temperature_multiplies_under_counter_and_divides_under_generator():
    x = torch.randn(4096, dtype=torch.float32)
    t = 0.7  # x / 0.7 and x * (1 / 0.7) differ in the last bit of some values
    assert torch.equal(scale_logits(x, t, "counter"), x * (1.0 / t))
    assert torch.equal(scale_logits(x, t, "generator"), x / t)
    assert not torch.equal(x * (1.0 / t), x / t)
    with pytest.raises(ValueError, match="counter, generator"):
        scale_logits(x, t, "gumbel")
    logits, tokens, _, _ = case(seed=4)
    for sampler in SAMPLERS:
        lp, _ = token_log_probs(logits, tokens, t, sampler, first=FIRST)
        assert torch.equal(lp, full_way(logits, tokens, t, sampler)[0])


def test_default_chunks_hold_about_chunk_elements():
    assert chunk_positions(2, 151_936, elements=2**25) == 110
    assert chunk_positions(64, 151_936, elements=2**20) == 1  # at least one position
    assert chunk_positions(1, 100, elements=1000) == 10


def test_read_once_gives_the_floats_item_gives():
    values = {
        "mean": (torch.tensor(0.1234567, dtype=torch.float32), 0.37),
        "nan": (torch.tensor(math.nan), 0.5),
        "inf": (torch.tensor(-math.inf), 1.0),
        "count": (torch.tensor([1.0, math.nan, math.inf]).isfinite().logical_not().sum(), 1.0),
        "flag": (~torch.isfinite(torch.tensor(math.inf)), 1.0),
        "max": (torch.tensor(3.3e38), 1.0),
        "ratio": (torch.tensor(100.0, dtype=torch.float64).exp(), 1.0),  # fp64, beyond fp32's range
        "near": (torch.tensor(0.3, dtype=torch.float64).exp(), 1.0),  # fp64 bits fp32 would round
    }
    got = read_once(values)
    for key, (t, w) in values.items():
        want = t.item() * w
        assert (math.isnan(got[key]) and math.isnan(want)) or got[key] == want, key
        assert type(got[key]) is float
    assert got["count"] == 2.0 and got["flag"] == 1.0
    assert read_once({}) == {}


@pytest.mark.parametrize("capacity", [8 * 2**30, 80 * 2**30])
def test_token_budget_from_free_memory(capacity):
    qwen = {"vocab": 151_936, "hidden": 896, "layers": 24, "dtype_bytes": 2}  # Qwen2.5-0.5B in bf16
    budget = token_budget(capacity, **qwen, checkpointing=False)
    assert budget % GRAIN == 0 and budget >= GRAIN
    per_token = (2 * 151_936 + 24 * 896 * 18) * 2
    assert budget * per_token <= capacity / 2  # within half of the free memory
    assert (budget + GRAIN) * per_token + 5 * 2**25 * 4 > capacity / 2  # and not a grain less than it allows
    assert token_budget(capacity, **qwen, checkpointing=True) > budget  # checkpointing keeps less per token
    assert token_budget(2 * capacity, **qwen, checkpointing=False) > budget


def test_token_budget_is_one_grain_at_least():
    assert token_budget(0, vocab=151_936, hidden=896, layers=24, dtype_bytes=2, checkpointing=False) == GRAIN
    assert token_budget(2**20, vocab=10, hidden=8, layers=1, dtype_bytes=4, checkpointing=True) % GRAIN == 0


def test_no_default_budget_off_the_gpu():
    cfg = type("Config", (), {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1})()
    assert device_token_budget(torch.device("cpu"), cfg, torch.float32, False) is None


# -- a real tiny actor --------------------------------------------------------------------------------


def tiny_actor(runtime, tmp_path_factory, algorithm=None, **actor):
    cfg = RunConfig.model_validate(
        {
            "trainer": {"prompts_per_step": 2},
            "algorithm": {"group_size": 2, "clip_ratio": 0.1, **(algorithm or {})},
            "rollout": {"max_new_tokens": 6, "temperature": 0.7},
            "actor": {"lr": 1e-6, **actor},
        }
    )
    model_dir = prepare_model_dir(cfg, RunDir(Storage(str(tmp_path_factory.mktemp("run")))))
    actor = Actor(cfg, model_dir, runtime)
    seqs = HFRollout(cfg, actor, load_tokenizer(model_dir)).generate(
        ["abc=", "de="] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], 1
    )
    return actor, seqs


@pytest.fixture(scope="module")
def tiny(runtime, tmp_path_factory):
    """A tiny actor that updates its batch in one micro-batch (the default on the CPU), and its batch."""
    return tiny_actor(runtime, tmp_path_factory)


def test_the_actor_scales_by_its_runs_sampler(tiny):
    actor, seqs = tiny
    assert actor.cfg.rollout.sampler == "counter"
    apart = 0
    for t in (0.7, 0.3, 0.6, 0.9, 1.3, 0.45, 0.55, 0.35, 0.65, 0.8):
        with torch.no_grad():
            live = actor.log_probs(seqs, t)[0]
            counter = sequence_log_probs(actor.engine, seqs, t, sampler="counter")[0]
            generator = sequence_log_probs(actor.engine, seqs, t, sampler="generator")[0]
        assert torch.equal(live, counter)
        torch.testing.assert_close(counter, generator)  # by a rounding at most
        apart += not torch.equal(counter, generator)
    assert apart  # at some temperature the two rules round apart in this batch: the test can tell them


def test_on_the_cpu_the_actor_keeps_its_whole_share(tiny):
    actor, _ = tiny
    assert actor.spec.max_tokens is None


class HostReads(TorchFunctionMode):
    """Counts the reads of a tensor's value to the host (item, tolist, bool, float, int) that rlctl's own
    code makes (the model's code is not counted)."""

    READS = {"item", "tolist", "__bool__", "__float__", "__int__"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            caller = sys._getframe(1).f_code.co_filename
            if "/rlctl/" in caller.replace("\\", "/"):
                self.reads.append(f"{func.__name__} in {caller}")
        return func(*args, **(kwargs or {}))


def test_a_micro_batchs_metrics_are_read_once_and_equal_the_old_reading(tiny):
    actor, seqs = tiny
    a = actor.cfg.algorithm
    mask = seqs.response_mask
    with torch.no_grad():
        lp, ent = actor.log_probs(seqs, 0.7, with_entropy=True)
    old = lp - 0.3 * mask  # off-policy: ratios above 1, some clipped
    ref = lp + 0.2 * mask
    adv = torch.linspace(-1, 1, mask.shape[1]).expand_as(lp).contiguous()
    [mb] = list(actor.minibatches(seqs))  # one mini-batch in one piece: every weight 1
    with HostReads() as reads:
        _, stats = actor._micro_batch_loss(seqs, mb, adv, old, ref, 0.05, poison=False, rollout_log_prob=None)
    assert len(reads.reads) == 1 and reads.reads[0].startswith("tolist"), reads.reads
    # the old reading: one .item() per metric (one micro-batch: every weight 1)
    pl = actor._policy_loss(lp, old, adv, mask)
    kl = algos.agg_loss(algos.kl_penalty(lp, ref, a.kl_estimator), mask, a.loss_agg_mode, 6)
    want = {
        "actor/pg_loss": pl.pg_loss.item(),
        "actor/kl_loss": kl.item(),
        "actor/ppo_kl": pl.ppo_kl.item(),
        "actor/pg_clipfrac": pl.pg_clipfrac.item(),
        "actor/pg_clipfrac_lower": pl.pg_clipfrac_lower.item(),
        "actor/entropy": algos.masked_mean(ent, mask).item(),
        "actor/nonfinite/log_prob": 0.0,
        "actor/nonfinite/loss": 0.0,
        "actor/ppo_ratio/max": pl.ratio_max.item(),
        "actor/log_prob/min": algos.masked.masked_min(lp, mask).item(),
    }
    assert stats == want
    assert 0 < stats["actor/pg_clipfrac"] < 1 and stats["actor/kl_loss"] > 0  # values that could be wrong
    actor.engine.zero_grad()


def test_micro_batch_size_cuts_the_no_grad_passes(runtime, tmp_path_factory):
    actor, seqs = tiny_actor(runtime, tmp_path_factory, micro_batch_size=1)
    sizes = []

    def forward(part):
        sizes.append(len(part))
        return actor.log_probs(part, 0.7)[0]

    with torch.no_grad():
        pieces = actor.in_pieces(seqs, forward)
        whole = actor.log_probs(seqs, 0.7)[0]
    assert sizes == [1, 1, 1, 1]
    torch.testing.assert_close(pieces, whole)


class Wrapped(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **inputs):
        return self.module(**inputs)


def test_the_entropy_bonus_moves_the_update_by_the_entropys_own_gradient(runtime, tmp_path_factory, monkeypatch):
    """algorithm.entropy_coef subtracts coef x the entropy from the loss, as verl's entropy_coeff: the
    loss's gradient moves by -coef x the gradient of the entropy term, that of plain autograd through a
    log_softmax of the model's logits (a detached entropy would leave the gradient as it was)."""
    coef = 0.5
    actor, seqs = tiny_actor(runtime, tmp_path_factory, algorithm={"entropy_coef": coef})
    a, mask = actor.cfg.algorithm, seqs.response_mask
    with torch.no_grad():
        old = actor.log_probs(seqs, 0.7)[0]
    adv = torch.linspace(-1, 1, mask.shape[1]).expand_as(old).contiguous()
    [mb] = list(actor.minibatches(seqs))  # one mini-batch in one piece: every weight 1
    head = actor.module.get_output_embeddings().weight
    # the model's own forward (DeepSpeed's engine allows no gradient but its own backward's, which the
    # test does not take), wrapped as the engine wraps it
    monkeypatch.setattr(actor, "engine", Wrapped(actor.module))

    def grad_of_loss(entropy_coef):
        a.entropy_coef = entropy_coef
        loss, _ = actor._micro_batch_loss(seqs, mb, adv, old, None, 0.0, poison=False, rollout_log_prob=None)
        return torch.autograd.grad(loss, head)[0]

    try:
        with_bonus, without = grad_of_loss(coef), grad_of_loss(0.0)
    finally:
        a.entropy_coef = coef
    T = seqs.responses.shape[1]
    ids, att = seqs.input_ids, seqs.attention_mask
    logits = actor.module(input_ids=ids, attention_mask=att, position_ids=position_ids_for(att)).logits[:, -T - 1 : -1]
    logp = torch.log_softmax(logits.float() / 0.7, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    term = algos.agg_loss(entropy, mask, a.loss_agg_mode, actor.cfg.rollout.max_new_tokens)
    want = -coef * torch.autograd.grad(term, head)[0]
    assert want.abs().max() > 1e-4  # a gradient the test can tell from none
    torch.testing.assert_close(with_bonus - without, want, rtol=1e-3, atol=1e-6)
