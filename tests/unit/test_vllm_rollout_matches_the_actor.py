"""The vllm rollout backend with a real in-process vLLM engine on the tiny model (skipped without vllm).

One engine serves the whole module: starting one costs seconds, generating milliseconds.
"""

import random

import pytest
import torch

pytest.importorskip("vllm")

from rlctl.config import RunConfig
from rlctl.engine.actor import Actor, sequence_log_probs
from rlctl.engine.model import load_tokenizer, prepare_model_dir
from rlctl.engine.rollout import make_backend
from rlctl.engine.rollout.hf import HFRollout
from rlctl.engine.rollout.vllm import VLLMRollout, process_state_kept
from rlctl.errors import ConfigError
from rlctl.rundir.handle import RunDir
from rlctl.storage import Storage

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("setup",)
pytestmark = pytest.mark.slow  # (real engines in this process: `make test` runs them, test-fast does not)

TEMPERATURE = 0.9
PROMPTS = ["abcd=", "e=", "fgh+ij=", "k"]
KEYS = [(7, 0), (7, 1), (9, 0), (9, 1)]
# Longer than one KV-cache block (128 tokens on CPU), so a second generate hits the prefix cache.
LONG = "the quick brown fox jumps over the lazy dog " * 4


def make_cfg() -> RunConfig:
    return RunConfig.model_validate(
        {
            "trainer": {"prompts_per_step": 2},
            "algorithm": {"group_size": 2},
            "rollout": {"backend": "vllm", "max_new_tokens": 12, "temperature": TEMPERATURE},
            "actor": {"lr": 1e-2, "zero_stage": 3},
        }
    )


@pytest.fixture(scope="module")
def setup(runtime, tmp_path_factory):
    """A ZeRO-3 actor (its parameters are partitioned: sync must gather them) and its vLLM engine."""
    import torch.distributed as dist

    model_dir = prepare_model_dir(RunConfig(), RunDir(Storage(str(tmp_path_factory.mktemp("run")))))
    cfg = make_cfg()
    actor = Actor(cfg, model_dir, runtime)
    tokenizer = load_tokenizer(model_dir)
    rollout = make_backend("vllm", cfg=cfg, actor=actor, tokenizer=tokenizer)
    assert isinstance(rollout, VLLMRollout)
    yield cfg, actor, rollout
    rollout.close()
    assert dist.is_initialized()  # the session's process group survives the engine's shutdown


