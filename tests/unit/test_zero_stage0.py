"""ZeRO stage 0 (DeepSpeed without partitioning): the gradient norm it clips is reported, bf16 keeps fp32
master weights that a snapshot restores and an export reads, and fp16 is refused. A world of one trains at
stage 0 whatever stage 1 or 2 its config names (``trained_stage``), and a ZeRO-1/2 engine loads its
checkpoints bit for bit. Resume after SIGKILL and export end to end:
tests/e2e/test_killed_runs_resume_exactly.py::test_sigkill_and_resume_is_exact; onto 2 ranks: tests/e2e/test_elastic_resume.py."""

import pytest
import torch

from rlctl.config import validate_config
from rlctl.engine.ds_module import DSModule, EngineSpec, ds_config, stage0_fp32_state_dict
from rlctl.engine.runtime import Runtime
from rlctl.errors import ConfigError
from rlctl.rundir.snapshots import ZeroStages, trained_stage, trained_stages, zero_topologies

SPEC = EngineSpec(lr=1e-2, zero_stage=0, grad_clip=1.0, mini_batch=1, micro_batch=1)


def tied_model() -> torch.nn.Module:
    """Three linear layers, the last tied to the first (as tied embeddings are)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[2].weight = model[0].weight
    return model


def test_stage_0_is_a_config_value_and_fp16_is_refused_there():
    assert validate_config({"actor": {"zero_stage": 0}, "critic": {"zero_stage": 0}}).actor.zero_stage == 0
    assert ds_config(SPEC, torch.bfloat16)["zero_optimization"] == {"stage": 0}
    with pytest.raises(ConfigError, match="model.dtype fp16 needs actor.zero_stage 1, 2 or 3"):
        validate_config({"model": {"dtype": "fp16"}, "actor": {"zero_stage": 0}})  # when the config loads
    with pytest.raises(ConfigError, match="model.dtype fp16 needs critic.zero_stage 1, 2 or 3"):
        ds_config(
            EngineSpec(lr=1e-3, zero_stage=0, grad_clip=1.0, mini_batch=1, micro_batch=1, section="critic"),
            torch.float16,
        )


def test_stage_0_in_fp32_reports_the_norm_it_clips(runtime):
    module = DSModule(tied_model(), SPEC, runtime)
    assert module.engine.optimizer is module.optimizer and module.zero_stage == 0  # a bare torch AdamW
    x = torch.ones(2, 8)
    plain = tied_model()  # the same weights outside DeepSpeed, for the expected norm
    plain(x).sum().backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]))
    module.step(module.engine(x).sum())
    assert module.engine.get_global_grad_norm() == pytest.approx(expected, rel=1e-5) and expected > 1.0


def test_stage_0_in_a_world_of_one_skips_deepspeeds_reduction_and_steps_on_autograds_gradients(runtime):
    """DeepSpeed's reduction after each backward (flatten, all-reduce over one rank, copy back) is the
    identity in a world of one: a stage-0 engine there never runs it, and its optimizer steps on exactly
    the gradients autograd left. A ZeRO-1 engine keeps its own reduction."""
    module = DSModule(tied_model(), SPEC, runtime)
    calls = []
    module.engine.allreduce_gradients = lambda *a, **k: calls.append(a)
    x = torch.ones(2, 8)
    plain = tied_model()
    plain(x).sum().backward()
    module.engine.backward(module.engine(x).sum(), scale_wrt_gas=False)
    grads = [p.grad for p in module.module.parameters()]
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, plain.parameters(), strict=True))
    module.engine.step()
    assert calls == [] and module.engine.global_steps == 1
    zero1 = DSModule(
        tied_model(), EngineSpec(lr=1e-2, zero_stage=1, grad_clip=1.0, mini_batch=1, micro_batch=1), runtime
    )
    assert zero1.engine.enable_backward_allreduce is True


def test_stage_0_in_bf16_keeps_fp32_masters_that_resume_and_export(runtime, tmp_path):
    bf16 = Runtime(runtime.device, torch.bfloat16, runtime.backend, runtime.kind)
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    module = DSModule(tied_model(), SPEC, bf16)
    for _ in range(2):
        module.step(module.engine(x).float().sum())
    assert next(module.module.parameters()).dtype == torch.bfloat16
    masters = [p.detach().clone() for g in module.optimizer.fp32_groups for p in g]
    assert masters[0].dtype == torch.float32 and len(masters) == 5  # the tied weight once
    module.save_to_dir(str(tmp_path / "actor"))

    exported = stage0_fp32_state_dict(str(tmp_path / "actor"))
    assert torch.equal(exported["0.weight"], masters[0]) and torch.equal(exported["2.weight"], masters[0])
    assert torch.equal(exported["2.bias"], masters[4]) and exported["1.bias"].dtype == torch.float32

    again = DSModule(tied_model(), SPEC, bf16)
    again.load_from_dir(str(tmp_path / "actor"))
    restored = [p for g in again.optimizer.fp32_groups for p in g]
    assert all(torch.equal(a, b) for a, b in zip(masters, restored, strict=True))
    module.step(module.engine(x).float().sum()), again.step(again.engine(x).float().sum())
    assert again.weights_sha256() == module.weights_sha256()  # the AdamW moments came back too


# the weights after one more step, a stage-0 engine's against a ZeRO engine that loaded its checkpoint:
# within this fraction of each tensor's largest magnitude (tests/e2e/test_elastic_resume.py's TOLERANCE)
TOLERANCE = 1e-5


def other_model(seed: int) -> torch.nn.Module:
    """``tied_model``'s shape with other weights: a load must replace every one of them."""
    model = tied_model()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    ("dtype", "stage"), [(torch.float32, 2), (torch.bfloat16, 2), (torch.float32, 1), (torch.bfloat16, 1)]
)
def test_a_stage_0_checkpoint_loads_into_a_zero_engine_bit_for_bit(runtime, tmp_path, dtype, stage):
    """Weights, fp32 masters, Adam's moments and step, the lr schedule and DeepSpeed's counters of a
    stage-0 engine's checkpoint come back exactly in a ZeRO-1/2 engine (read through DeepSpeed's
    ``safe_get_full_*``); one more step on both then gives the same weights within TOLERANCE."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    rt = Runtime(runtime.device, dtype, runtime.backend, runtime.kind)
    x = torch.ones(2, 8, dtype=dtype)
    spec = EngineSpec(lr=1e-2, zero_stage=0, grad_clip=1.0, mini_batch=1, micro_batch=1, warmup_steps=5)
    zero0 = DSModule(tied_model(), spec, rt)
    for _ in range(3):
        zero0.step(zero0.engine(x).float().sum())
    zero0.save_to_dir(str(tmp_path / "actor"))
    saved = torch.load(tmp_path / "actor" / "mp_rank_00_model_states.pt", weights_only=False)
    inner = saved["optimizer"].get("optimizer_state_dict", saved["optimizer"])
    params = [p for p in zero0.module.parameters()]
    masters = saved["optimizer"]["fp32_groups"][0] if dtype == torch.bfloat16 else [p.detach() for p in params]

    loaded = DSModule(other_model(1), EngineSpec(**{**spec.__dict__, "zero_stage": stage}), rt)
    assert loaded.zero_stage == stage and loaded.weights_sha256() != zero0.weights_sha256()
    loaded.load_from_dir(str(tmp_path / "actor"))
    assert loaded.weights_sha256() == zero0.weights_sha256()
    zero = loaded.engine.optimizer
    lps = (zero.bit16_groups if hasattr(zero, "bit16_groups") else zero.bf16_groups)[0]
    assert len(lps) == len(masters) == 5  # (the tied weight once)
    for k, lp in enumerate(lps):
        assert torch.equal(safe_get_full_fp32_param(lp), masters[k]), k
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(safe_get_full_optimizer_state(lp, key), inner["state"][k][key]), (k, key)
    flat = loaded.engine.optimizer.optimizer.param_groups[0]["params"][0]
    assert float(loaded.engine.optimizer.optimizer.state[flat]["step"]) == float(inner["state"][0]["step"]) >= 3
    assert loaded.scheduler.state_dict() == zero0.scheduler.state_dict()
    assert loaded.optimizer.param_groups[0]["lr"] == zero0.optimizer.param_groups[0]["lr"] < 1e-2  # (warm-up)
    for counter in ("global_steps", "global_samples", "skipped_steps"):
        assert getattr(loaded.engine, counter) == getattr(zero0.engine, counter), counter

    for module in (zero0, loaded):
        module.step(module.engine(x).float().sum())
    want = dict(zero0.module.named_parameters())
    for name, got in loaded.module.named_parameters():
        bound = TOLERANCE * float(want[name].detach().float().abs().max()) + 1e-12
        assert float((got.detach().float() - want[name].detach().float()).abs().max()) <= bound, name
    assert loaded.scheduler.state_dict() == zero0.scheduler.state_dict()


def test_a_world_of_one_trains_at_stage_0_unless_fp16_or_its_snapshot_says_otherwise():
    # (configured, world, fp16, the resumed snapshot's recorded stage or None for a fresh start)
    assert trained_stage(2, 1, False, None) == 0 and trained_stage(1, 1, False, None) == 0  # fresh, 1 rank
    assert trained_stage(2, 1, True, None) == 2  # fp16: never stage 0
    assert trained_stage(2, 2, False, None) == 2  # more ranks: the configured stage
    assert trained_stage(2, 1, False, 2) == 2  # a run begun at stage 2 on one rank keeps it
    assert trained_stage(2, 1, False, 0) == 0  # one begun at stage 0 too
    assert trained_stage(2, 2, False, 0) == 2  # a stage-0 snapshot resumed onto 2 ranks: configured
    assert trained_stage(3, 1, False, None) == 3 and trained_stage(0, 2, False, None) == 0  # ZeRO-3, stage 0 kept

    ppo = validate_config({"algorithm": {"name": "ppo"}, "critic": {"zero_stage": 1}})
    assert trained_stages(ppo, False) == ZeroStages(0, 0)
    assert trained_stages(ppo, False, {"zero_stage": 2}) == ZeroStages(2, 1)  # (before the critic's was recorded)
    assert trained_stages(ppo, False, {"zero_stage": 0, "critic_zero_stage": 0}) == ZeroStages(0, 0)
    assert trained_stages(validate_config({}), False, {"zero_stage": 0}) == ZeroStages(0, None)


def test_a_snapshot_of_stage_0_is_usable_by_a_zero_1_or_2_run_and_no_other_stage_changes():
    grpo, ppo = validate_config({}), validate_config({"algorithm": {"name": "ppo"}})
    (actor,) = zero_topologies(grpo)  # the read side: the configured stage 2, or 0
    assert actor.problem({"zero_stage": 0}) is None and actor.problem({"zero_stage": 2}) is None
    assert actor.problem({"zero_stage": 3}) == (
        "written with ZeRO stage 3; this run uses stage 2 (the stage cannot change on resume)"
    )
    (engine,) = zero_topologies(grpo, ZeroStages(0))  # a stage-0 engine loads no partitions
    assert engine.value == 0 and engine.problem({"zero_stage": 2}) is not None
    (three,) = zero_topologies(validate_config({"actor": {"zero_stage": 3}}))
    assert three.problem({"zero_stage": 0}) is not None
    _, critic = zero_topologies(ppo, ZeroStages(0, 0))
    assert critic.key == "critic_zero_stage" and critic.value == 0
    assert critic.problem({}) == (  # a manifest from before the critic's stage was recorded: the configured one
        "the critic's files written with ZeRO stage 2; this run uses stage 0 (the stage cannot change on resume)"
    )
