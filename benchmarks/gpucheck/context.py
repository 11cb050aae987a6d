"""What the GPU check builds and runs (its sizes: the full one for a GPU, the tiny one of the CPU dry run),
the budgets of its checks and phases, written here in one place so that they can be seen to add up, and
what the checks share while they run (Ctx). The model's shapes, the tokenizer and the datasheets' bf16
peaks are benchmarks/qwen2_random.py's, which benchmarks/grpo_vs_trl.py builds its model with too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import qwen2_random
from qwen2_random import QWEN_05B, TINY_MODEL

from gpucheck.report import Report

SNAPSHOT_BYTES_PER_PARAM = 16  # bf16 weights, fp32 master weights, Adam's two moments (14), and room


def bf16_peak(name: str | None) -> float | None:
    """The datasheet's dense bf16 peak of this GPU (TFLOP/s; qwen2_random's table), None without one."""
    return qwen2_random.bf16_peak(name) if name else None


@dataclass(frozen=True)
class Size:
    """What the checks build and run. The runs go in phases (runs of a phase side by side; a phase's
    runs are stopped at its budget); ``budgets`` are the in-process checks' seconds."""

    model: dict
    vocab: int  # the trained tokenizer's vocabulary (the model's is larger, as Qwen's)
    words: int  # distinct words of the synthetic corpus the tokenizer is trained on
    io_mib: int  # the most check 1 writes to disk and to /dev/shm to time them
    matmul: int  # the side of the square matrix product timed in check 1
    probe: dict  # the decode probe's shape (check 3): batch, prompt and new tokens, rounds at most
    identity: dict  # the CPU/GPU identity's batch, prompt tokens and decode steps (check 4)
    throughput: dict  # the realistic run T (check 5)
    small: dict  # the shape of the resume (check 6), LoRA, fp16 and gradient-checkpointing runs (check 7)
    lora_rank: int
    phases: tuple  # ((runs, budget), ...) in the order they run
    budgets: dict  # seconds of the checks that run in this process (the gpu tests get what is left)
    disk_gib: float  # free disk the runs need in the work folder
    total: float  # seconds for the whole script: the sum of the budgets and Python's start and end


FULL = Size(
    model=QWEN_05B,
    vocab=151643,
    words=150000,
    io_mib=1024,
    matmul=8192,
    probe=dict(batch=128, prompt=512, new_tokens=128, rounds=3),
    identity=dict(batch=8, prompt=64, steps=8),
    # 256 sequences x 512 new tokens after 512-token prompts, 1 PPO epoch, one optimizer step: the work of
    # a common GRPO step. No snapshot (a 7 GB commit is not what it times); step 2 is the steady one,
    # step 1 warms up; micro-batches of 8,192 tokens keep the (tokens, vocabulary) logits near 5 GB
    throughput=dict(prompts=64, group=4, new_tokens=512, prompt_tokens=512, epochs=1, steps=2, micro_tokens=8192),
    small=dict(prompts=8, group=4, new_tokens=48, epochs=1),
    lora_rank=16,
    # sized from the H100's third try (2026-11-27): a run's first step ended about 50 s after its start
    # (imports, the model, DeepSpeed, a generation whose noise came from the CPU), later small steps took
    # seconds, and a snapshot of the 0.5B model with its AdamW state is about 7 GB
    phases=((("T",), 130), (("R", "K"), 100), (("K+", "L", "F", "S"), 90)),
    # the probe's and the identity's first picks on CUDA compile rlctl's sampler (torch.compile)
    budgets={"env": 25, "build": 30, "probe": 45, "identity": 20},
    disk_gib=25,  # snapshots on disk at once, at most: R's two and K's one
    # 440 s of budgets, the gpu tests in what is left (about 40 s), 5 s for the last report: with the
    # wheels' install (about 25 s) one call of the lent machine's (600 s) has 85 s to spare
    total=490,
)
TINY = Size(
    model=TINY_MODEL,
    vocab=500,
    words=2000,
    io_mib=16,
    matmul=256,
    probe=dict(batch=4, prompt=16, new_tokens=8, rounds=2),
    identity=dict(batch=4, prompt=8, steps=4),
    # open-ended: it sleeps after step 2 (a drill) and is stopped once it has written that step and its
    # phase's other runs have ended, as the budget stops it on a GPU; its figures are read from its rows
    throughput=dict(prompts=4, group=2, new_tokens=16, prompt_tokens=48, epochs=1, steps=50, micro_tokens=256),
    small=dict(prompts=4, group=4, new_tokens=8, epochs=1),
    lora_rank=4,
    # fewest process starts: T beside R and K
    phases=((("T", "R", "K"), 150), (("K+", "L", "S"), 150)),
    budgets={"env": 60, "build": 60, "probe": 40, "identity": 30},
    disk_gib=0.1,
    total=900,
)


@dataclass
class Ctx:
    """What the checks share."""

    device: str  # cuda or cpu
    size: Size
    tiny: bool
    work: Path  # the temporary folder: the model, the configs, the runs
    report: Report
    fp16: bool = False  # whether DeepSpeed trains in fp16 here (CUDA; a CPU with oneDNN fp16)
    model_dir: Path | None = None
    model: Any = None  # check 2's model, on the device, for checks 3 and 4 (then let go)
    tokenizer: Any = None
    params: int = 0
    matmul_params: int = 0  # weights of the model's matrix products, the tied LM head included
    head_params: int = 0  # the LM head's (computed over the response's positions only)
    gpu_name: str | None = None
    matmul_tflops: float | None = None  # the bf16 (CPU: fp32) matrix product's rate measured in check 1
    shm_free: int | None = None  # bytes free in /dev/shm (check 1)
    plan: Any = None  # the rlctl runs (plan.Plan)
