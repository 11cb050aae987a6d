"""rlctl on a GPU in one command that fits one call of the lent machine (600 s, the wheels' install included,
with over 60 s to spare): the first run on a lent machine, or on any.

    python3 benchmarks/gpu_check.py --out DIR                 # on a CUDA machine (make gpu-check OUT=DIR)
    python3 benchmarks/gpu_check.py --out DIR --device cpu --tiny   # the dry run the test suite runs

Run from the repository root, with rlctl's dependencies importable (docs/gpu-check.md: `make gpu-wheels`
builds the ones a bare image lacks). The checks, each with a budget (gpucheck/context.py, FULL), in order:

1. env: versions, the GPU, bf16, DeepSpeed (built without ops), rlctl's imports and bounds; the bf16
   matrix product's rate; /dev/shm's size and free space, and how fast the disk and /dev/shm take writes;
2. build: a Qwen2-shaped model of Qwen2.5-0.5B-Instruct's sizes with random weights, and a byte-level BPE
   tokenizer trained here with ChatML's tokens and a chat template;
3. probe: rlctl's decode against transformers' generate (and its continuous batching), side by side;
4. identity: the counter sampler's tokens from the same logits on the GPU and the CPU;
5. throughput: a realistic GRPO step (256 sequences x 512 new tokens after 512-token prompts, 1 PPO
   epoch) through `rlctl start`: tokens/s, the update's MFU, the share of the step spent generating;
6. resume: a run SIGKILLed after step 3 and resumed against an uninterrupted one, deterministic kernels;
7. LoRA's snapshot, fp16's loss scale, gradient checkpointing's memory;
8. the snapshot writer process on device tensors: the asynchronous stall against a synchronous save;
9. the tests marked gpu, if time is left.

Every run is a real `python -m rlctl start/resume` subprocess with a config this script writes, read back
through its metrics.jsonl and events.jsonl. Every figure is computed and written before a check is judged;
a check that crashes is a failure with its error, never a lost report; a phase stopped at its budget keeps
the figures of what it did. report.json and summary.txt are rewritten when a check starts, after each
phase of runs (every 10 s while they run) and after each check, so a kill from outside leaves the report
so far (its verdict says UNFINISHED). Exit 1 when a check failed. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpucheck/, beside this file

from gpucheck import build, decode, env, training  # noqa: E402
from gpucheck.context import FULL, TINY, Ctx  # noqa: E402
from gpucheck.plan import Plan  # noqa: E402
from gpucheck.report import Report, log  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# (number, name, title, the runs it reads (their phases count in its budget) or its own budget's key, check)
CHECKS = [
    ("1", "env", "environment, /dev/shm, disk and shm writes, matrix product", "env", env.check_env),
    ("2", "build", "Qwen2-shaped model and tokenizer", "build", build.check_build),
    ("3", "probe", "rlctl decode against transformers generate", "probe", decode.check_probe),
    ("4", "identity", "counter sampler: same tokens on GPU and CPU", "identity", decode.check_identity),
    ("5", "throughput", "realistic GRPO step: tokens/s, MFU, generation share", ("T",), training.check_throughput),
    ("6", "resume", "SIGKILL and resume, deterministic", ("R", "K", "K+"), training.check_resume),
    ("7a", "lora", "LoRA snapshot against the full one", ("L", "R"), training.check_lora),
    ("7b", "fp16", "fp16 loss scaling", ("F",), training.check_fp16),
    ("7c", "ckpt", "gradient checkpointing's memory", ("S", "R"), training.check_ckpt),
    ("8", "writer", "snapshot writer process, device tensors", ("R", "S"), training.check_writer),
    ("9", "gpu_tests", "pytest -m gpu, in the time left", "gpu_tests", training.check_gpu_tests),
]


def run_checks(ctx: Ctx, budgets: dict) -> None:
    """The checks in order. An in-process check gets its own budget; one that reads runs gets the budgets
    of the phases it starts, and 10 s to read them; the gpu tests get what is left."""
    report, plan = ctx.report, ctx.plan
    for number, name, title, needs, fn in CHECKS:
        if isinstance(needs, str):
            budget = report.left() - 5 if needs == "gpu_tests" else budgets[needs]
        else:
            present = [n for n in needs if plan.has(n)]
            budget = (plan.budget_until(*present) if present else 0) + 10
        if name == "throughput" and ctx.model is not None:
            let_go_of_model(ctx)  # the runs get the whole device
        report.run(number, name, title, budget, lambda f, c, fn=fn: fn(ctx, f, c))


def let_go_of_model(ctx: Ctx) -> None:
    import torch

    ctx.model = None
    if ctx.device == "cuda":
        torch.cuda.empty_cache()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for report.json and summary.txt")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the built-in model's sizes: the CPU dry run")
    parser.add_argument("--work", type=Path, default=None, help="where the temporary folder goes (default: TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (model, runs, logs)")
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="CHECK=SECONDS",
        help="another budget for an in-process check (env, build, probe, identity); repeatable",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ["DS_ACCELERATOR"] = args.device  # before anything imports DeepSpeed
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if str(REPO) not in sys.path:  # this tree's rlctl, installed or not (the runs get it on PYTHONPATH)
        sys.path.insert(1, str(REPO))
    size = TINY if args.tiny else FULL
    budgets = {**size.budgets, **{k: float(v) for k, v in (b.split("=", 1) for b in args.budget)}}
    work = Path(tempfile.mkdtemp(prefix="rlctl-gpu-check-", dir=args.work))
    meta = {
        "mode": "tiny" if args.tiny else "full",
        "device": args.device,
        "machine": platform.node(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rlctl_commit": git_commit(),
        "budget_s": size.total,
        "budgets_s": {"checks": budgets, "phases": [{"runs": list(r), "budget": b} for r, b in size.phases]},
        "work": str(work),
    }
    report = Report(args.out, meta, size.total)
    ctx = Ctx(args.device, size, args.tiny, work, report, fp16=fp16_here(args.device))
    ctx.plan = Plan(ctx)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        run_checks(ctx, budgets)
        report.meta["finished"] = True
    except KeyboardInterrupt:
        report.meta["interrupted"] = True
        log("interrupted: the report holds the checks that ran")
    finally:
        for run in ctx.plan.runs.values():
            run.kill()
        report.meta["gpu"] = ctx.gpu_name
        report.meta["writers"] = ctx.plan.writers
        report.write()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(report.summary(), end="")
    log(f"report: {args.out / 'report.json'}")
    return 1 if report.failed() or report.meta.get("interrupted") else 0


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def interrupted(signum, frame) -> None:
    """SIGTERM (a timeout's kill) ends the checks as Ctrl-C does: the report keeps what ran."""
    raise KeyboardInterrupt


def fp16_here(device: str) -> bool:
    """Whether DeepSpeed trains in fp16 on this device (rlctl refuses it on a CPU without oneDNN fp16)."""
    if device == "cuda":
        return True
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main())
