"""LoRA through peft and gradient checkpointing, on the real tiny model in a real DeepSpeed engine:
the config, the seeded adapter, only the adapter in the optimizer and in snapshots (ZeRO 1, 2, 3), a
bit-exact restore, the reference as the base with the adapter disabled, the merged weights the vLLM
backend and the export use, the rollout's log-probs, and checkpointing that really recomputes."""

import os

import pytest
import torch
from pydantic import ValidationError

from rlctl.config import RunConfig
from rlctl.engine import lora
from rlctl.engine.actor import Actor, sequence_log_probs
from rlctl.engine.ds_module import weights_digest
from rlctl.engine.model import load_causal_lm, load_tokenizer, prepare_model_dir
from rlctl.engine.rollout.hf import HFRollout
from rlctl.errors import ConfigError
from rlctl.rundir.handle import RunDir
from rlctl.storage import Storage


def small_cfg(rank: int = 4, zero_stage: int = 2, **actor) -> RunConfig:
    return RunConfig.model_validate(
        {
            "trainer": {"prompts_per_step": 2},
            "algorithm": {"group_size": 2},
            "rollout": {"max_new_tokens": 6},
            "actor": {
                "lr": 1e-2,
                "micro_batch_size": 2,
                "zero_stage": zero_stage,
                "lora": {"rank": rank, "alpha": 8},
                **actor,
            },
        }
    )


def build(cfg: RunConfig, runtime, tmp_path) -> tuple[Actor, HFRollout, os.PathLike]:
    model_dir = prepare_model_dir(cfg, RunDir(Storage(str(tmp_path / "model"))))
    actor = Actor(cfg, model_dir, runtime)
    return actor, HFRollout(cfg, actor, load_tokenizer(model_dir)), model_dir


def batch(rollout: HFRollout, step: int = 1):
    return rollout.generate(["abc=", "de="] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], step)


def update(actor: Actor, seqs) -> dict[str, float]:
    adv = torch.linspace(-1, 1, seqs.response_mask.shape[0])[:, None] * seqs.response_mask
    return actor.update(seqs, adv, None, None, 0.0, rollout_log_prob=seqs.rollout_log_probs)


def named(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# -- config ---------------------------------------------------------------------------------------------
def test_lora_config_defaults_off_and_is_strict():
    cfg = RunConfig()
    assert cfg.actor.lora.rank == 0 and cfg.actor.lora.target_modules == "all-linear"
    assert not cfg.actor.gradient_checkpointing and not cfg.critic.gradient_checkpointing
    for bad in ({"rank": 4, "alfa": 8}, {"rank": -1}, {"target_modules": []}, {"dropout": 1.0}):
        with pytest.raises(ValidationError):
            RunConfig.model_validate({"actor": {"lora": bad}})
    assert RunConfig.model_validate({"actor": {"lora": {"target_modules": ["q_proj"]}}}).actor.lora.target_modules


def test_a_target_module_matching_nothing_is_a_located_config_error(runtime, tmp_path):
    cfg = small_cfg()
    cfg.actor.lora.target_modules = ["q_proj", "qkv"]
    with pytest.raises(ConfigError) as err:
        build(cfg, runtime, tmp_path)
    msg = err.value.message
    assert msg.startswith("'actor.lora.target_modules' names 'qkv', which matches no module of the model")
    assert "q_proj" in msg.split(";")[1] and "\n" not in msg


def test_the_adapter_is_seeded_and_leaves_the_global_rng_alone(runtime, tmp_path):
    cfg = small_cfg()
    model_dir = prepare_model_dir(cfg, RunDir(Storage(str(tmp_path / "model"))))
    state = torch.get_rng_state()
    a = named(lora.apply_lora(load_causal_lm(model_dir, torch.float32), cfg.actor.lora, 7))
    assert torch.equal(torch.get_rng_state(), state)
    b = named(lora.apply_lora(load_causal_lm(model_dir, torch.float32), cfg.actor.lora, 7))
    c = named(lora.apply_lora(load_causal_lm(model_dir, torch.float32), cfg.actor.lora, 8))
    lora_a = [n for n in a if "lora_A" in n]
    assert lora_a and all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in lora_a)


# -- training inside DeepSpeed, snapshots and their restore ---------------------------------------------
def dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lora_trains_only_the_adapter_and_restores_bit_exactly(runtime, tmp_path, stage):
    cfg = small_cfg(zero_stage=stage)
    actor, rollout, _ = build(cfg, runtime, tmp_path)
    trainable = [p for p in actor.module.parameters() if p.requires_grad]
    assert actor.frozen and sum(p.numel() for p in trainable) == sum(
        p.numel() for n, p in actor.module.named_parameters() if ".lora_" in n
    )
    assert sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"]) <= sum(
        p.ds_numel if stage == 3 else p.numel() for p in trainable
    )
    with actor.full_parameters():
        before = named(actor.module)
    seqs = batch(rollout)
    update(actor, seqs)
    with actor.full_parameters():
        after = named(actor.module)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_" in n for n in changed)  # the base is frozen, the adapter learns

    actor.save_to_dir(str(tmp_path / "snap" / "actor"))
    again, rollout2, _ = build(cfg, runtime, tmp_path)
    again.load_from_dir(str(tmp_path / "snap" / "actor"))
    assert again.weights_sha256() == actor.weights_sha256()
    update(actor, seqs), update(again, seqs)  # the optimizer state came back too: the next step is equal
    assert again.weights_sha256() == actor.weights_sha256()


