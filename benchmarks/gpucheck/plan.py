"""The rlctl runs of the GPU check (which runs, with which configs, in which phases), made when a check first
asks for one: the phase holding it runs then (every earlier phase first), its runs side by side.

T  the realistic throughput run: the 0.5B model, 256 sequences x 512 new tokens after 512-token prompts
R  the reference of the resume check (deterministic kernels); its snapshots are the writer process's
K  R's twin, SIGKILLed after step 3; K+ resumes it from its latest snapshot
L  LoRA;  F  fp16 (CUDA only);  S  gradient checkpointing, one synchronous snapshot
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from gpucheck.context import SNAPSHOT_BYTES_PER_PARAM, Ctx
from gpucheck.report import Fail, Skip, log
from gpucheck.runs import Run, Watcher, run_phase

REPO = Path(__file__).resolve().parents[2]
PROGRESS = ("step", "timing_s/", "perf/", "prompt_length/", "response_length/", "actor/loss_scale")  # row keys kept
REST_STEP = 2  # the dry run's T rests after this step until it is stopped, as a budget stops a run mid-step
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RLCTL_FAULTS")


class Plan:
    """The rlctl runs of the checks, made when a check first asks for one: the phase holding it runs then
    (with every earlier phase first), its runs side by side."""

    def __init__(self, ctx: Ctx):
        self.ctx, self.size = ctx, ctx.size
        self.watcher = Watcher(ctx.device == "cuda")
        self.phases = [[n for n in names if n != "F" or ctx.fp16] for names, _ in ctx.size.phases]
        self.budgets = [budget for _, budget in ctx.size.phases]
        self.runs: dict[str, Run] = {}
        self.writers: dict[str, str] = {}  # checkpoint.writer of each run, and why
        self.next_phase = 0
        self.broken: dict[int, str] = {}  # a phase that could not run: why

    def has(self, name: str) -> bool:
        return any(name in names for names in self.phases)

    def budget_until(self, *names: str) -> float:
        """Seconds of the phases not run yet up to the one holding the last of ``names``."""
        last = max(self._phase_of(n) for n in names)
        return sum(self.budgets[self.next_phase : last + 1])

    def _phase_of(self, name: str) -> int:
        return next(i for i, names in enumerate(self.phases) if name in names)

    def get(self, name: str) -> Run:
        """The finished run ``name`` (its phase, and every earlier one, run first)."""
        if self.ctx.model_dir is None:
            raise Skip("no model to train: check 2 did not build one")
        phase = self._phase_of(name)
        while self.next_phase <= phase:
            self._run_phase(self.next_phase)
            self.next_phase += 1
        run = self.runs.get(name)
        if run is None:
            raise Fail(f"run {name} was not started: {self.broken.get(phase)}")
        return run

    def _run_phase(self, index: int) -> None:
        names, budget, runs = self.phases[index], self.budgets[index], []
        try:
            runs = [self._make(n) for n in names]
            self.runs.update({r.name: r for r in runs})
            run_phase(runs, min(budget, max(self.ctx.report.left(), 1.0)), self.watcher, lambda: self.progress(runs))
        except Exception as exc:  # the runs' checks fail with it; the phases after still run
            self.broken[index] = f"{type(exc).__name__}: {exc}"
            for run in runs:
                run.kill()
                run.error = f"its phase broke off: {self.broken[index]}"
            log(f"  phase {', '.join(names)} broke off: {self.broken[index]}")
        self.free_disk(runs)

    def progress(self, runs: list[Run]) -> None:
        """The runs' state so far into the report (``runs_so_far``), written: a kill of this process from
        outside during a phase leaves the last rows the runs wrote there, if not in their check's figures."""
        so_far = self.ctx.report.meta.setdefault("runs_so_far", {})
        for run in runs:
            rows = run.rows()
            last = {k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith(PROGRESS)}
            so_far[run.name] = {**run.facts(), "last_row": last}
        self.ctx.report.write()

    def _make(self, name: str) -> Run:
        ctx = self.ctx
        if name == "K+":  # the killed run, resumed from its latest snapshot (no drill this time)
            killed = self.runs["K"]
            argv = ["resume", str(killed.run_dir), "--from", "latest"]
            return Run("K+", argv, killed.run_dir, run_env(ctx), ctx.work, killed.steps)
        cfg, faults, kill_after = run_config(ctx, name)
        path = ctx.work / "configs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=1))  # (JSON is YAML)
        run_dir = ctx.work / "runs" / name
        env = run_env(ctx, RLCTL_FAULTS=faults) if faults else run_env(ctx)
        steps = cfg["trainer"]["total_steps"]
        argv = ["start", str(path), "--run-dir", str(run_dir)]
        rests_after = REST_STEP if name == "T" and ctx.tiny else None
        return Run(name, argv, run_dir, env, ctx.work, steps, kill_after, rests_after=rests_after)

    def writer_for(self, name: str) -> str:
        """checkpoint.writer of run ``name``: R's snapshots are check 8's, so R keeps the writer process
        (its fallback, if any, is that check's finding); the others write from a thread where /dev/shm
        cannot hold a snapshot of each run of the largest phase at once (check 1 measured it), or in the
        dry run (a process start less each)."""
        need = SNAPSHOT_BYTES_PER_PARAM * self.ctx.params * max(len(names) for names in self.phases)
        if name == "R":
            why = "process: check 8 measures its snapshots"
        elif self.ctx.tiny and name in ("K", "L"):
            why = "thread: the dry run starts as few processes as it can"
        elif self.ctx.shm_free is not None and self.ctx.shm_free < need:
            why = f"thread: /dev/shm has {self.ctx.shm_free / 2**30:.1f} GiB free, the runs' snapshots need {need / 2**30:.1f}"
        else:
            why = "process"
        self.writers[name] = why
        return why.split(":")[0]

    @staticmethod
    def free_disk(runs: list[Run]) -> None:
        """Remove the finished runs' snapshots (their events hold what the checks read): one of the full
        model is about 7 GB (bf16 weights, fp32 master weights and Adam's moments). The killed run's stay
        until its resume has run."""
        for run in runs:
            if run.name != "K":
                shutil.rmtree(run.run_dir / "checkpoints", ignore_errors=True)