def actor_log_probs(actor: Actor, seqs, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return sequence_log_probs(actor.engine, seqs, temperature)[0]


def engine_log_probs(rollout: VLLMRollout, seqs) -> torch.Tensor:
    """(B, T) log-probs the engine gives the response tokens of ``seqs`` read as one fixed sequence
    each (vLLM's prompt log-probs: temperature 1), 0 past the response."""
    from vllm import SamplingParams

    P, T = seqs.prompt_len, seqs.responses.shape[1]
    rows = [ids[m.bool()].tolist() for ids, m in zip(seqs.input_ids, seqs.attention_mask)]
    with process_state_kept(cpu=True):
        outs = rollout.llm.generate(
            [{"prompt_token_ids": r} for r in rows],
            SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
            use_tqdm=False,
        )
    out = torch.zeros(len(rows), T)
    for i, (row, o) in enumerate(zip(rows, outs)):
        p = int(seqs.attention_mask[i, :P].sum())
        for k, token in enumerate(row[p:]):
            out[i, k] = o.prompt_logprobs[p + k][token].logprob
    return out


def test_generate_returns_the_hf_layout_and_the_actors_log_probs(setup):
    cfg, actor, rollout = setup
    seqs = rollout.generate(PROMPTS, KEYS, step=1)
    B, P, T = len(PROMPTS), seqs.prompt_len, seqs.responses.shape[1]
    enc = HFRollout(cfg, actor, rollout.tokenizer).encode(PROMPTS)
    assert torch.equal(seqs.input_ids[:, :P], enc["input_ids"])
    assert torch.equal(seqs.attention_mask[:, :P], enc["attention_mask"])
    assert seqs.input_ids.shape == (B, P + T) and 1 <= T <= cfg.rollout.max_new_tokens
    assert torch.equal(seqs.attention_mask[:, P:], seqs.response_mask)

    eos, pad = rollout.eos_ids, rollout.tokenizer.pad_token_id
    lengths = seqs.response_mask.sum(-1)
    assert int(lengths.max()) == T
    for row, mask, n in zip(seqs.responses, seqs.response_mask, lengths.tolist()):
        assert mask[:n].all() and not mask[n:].any()  # 1 up to the end of the response, 0 after
        assert (row[n:] == pad).all()
        ended = [i for i, t in enumerate(row[:n].tolist()) if t in eos]
        assert ended in ([], [n - 1])  # the first eos is the last response token, or none
        assert ended or n == cfg.rollout.max_new_tokens

    lp = seqs.rollout_log_probs
    assert lp.dtype == torch.float32 and lp.shape == (B, T)
    assert (lp[seqs.response_mask == 0] == 0).all()
    mask = seqs.response_mask.bool()
    expected = actor_log_probs(actor, seqs, TEMPERATURE)  # logits / T: the sampled distribution
    assert torch.allclose(lp[mask], expected[mask], atol=1e-4), (lp[mask] - expected[mask]).abs().max()
    assert not torch.allclose(lp[mask], actor_log_probs(actor, seqs, 1.0)[mask], atol=1e-3)
    assert all(isinstance(text, str) for text in rollout.decode(seqs))


def test_seeds_make_rollouts_reproducible_and_leave_process_state_alone(setup):
    _, _, rollout = setup
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op when the engine starts: put back
    assert torch.set_num_threads is torch._C.set_num_threads
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    random.seed(1234)
    rng, py_rng = torch.get_rng_state(), random.getstate()

    first = rollout.generate(PROMPTS, KEYS, step=3)
    rollout.generate([LONG, "x="], [(1, 0), (2, 0)], step=5)  # other work in between
    again = rollout.generate(PROMPTS, KEYS, step=3)
    assert torch.equal(first.input_ids, again.input_ids)
    assert torch.equal(first.rollout_log_probs, again.rollout_log_probs)
    other_keys = rollout.generate(PROMPTS, [(7, 2), (7, 3), (9, 2), (9, 3)], step=3)
    assert not torch.equal(other_keys.responses, first.responses)
    other_step = rollout.generate(PROMPTS, KEYS, step=4)
    assert not torch.equal(other_step.responses, first.responses)
    # Two samples of the same prompt (same prompt index, different sample index) differ.
    assert not torch.equal(first.responses[0], first.responses[1])

    rollout.sync_weights()
    assert torch.get_num_threads() == threads and torch.set_num_threads is torch._C.set_num_threads
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py_rng


def test_sync_weights_pushes_every_update_into_the_engine(setup):
    """vLLM's log-probs of fixed sequences follow the actor: equal before an update, stale after it,
    equal again (to the new weights) after sync_weights. Also through the prefix cache."""
    _, actor, rollout = setup
    prompts = [LONG, "abc=", LONG, "abc="]
    seqs = rollout.generate(prompts, KEYS, step=11)
    old = actor_log_probs(actor, seqs, 1.0)
    mask = seqs.response_mask.bool()
    before = engine_log_probs(rollout, seqs)
    assert torch.allclose(before[mask], old[mask], atol=1e-4)

    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * seqs.response_mask
    actor.update(seqs, advantages, None, None, 0.0)
    new = actor_log_probs(actor, seqs, 1.0)
    assert (new[mask] - old[mask]).abs().max() > 1e-2  # the update changed the policy

    stale = engine_log_probs(rollout, seqs)
    assert torch.allclose(stale[mask], old[mask], atol=1e-4)  # not synced yet: the old weights

    rollout.sync_weights()
    synced = engine_log_probs(rollout, seqs)
    assert torch.allclose(synced[mask], new[mask], atol=1e-4), (synced[mask] - new[mask]).abs().max()
    # Sampling uses the new weights too, with no stale prefix-cache blocks of the long prompt.
    fresh = rollout.generate(prompts, KEYS, step=11)
    m = fresh.response_mask.bool()
    expected = actor_log_probs(actor, fresh, TEMPERATURE)
    assert torch.allclose(fresh.rollout_log_probs[m], expected[m], atol=1e-4)


def test_engine_per_rank_means_no_tensor_parallelism(setup):
    cfg, actor, rollout = setup
    bad = cfg.model_copy(deep=True)
    bad.rollout.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        VLLMRollout(bad, actor, rollout.tokenizer)