def test_a_lora_snapshot_holds_the_adapter_not_the_base(runtime, tmp_path):
    sizes = {}
    for rank in (0, 4):
        actor, rollout, _ = build(small_cfg(rank=rank), runtime, tmp_path / str(rank))
        update(actor, batch(rollout))  # AdamW's moments exist
        actor.save_to_dir(str(tmp_path / f"snap{rank}" / "actor"))
        sizes[rank] = dir_bytes(tmp_path / f"snap{rank}")
    print(f"actor snapshot of the tiny model: full {sizes[0]} bytes, LoRA r=4 {sizes[4]} bytes")
    assert sizes[4] * 8 < sizes[0]


# -- the reference, merged weights, rollout log-probs ------------------------------------------------------
def test_the_reference_is_the_base_with_the_adapter_disabled(runtime, tmp_path):
    cfg = small_cfg()
    actor, rollout, model_dir = build(cfg, runtime, tmp_path)
    seqs = batch(rollout)
    update(actor, seqs)
    base = load_causal_lm(model_dir, torch.float32).eval()
    with torch.no_grad():
        want = sequence_log_probs(base, seqs, 1.0)[0]
        ref = sequence_log_probs(actor.reference(), seqs, 1.0)[0]
        live = actor.log_probs(seqs, 1.0)[0]
    assert torch.equal(ref, want)
    assert not torch.allclose(live, want)  # the adapter is back on afterwards, and has learnt


def test_merged_weights_load_strictly_into_the_plain_model_and_agree(runtime, tmp_path):
    cfg = small_cfg()
    actor, rollout, model_dir = build(cfg, runtime, tmp_path)
    seqs = batch(rollout)
    update(actor, seqs)
    plain = load_causal_lm(model_dir, torch.float32).eval()
    plain.load_state_dict(dict(actor.merged_weights()), strict=True)
    with torch.no_grad():
        lp_plain = sequence_log_probs(plain, seqs, 1.0)[0]
        lp_live = actor.log_probs(seqs, 1.0)[0]
    assert (lp_plain - lp_live).abs().max() < 1e-5
    assert actor.weights_sha256() == weights_digest(plain.named_parameters())


@pytest.mark.parametrize("rank", [0, 4])
def test_rollout_logprob_diff_stays_at_fp32_level(runtime, tmp_path, rank):
    actor, rollout, _ = build(small_cfg(rank=rank), runtime, tmp_path)
    update(actor, batch(rollout))  # a trained adapter, not a zero one
    out = update(actor, batch(rollout, 2))
    assert out["rollout/logprob_diff"] < 1e-5


# -- gradient checkpointing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, 4])
def test_gradient_checkpointing_recomputes_each_layer_in_backward(runtime, tmp_path, rank):
    """The first decoder layer's forward starts twice per micro-batch with checkpointing (forward, then
    again in backward: torch stops that recompute once it has the tensors backward needs, so a pre-hook
    counts it, a post-hook would not), once without; and the update still reaches the weights it trains."""
    calls = {}
    for on in (False, True):
        actor, rollout, _ = build(small_cfg(rank=rank, gradient_checkpointing=on), runtime, tmp_path / str(on))
        seqs = batch(rollout)
        layers = [m for n, m in actor.module.named_modules() if n.endswith("layers.0")]
        count = []
        handle = layers[0].register_forward_pre_hook(lambda *_, c=count: c.append(1))  # (recompute stops early)
        with actor.full_parameters():
            before = named(actor.module)
        update(actor, seqs)
        handle.remove()
        calls[on] = len(count)
        with actor.full_parameters():
            assert any(not torch.equal(p, before[n]) for n, p in named(actor.module).items())
    assert calls == {False: 2, True: 4}  # two micro-batches of two


@pytest.mark.slow
def test_export_adapter_only_of_a_full_run_is_a_one_sentence_config_error(tmp_path):
    from helpers import run_cli

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(RunConfig().to_yaml())
    r = run_cli("export", str(run), str(tmp_path / "out"), "--adapter-only")
    assert r.returncode == 3, r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("Error:")] == [
        f"Error: --adapter-only needs a LoRA run, but {run} trains the full model (actor.lora.rank 0)"
    ]
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_critic_gradient_checkpointing_recomputes_too(runtime, tmp_path):
    from rlctl.engine.critic import Critic

    calls = {}
    for on in (False, True):
        cfg = small_cfg(rank=0)
        cfg.critic.gradient_checkpointing = on
        actor, rollout, model_dir = build(cfg, runtime, tmp_path / str(on))
        critic = Critic(cfg, model_dir, runtime)
        seqs = batch(rollout)
        with torch.no_grad():
            values = critic.values(seqs)
        layer = next(m for n, m in critic.module.named_modules() if n.endswith("layers.0"))
        count = []
        handle = layer.register_forward_pre_hook(lambda *_, c=count: c.append(1))
        critic.update(seqs, values, values + seqs.response_mask)
        handle.remove()
        calls[on] = len(count)
    assert calls == {False: 2, True: 4}