def run_env(ctx: Ctx, **extra: str) -> dict:
    """This environment for a run: rlctl importable from the repository (before what PYTHONPATH holds,
    the carried wheels' folder say), JIT builds into the work folder (check 3 says if any happened), no
    distributed variables or drills of this process's."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["TORCH_EXTENSIONS_DIR"] = str(ctx.work / "torch_extensions")
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["DS_ACCELERATOR"] = ctx.device
    if ctx.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def run_config(ctx: Ctx, name: str) -> tuple[dict, str, int | None]:
    """(the config of run ``name``, its RLCTL_FAULTS, the step after which it is SIGKILLed)."""
    size, plan = ctx.size, ctx.plan
    if name == "T":  # check 5: the realistic throughput run, no snapshot
        t = size.throughput
        cfg = base_config(ctx, t, steps=t["steps"], every=0)
        cfg["data"] = {
            "path": str(prompts_file(ctx)),
            "apply_chat_template": False,
            "max_prompt_length": t["prompt_tokens"],
        }
        cfg["actor"]["max_tokens_per_micro_batch"] = t["micro_tokens"]
        # the dry run's T sleeps after step 2 until it is stopped, as a budget stops a run mid-step
        return cfg, (f"sleep@{REST_STEP}=600" if ctx.tiny else ""), None
    if name in ("R", "K"):  # check 6: the reference and the run killed after step 3 (last snapshot: 2)
        cfg = base_config(ctx, size.small, steps=4, every=2)
        cfg["trainer"]["deterministic"] = True
        cfg["checkpoint"]["writer"] = plan.writer_for(name)
        return cfg, ("sleep@3=600" if name == "K" else ""), (3 if name == "K" else None)
    if name == "L":  # check 7: LoRA, one snapshot
        cfg = base_config(ctx, size.small, steps=2, every=2)
        cfg["actor"]["lora"] = {"rank": size.lora_rank, "alpha": 2.0 * size.lora_rank}
        cfg["checkpoint"]["writer"] = plan.writer_for(name)
        return cfg, "", None
    if name == "F":  # check 7: fp16, rewards of 1e5, four optimizer steps a step: the loss scale moves
        cfg = base_config(ctx, size.small, steps=3, every=0)
        cfg["model"]["dtype"] = "fp16"
        cfg["reward"]["function"] = "gpu_check_reward:huge"
        cfg["algorithm"]["adv_estimator"] = "rloo"
        cfg["actor"]["mini_batch_size"] = size.small["prompts"] * size.small["group"] // 4
        return cfg, "", None
    if name == "S":  # checks 7 and 8: gradient checkpointing, one synchronous snapshot; R's shape
        cfg = base_config(ctx, size.small, steps=1, every=1)
        cfg["actor"]["gradient_checkpointing"] = True
        cfg["checkpoint"]["asynchronous"] = False
        cfg["checkpoint"]["writer"] = plan.writer_for(name)
        return cfg, "", None
    raise ValueError(f"no run {name!r}")


def prompts_file(ctx: Ctx) -> Path:
    """T's prompts: a JSONL of the tokenizer's corpus words drawn at random (seeded), each of more tokens than the run keeps (it truncates
    them from the left to data.max_prompt_length), so that every prompt is that long."""
    import random

    from qwen2_random import corpus_words

    path = ctx.work / "prompts.jsonl"
    t, tok = ctx.size.throughput, ctx.tokenizer
    rng = random.Random(1)
    vocab = corpus_words(min(ctx.size.words, 2000))  # words the tokenizer was trained on
    per_word = max(1.0, len(tok(" ".join(vocab[:200]), add_special_tokens=False).input_ids) / 200)
    words = int(t["prompt_tokens"] / per_word * 1.3) + 8
    rows = [{"prompt": " ".join(rng.choices(vocab, k=words))} for _ in range(t["prompts"] * 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def base_config(ctx: Ctx, shape: dict, *, steps: int, every: int) -> dict:
    """GRPO, ZeRO-2, bf16, the HF rollout, the built-in echo prompts through the chat template."""
    return {
        "name": "gpu-check",
        "seed": 0,
        "device": ctx.device,
        "model": {"path": str(ctx.model_dir), "dtype": "bf16"},
        "data": {"apply_chat_template": True},
        "reward": {"function": "gpu_check_reward:varied"},
        "algorithm": {"name": "grpo", "group_size": shape["group"], "ppo_epochs": shape["epochs"]},
        "actor": {"zero_stage": 2, "lr": 1.0e-5},
        "rollout": {"backend": "hf", "max_new_tokens": shape["new_tokens"]},
        "trainer": {"total_steps": steps, "prompts_per_step": shape["prompts"]},
        "checkpoint": {"every": every, "keep_last": 1},
    }
