"""The actor, the rollout backend and the tiny model, with real DeepSpeed in this process."""

import math

import pytest
import torch

from rlctl.config import RunConfig
from rlctl.engine.actor import Actor, sequence_log_probs
from rlctl.engine.model import load_tokenizer, prepare_model_dir
from rlctl.engine.rollout import sample_seed
from rlctl.engine.rollout.hf import HFRollout, SeededGumbelSampler, response_mask_for, sampler_for
from rlctl.rundir.handle import RunDir
from rlctl.storage import Storage

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("model_dir",)
pytestmark = pytest.mark.slow  # (real engines in this process: `make test` runs them, test-fast does not)


def make_cfg(**sets) -> RunConfig:
    cfg = RunConfig.model_validate(
        {
            "trainer": {"prompts_per_step": 2},
            "algorithm": {"group_size": 2},
            "rollout": {"max_new_tokens": 6},
            "actor": {"lr": 1e-2},
        }
    )
    for key, value in sets.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    return cfg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return prepare_model_dir(RunConfig(), RunDir(Storage(str(tmp_path_factory.mktemp("run")))))


def test_tiny_model_reloads_with_any_hf_tool(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # vLLM CPU head_dim
    assert tok.decode(tok("abc=")["input_ids"], skip_special_tokens=True) == "abc="


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_actor_is_a_deepspeed_engine_with_the_configured_stage(runtime, model_dir, stage):
    from deepspeed.runtime.engine import DeepSpeedEngine

    cfg = make_cfg(actor__zero_stage=stage)
    actor = Actor(cfg, model_dir, runtime)
    assert isinstance(actor.engine, DeepSpeedEngine)
    assert actor.engine.zero_optimization_stage() == stage == actor.zero_stage

    tok = load_tokenizer(model_dir)
    rollout = HFRollout(cfg, actor, tok)
    seqs = rollout.generate(["abc=", "de="] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], step=1)
    with actor.full_parameters():
        before = [p.detach().clone() for p in actor.module.parameters()]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * seqs.response_mask
    stats = actor.update(seqs, adv, None, None, 0.0)
    assert math.isfinite(stats["actor/grad_norm"]) and stats["actor/grad_norm"] > 0
    assert stats["actor/lr"] == pytest.approx(1e-2)
    with actor.full_parameters():
        after = list(actor.module.parameters())
        assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_response_mask_stops_after_first_eos():
    resp = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 2, 2, 2]])
    assert response_mask_for(resp, [2]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_seeded_sampler_samples_softmax_at_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature = 0.7
    n = 4000
    seeds = [sample_seed(0, 1, i, 0) for i in range(n)]
    sampler = SeededGumbelSampler(seeds, temperature)
    picks = sampler(None, logits.expand(n, -1)).argmax(-1)
    freq = torch.bincount(picks, minlength=4).float() / n
    want = torch.softmax(logits[0] / temperature, -1)
    assert torch.allclose(freq, want, atol=0.03), (freq, want)


def test_sample_seed_depends_on_every_part():
    base = sample_seed(1, 2, 3, 4)
    assert base == sample_seed(1, 2, 3, 4)
    assert (
        len({base, sample_seed(0, 2, 3, 4), sample_seed(1, 0, 3, 4), sample_seed(1, 2, 0, 4), sample_seed(1, 2, 3, 0)})
        == 5
    )


def test_rollout_is_reproducible_per_sequence_and_matches_actor_log_probs(runtime, model_dir):
    cfg = make_cfg(actor__zero_stage=2, rollout__temperature=0.9)
    actor = Actor(cfg, model_dir, runtime)
    rollout = HFRollout(cfg, actor, load_tokenizer(model_dir))
    prompts, keys = ["abcd=", "e=", "fgh="], [(7, 0), (8, 0), (9, 1)]
    a = rollout.generate(prompts, keys, step=3)
    b = rollout.generate(prompts, keys, step=3)
    assert torch.equal(a.input_ids, b.input_ids)
    # The same (prompt, sample) gives the same completion alone as inside a batch of other lengths.
    alone = rollout.generate(["e="], [(8, 0)], step=3)
    n = int(alone.response_mask.sum())
    assert torch.equal(alone.responses[0, :n], a.responses[1, :n])
    assert not torch.equal(rollout.generate(prompts, keys, step=4).responses, a.responses)

    # Log-probs the actor computes (left padding, position ids from the mask) equal the ones generate
    # sampled from, token by token.
    from transformers import GenerationConfig

    enc = rollout.encode(prompts)
    with torch.no_grad():
        out = actor.module.generate(
            **enc,
            return_dict_in_generate=True,
            output_logits=True,
            generation_config=GenerationConfig(
                do_sample=False,
                max_new_tokens=cfg.rollout.max_new_tokens,
                eos_token_id=rollout.eos_ids,
                pad_token_id=rollout.tokenizer.pad_token_id,
            ),
            logits_processor=[sampler_for(cfg.rollout, [sample_seed(0, 3, p, s) for p, s in keys], 0.9)],
        )
        gen_lp = torch.stack(out.logits, 1).float().div(0.9).log_softmax(-1)
        gen_lp = gen_lp.gather(-1, a.responses[:, : gen_lp.shape[1]].unsqueeze(-1)).squeeze(-1)
        actor_lp, _ = sequence_log_probs(actor.engine, a, temperature=0.9)
    # rlctl's lean decode loop samples exactly the tokens HF generate samples with the same noise
    hf_tokens = out.sequences[:, enc["input_ids"].shape[1] :]
    mask = a.response_mask[:, : gen_lp.shape[1]].bool()
    assert torch.equal(hf_tokens[:, : mask.shape[1]][mask], a.responses[:, : mask.shape[1]][mask])
    assert torch.allclose(actor_lp[:, : gen_lp.shape[1]][mask], gen_lp[mask], atol=1e-5)


def test_snapshot_never_sees_a_later_optimizer_step(runtime, model_dir, tmp_path, monkeypatch):
    """Snapshot files are serialized in the background straight from the live weights; an update made
    meanwhile must wait at the fence, so the snapshot holds exactly the weights of its step."""
    import time

    from rlctl.checkpoint.snapshots import SnapshotManager
    from rlctl.rundir.snapshots import zero_topology

    monkeypatch.setenv("RLCTL_FAULTS", "write_delay=0.5")
    cfg = make_cfg(actor__zero_stage=2)
    manager = SnapshotManager(Storage(str(tmp_path / "ckpt")), topology=[zero_topology(2)])
    actor = Actor(cfg, model_dir, runtime, fence=manager.wait_staged)
    rollout = HFRollout(cfg, actor, load_tokenizer(model_dir))
    seqs = rollout.generate(["abc=", "de="] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], step=1)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * seqs.response_mask
    at_save = actor.weights_sha256()

    t0 = time.perf_counter()
    stall = manager.save(1, {}, {"actor": actor}, good=True)
    assert stall < 0.5  # save returned before the files were written
    actor.update(seqs, adv, None, None, 0.0)  # reaches engine.step() while the writer is held
    assert time.perf_counter() - t0 >= 0.5  # ... so it waited at the fence
    assert actor.weights_sha256() != at_save
    manager.close()

    fresh = Actor(cfg, model_dir, runtime)
    manager.restore(manager.catalog.scan()[0], {}, {"actor": fresh})
    assert fresh.weights_sha256() == at_save


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_writer_process_writes_the_bytes_the_thread_writes(runtime, model_dir, tmp_path, stage):
    """Snapshots handed to the writer process (asynchronous: copied into its staging buffers; synchronous:
    written from shared memory) are byte for byte the files the in-process thread writes of the same
    state, step after step (the state stays in shared memory once moved there), and restore exactly."""
    from rlctl.checkpoint.snapshots import SnapshotManager
    from rlctl.rundir.snapshots import zero_topology

    cfg = make_cfg(actor__zero_stage=stage)
    managers = {
        (writer, asynchronous): SnapshotManager(
            Storage(str(tmp_path / f"{writer}-{asynchronous}")),
            topology=[zero_topology(stage)],
            writer=writer,
            asynchronous=asynchronous,
        )
        for writer, asynchronous in (("thread", True), ("process", True), ("process", False))
    }
    fences = [m.wait_staged for m in managers.values()]
    actor = Actor(cfg, model_dir, runtime, fence=lambda: [fence() for fence in fences])
    rollout = HFRollout(cfg, actor, load_tokenizer(model_dir))
    weights = {}
    for step in (1, 2, 3):
        seqs = rollout.generate(["abc=", "de="] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], step=step)
        actor.update(seqs, torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * seqs.response_mask, None, None, 0.0)
        weights[step] = actor.weights_sha256()
        for manager in managers.values():
            manager.save(step, {}, {"actor": actor}, good=True)
    for manager in managers.values():
        manager.close()
    files = {key: [i.manifest["files"] for i in m.catalog.scan()] for key, m in managers.items()}
    assert files[("process", True)] == files[("thread", True)] == files[("process", False)]
    for info in managers[("process", True)].catalog.scan():
        fresh = Actor(cfg, model_dir, runtime)
        managers[("process", True)].restore(info, {}, {"actor": fresh})
        assert fresh.weights_sha256() == weights[info.step]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_give_the_gradient_of_the_whole_mini_batch(runtime, model_dir, mode):
    """Splitting a mini-batch into micro-batches of different token counts must not reweigh tokens:
    the accumulated gradient equals the one of the whole batch in one pass (token-mean is a mean over
    every token of the mini-batch, not a mean of per-micro-batch means). The same for micro-batches by
    token budget (sorted by length, cut to their own columns, DeepSpeed told where the mini-batch ends):
    one sequence each (budget 1), and two or three of unequal sizes (budget 24)."""
    from rlctl.engine.batch import Sequences

    tok = load_tokenizer(model_dir)
    results = []
    cuts = [{}, {"actor__micro_batch_size": 2}, {"actor__max_tokens_per_micro_batch": 1}]
    cuts.append({"actor__max_tokens_per_micro_batch": 24})
    for cut in cuts:
        cfg = make_cfg(actor__zero_stage=2, actor__grad_clip=1e9, **cut)
        cfg.algorithm.loss_agg_mode = mode
        actor = Actor(cfg, model_dir, runtime)
        rollout = HFRollout(cfg, actor, tok)
        seqs = rollout.generate(["abc=", "de="] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], step=1)
        # the first micro-batch keeps 1 + 2 response tokens, the second all of theirs
        keep = torch.ones_like(seqs.response_mask)
        keep[0, 1:] = 0
        keep[1, 2:] = 0
        response_mask = seqs.response_mask * keep
        attention_mask = seqs.attention_mask.clone()
        attention_mask[:, seqs.prompt_len :] *= keep
        seqs = Sequences(seqs.input_ids, attention_mask, response_mask, seqs.prompt_len)
        assert int(response_mask[:2].sum()) < int(response_mask[2:].sum())
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * response_mask
        stats = actor.update(seqs, adv, None, None, 0.0)
        with actor.full_parameters():
            results.append(
                (stats["actor/grad_norm"], torch.cat([p.detach().flatten() for p in actor.module.parameters()]))
            )
        counts = [mb.count for mb in actor.minibatches(seqs)]
        results.append((*results.pop(), counts))
    (norm_whole, weights_whole, counts), *others = results
    assert counts == [1] and [c[0] for *_, c in others] == [2, 4, counts_24 := others[2][2][0]]
    assert 2 <= counts_24 < 4
    for norm_micro, weights_micro, _ in others:
        assert norm_micro == pytest.approx(norm_whole, rel=1e-5)
        # Adam's first step moves every weight by about ±lr whatever its gradient's size, so the few weights
        # whose gradient is float noise around 0 may go either way; all others must agree.
        far = (weights_micro - weights_whole).abs() > 1e-6
        assert int(far.sum()) < far.numel() // 1000


