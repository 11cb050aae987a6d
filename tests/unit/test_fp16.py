"""``model.dtype: fp16``: DeepSpeed's dynamic loss scaling, its metrics (``actor/loss_scale``,
``actor/overflow_skipped``) and its state in snapshots.

DeepSpeed 0.19 refuses fp16 on a CPU without oneDNN fp16 (its CPU accelerator's ``is_fp16_supported``),
as this machine's, so rlctl refuses it there before any work. Everything else about fp16 is DeepSpeed's
own ZeRO fp16 path, which runs on the CPU for real once that one capability answer is overridden (torch
computes fp16 on the CPU, slowly): the tests below that train in fp16 override only that answer, and
then build, overflow, scale, snapshot and restore with the real tiny model and the real ZeRO optimizer.
The same tests run on CUDA without the override (``test_fp16_on_cuda``).
"""

import math

import pytest
import torch

from rlctl.config import RunConfig
from rlctl.engine.actor import Actor
from rlctl.engine.ds_module import FP16_LOSS_SCALING, EngineSpec, ds_config
from rlctl.engine.model import load_tokenizer, prepare_model_dir
from rlctl.engine.rollout.hf import HFRollout
from rlctl.engine.runtime import Runtime, cpu_fp16, resolve_dtype
from rlctl.errors import ConfigError
from rlctl.rundir.handle import RunDir
from rlctl.storage import Storage

from helpers import metrics_of, run_cli

SPEC = EngineSpec(lr=1e-3, zero_stage=2, grad_clip=1.0, mini_batch=4, micro_batch=2)
no_cpu_fp16 = pytest.mark.skipif(cpu_fp16(), reason="this CPU computes in fp16 (oneDNN): DeepSpeed allows it")


def small_cfg(dtype: str = "fp16", mini_batch: int | None = None, zero_stage: int = 2) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"dtype": dtype},
            "trainer": {"prompts_per_step": 2},
            "algorithm": {"group_size": 2},
            "rollout": {"max_new_tokens": 6},
            "actor": {"lr": 1e-3, "micro_batch_size": 2, "mini_batch_size": mini_batch, "zero_stage": zero_stage},
        }
    )


@no_cpu_fp16
def test_fp16_on_this_cpu_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as err:
        resolve_dtype("fp16", "cpu")
    assert err.value.message.startswith("'model.dtype' is fp16, which needs a CUDA or NPU device")
    assert "\n" not in err.value.message
    assert resolve_dtype("fp16", "cuda") == torch.float16 and resolve_dtype("fp16", "npu") == torch.float16
    assert resolve_dtype("auto", "cpu") == torch.float32  # auto never picks fp16


@no_cpu_fp16
def test_cli_refuses_fp16_on_the_cpu_before_any_work(tmp_path):
    run = tmp_path / "run"
    r = run_cli("start", "--run-dir", str(run), "--set", "model.dtype=fp16", "--set", "device=cpu")
    assert r.returncode == 3, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert lines == [
        "Error: 'model.dtype' is fp16, which needs a CUDA or NPU device: DeepSpeed refuses fp16 on a CPU without "
        "oneDNN fp16 support, such as this one; use model.dtype: bf16 or fp32 on the CPU"
    ]
    assert "Traceback" not in r.stderr
    assert not run.exists()  # refused by the preflight, before the run directory is made


def test_ds_config_of_fp16_is_dynamic_loss_scaling_as_deepspeed_parses_it(runtime):
    from deepspeed.runtime.config import DeepSpeedConfig

    fp16 = DeepSpeedConfig(ds_config(SPEC, torch.float16)).float16_config
    assert fp16.enabled and fp16.loss_scale == 0  # 0: dynamic
    assert fp16.dynamic_loss_scale_args() == {
        "init_scale": 2**16,
        "scale_window": 1000,
        "delayed_shift": 2,
        "consecutive_hysteresis": False,
        "min_scale": 1,
    }
    assert FP16_LOSS_SCALING["initial_scale_power"] == 16
    for dtype in (torch.float32, torch.bfloat16):
        parsed = DeepSpeedConfig(ds_config(SPEC, dtype))
        assert not parsed.float16_config.enabled
        assert parsed.bfloat16_config.enabled == (dtype == torch.bfloat16)


def test_an_fp32_engine_reports_no_scaling_and_no_metrics(runtime, tmp_path):
    actor, seqs = actor_and_batch(small_cfg("fp32"), runtime, tmp_path)
    assert actor.loss_scale() == 1.0 and actor.overflow_skipped() == 0
    out = actor.update(seqs, torch.full_like(seqs.response_mask, 1e6, dtype=torch.float32), None, None, 0.0)
    assert "actor/loss_scale" not in out and "actor/overflow_skipped" not in out
    assert actor.overflow_skipped() == 0  # an fp32 step never overflows into a skip


def actor_and_batch(cfg: RunConfig, runtime: Runtime, tmp_path):
    """A real tiny actor of ``cfg`` (fresh model directory, same seed) and one rollout batch of 4 sequences."""
    torch.manual_seed(0)
    model_dir = prepare_model_dir(cfg, RunDir(Storage(str(tmp_path / "model"))))
    actor = Actor(cfg, model_dir, runtime)
    seqs = HFRollout(cfg, actor, load_tokenizer(model_dir)).generate(
        ["abc=", "de="] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], 1
    )
    return actor, seqs


@pytest.fixture
def fp16_runtime(runtime):
    """The process's CPU runtime in fp16, with DeepSpeed's fp16 capability answer overridden (the one
    thing that refuses it on this CPU; the training itself is real)."""
    from deepspeed.accelerator import get_accelerator

    accel = type(get_accelerator())
    before = accel.is_fp16_supported
    accel.is_fp16_supported = lambda self: True
    try:
        yield Runtime(runtime.device, torch.float16, runtime.backend, runtime.kind)
    finally:
        accel.is_fp16_supported = before


