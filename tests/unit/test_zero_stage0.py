"""ZeRO stage 0 (DeepSpeed without partitioning): the gradient norm it clips is reported, bf16 keeps fp32
master weights that a snapshot restores and an export reads, and fp16 is refused. Resume after SIGKILL and
export end to end: tests/e2e/test_resume.py::test_sigkill_and_resume_is_exact[0]."""

import pytest
import torch

from rlctl.config import validate_config
from rlctl.engine.ds_module import DSModule, EngineSpec, ds_config, stage0_fp32_state_dict
from rlctl.engine.runtime import Runtime
from rlctl.errors import ConfigError

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