def test_deepspeed_is_imported_without_compiling_its_muon_optimizer():
    """Every ZeRO optimizer imports DeepSpeed's Muon module, which applies torch.compile at import (about
    2 s of torch._inductor at every start of every rank). rlctl imports it first with dynamo off for that
    import only: inductor stays unimported, and TORCHDYNAMO_DISABLE (read at each torch.compile call) is
    gone again, so torch.compile works as before. (ZeRO 1-3 then build on it above.)"""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from rlctl.engine.runtime import MUON, import_deepspeed\n"
        "import_deepspeed()\n"
        "assert MUON in sys.modules and 'torch._inductor.compile_fx' not in sys.modules, 'inductor imported'\n"
        "assert 'TORCHDYNAMO_DISABLE' not in os.environ, 'dynamo left disabled'\n"
        "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_non_finite_critic_micro_batch_leaves_no_gradient_for_the_next_mini_batch(runtime, model_dir, stage):
    """Two micro-batches, the last with a NaN return (so a NaN value loss): it is not applied, and the
    optimizer still steps after it on the first micro-batch's gradient, as the actor's update does.
    Nothing is left accumulated for the next update (before, the critic skipped that step)."""
    from rlctl.engine.critic import Critic

    cfg = make_cfg(actor__micro_batch_size=2, algorithm__name="ppo", critic__zero_stage=stage)
    critic = Critic(cfg, model_dir, runtime)
    rollout = HFRollout(cfg, Actor(cfg, model_dir, runtime), load_tokenizer(model_dir))
    seqs = rollout.generate(["abc=", "de="] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], step=1)
    with torch.no_grad():
        values = critic.values(seqs)
    returns = torch.ones_like(values) * seqs.response_mask
    returns[2:] = float("nan")
    before = critic.weights_sha256()
    out = critic.update(seqs, values, returns)
    assert critic.engine.global_steps == 1 and critic.weights_sha256() != before
    assert math.isfinite(out["critic/grad_norm"])
    assert all(p.grad is None for p in critic.module.parameters())