def fp16_updates(actor: Actor, seqs, blowups: list[bool]) -> list[dict[str, float]]:
    """One update per entry: advantages of 1e4 (gradients overflow fp16 at a scale of 2**16) or of 1."""
    rows = []
    for blowup in blowups:
        adv = torch.full(seqs.response_mask.shape, 1e4 if blowup else 1.0, device=seqs.response_mask.device)
        row = actor.update(seqs, adv * seqs.response_mask, None, None, 0.0)
        # an overflow is the loss scaler's business: nothing NaN/Inf for the default policy's nonfinite rule
        assert all(math.isfinite(v) for v in row.values()), row
        rows.append(row)
    return rows


def fp32_master(actor: Actor) -> list[torch.Tensor]:
    """The ZeRO optimizer's fp32 master weights of this rank (stage 1/2 and stage 3 name them apart)."""
    opt = actor.engine.optimizer
    groups = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat
    return [g.detach().clone() for g in groups]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overflow_skips_the_step_lowers_the_scale_and_resumes_exactly(fp16_runtime, tmp_path, stage):
    actor, seqs = actor_and_batch(small_cfg(zero_stage=stage), fp16_runtime, tmp_path / "a")
    assert actor.module.dtype == torch.float16 and actor.loss_scale() == 2.0**16
    before = actor.weights_sha256()
    [first] = fp16_updates(actor, seqs, [True])
    # one optimizer step (mini-batch 4 = the batch), skipped: weights untouched; hysteresis 2 keeps the scale
    assert first["actor/overflow_skipped"] == 1.0 and first["actor/loss_scale"] == 2.0**16
    assert "actor/grad_norm" not in first  # its only step was skipped: no norm (DeepSpeed's is inf)
    assert actor.weights_sha256() == before
    actor.save_to_dir(str(tmp_path / "snap" / "actor"))
    after = fp16_updates(actor, seqs, [True, False, False])
    # the second overflow in a row spends the hysteresis: the scale halves; then two real steps
    assert [r["actor/loss_scale"] for r in after] == [2.0**15] * 3
    assert [r["actor/overflow_skipped"] for r in after] == [1.0, 0.0, 0.0]
    assert ["actor/grad_norm" in r for r in after] == [False, True, True]
    assert actor.overflow_skipped() == 2 and actor.weights_sha256() != before

    # a second engine restored from the snapshot: same scaler (hysteresis included), same steps, same bits
    again, _ = actor_and_batch(small_cfg(zero_stage=stage), fp16_runtime, tmp_path / "b")
    again.load_from_dir(str(tmp_path / "snap" / "actor"))
    assert again.loss_scale() == 2.0**16 and again.overflow_skipped() == 1
    assert fp16_updates(again, seqs, [True, False, False]) == after
    assert again.weights_sha256() == actor.weights_sha256()
    master = fp32_master(actor)
    assert all(torch.equal(a, b) for a, b in zip(master, fp32_master(again), strict=True))
    assert master[0].dtype == torch.float32  # fp32 master weights behind the fp16 module


def test_an_update_with_one_step_overflowed_reports_the_other_steps_norm(fp16_runtime, tmp_path):
    actor, seqs = actor_and_batch(small_cfg(mini_batch=2), fp16_runtime, tmp_path)  # two optimizer steps
    adv = torch.tensor([1e4, 1e4, 1.0, 1.0]).unsqueeze(1) * seqs.response_mask  # the first one overflows
    row = actor.update(seqs, adv, None, None, 0.0)
    assert row["actor/overflow_skipped"] == 1.0 and row["actor/skipped_updates"] == 0.0
    assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0  # the applied step's alone
    assert actor.loss_scale() == 2.0**16  # one overflow: hysteresis 2 keeps the scale


@pytest.mark.gpu
@pytest.mark.slow
def test_fp16_on_cuda_logs_the_loss_scale_and_resumes_it(tmp_path):
    """fp16 as CUDA computes it, through the CLI: rewards of 1e5 (RLOO does not normalise them away)
    overflow the fp16 gradients, so the scale moves; a resume from step 2 restores the scaler, and the
    later steps' scales and skipped counts come out as before (a fresh scaler would start at 2**16)."""
    (tmp_path / "huge.py").write_text(
        "def f(prompts, completions, **_):\n    return [1e5 * (len(c) % 3) for c in completions]\n"
    )
    run = tmp_path / "run"
    args = ["--set", "device=cuda", "--set", "model.dtype=fp16", "--set", "trainer.total_steps=6"]
    args += ["--set", "checkpoint.every=2", "--set", "trainer.prompts_per_step=4", "--set", "algorithm.group_size=4"]
    args += ["--set", "algorithm.adv_estimator=rloo", "--set", "reward.function=huge:f"]
    env = {"DS_ACCELERATOR": "cuda"}
    r = run_cli("start", "--run-dir", str(run), *args, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    scales = [row["actor/loss_scale"] for row in rows]
    skipped = [row["actor/overflow_skipped"] for row in rows]
    assert all(s in {2.0**k for k in range(17)} for s in scales), scales  # 2**16, halved on overflows
    assert sum(skipped[2:]) > 0 and min(scales[2:]) < 2.0**16, (scales, skipped)  # overflows after step 2
    r = run_cli("resume", str(run), "--from", "step-2", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    again = metrics_of(run)
    assert [row["step"] for row in again] == [1, 2, 3, 4, 5, 6]
    assert [row["actor/loss_scale"] for row in again] == scales  # the scaler came back with the snapshot
    assert [row["actor/overflow_skipped"] for row in again] == skipped
