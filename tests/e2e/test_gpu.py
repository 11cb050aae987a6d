"""On a machine with an NVIDIA GPU: a real ~0.5B Hugging Face model with vLLM rollout and ZeRO-2
completes, snapshots and resumes. Skipped without a GPU (conftest) and without a model directory:
set RLCTL_GPU_MODEL to a local causal-LM directory (e.g. Qwen2.5-0.5B-Instruct)."""

import os

import pytest

from helpers import metrics_of, run_cli, start_args

pytestmark = pytest.mark.gpu


def test_half_billion_model_with_vllm_and_zero2_snapshots_and_resumes(tmp_path):
    model = os.environ.get("RLCTL_GPU_MODEL")
    if not model:
        pytest.skip("set RLCTL_GPU_MODEL to a local ~0.5B causal-LM directory")
    pytest.importorskip("vllm")
    run = tmp_path / "run"
    args = [
        "--set",
        f"model.path={model}",
        "--set",
        "device=cuda",
        "--set",
        "rollout.backend=vllm",
        "--set",
        "actor.zero_stage=2",
        "--set",
        "trainer.total_steps=4",
        "--set",
        "checkpoint.every=2",
        "--set",
        "trainer.prompts_per_step=8",
        "--set",
        "algorithm.group_size=4",
        "--set",
        "rollout.max_new_tokens=64",
        "--set",
        "rollout.gpu_memory_utilization=0.3",
    ]
    r = run_cli("start", *start_args(run), *args, env={"DS_ACCELERATOR": "cuda"})
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["rollout/logprob_diff"] < 0.1 for row in rows)  # bf16 vLLM against bf16 DeepSpeed
    r = run_cli("resume", str(run), "--from", "step-2", env={"DS_ACCELERATOR": "cuda"})
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in metrics_of(run)] == [1, 2, 3, 4]
