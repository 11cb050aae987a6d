"""The two sides, each in a long-lived worker process of its own: rlctl through its library API, TRL's
GRPOTrainer, and the parent's handle on a worker (benchmarks/grpo_vs_trl.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

from trlcompare.common import LR, SEED, Job, RunResult, log


# -- rlctl (worker) ---------------------------------------------------------------------------------
def rlctl_overrides(job: Job) -> list[str]:
    # load_config(None, ...) starts from the packaged built-in config: every key relied on is set here.
    return [
        "name=bench",
        f"seed={SEED}",
        f"device={job.device}",
        "policies=[]",
        f"model.path={job.model_dir}",
        f"model.dtype={job.dtype}",
        f"data.path={job.data}",
        "data.prompt_key=prompt",
        "data.apply_chat_template=false",
        f"data.max_prompt_length={job.max_prompt_length}",
        "data.shuffle=true",
        "reward.function=rlctl.engine.reward.builtin:echo_reward",
        "reward.kwargs={}",
        f"trainer.total_steps={job.steps}",
        f"trainer.prompts_per_step={job.prompts_per_step}",
        "trainer.num_threads=1",
        "algorithm.name=grpo",
        "algorithm.adv_estimator=grpo",
        f"algorithm.group_size={job.group}",
        f"algorithm.kl_coef={job.kl_coef}",
        "algorithm.kl_estimator=k3",
        "algorithm.kl_in_reward=false",
        "algorithm.kl_ctrl.type=fixed",
        "algorithm.clip_ratio=0.2",
        "algorithm.loss_agg_mode=token-mean",
        "algorithm.entropy_coef=0.0",
        "algorithm.ppo_epochs=1",
        "algorithm.importance_ratio=token",
        "algorithm.dynamic_sampling.enabled=false",
        "algorithm.overlong.enabled=false",
        f"actor.lr={LR}",
        "actor.zero_stage=2",
        "actor.grad_clip=1.0",
        "actor.weight_decay=0.0",
        "actor.betas=[0.9, 0.999]",
        "actor.warmup_steps=0",
        "actor.mini_batch_size=null",
        f"actor.micro_batch_size={job.micro_batch or 'null'}",
        f"actor.max_tokens_per_micro_batch={job.max_tokens if job.max_tokens else 'null'}",
        "rollout.backend=hf",
        f"rollout.mode={job.mode}",
        f"rollout.max_new_tokens={job.max_new_tokens}",
        "rollout.temperature=1.0",
        "checkpoint.every=0",
    ]


def run_rlctl(job: Job) -> RunResult:
    import torch

    from rlctl.config import load_config
    from rlctl.run import start_run

    torch.set_num_threads(1)
    cfg = load_config(None, rlctl_overrides(job))
    t0 = time.perf_counter()
    start_run(cfg, job.out)
    wall = time.perf_counter() - t0
    text = (Path(job.out) / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if [r["step"] for r in rows] != list(range(1, job.steps + 1)):
        raise RuntimeError(f"rlctl wrote steps {[r['step'] for r in rows]} in {job.out}; expected 1..{job.steps}")
    batch = job.prompts_per_step * job.group
    return RunResult(
        side="rlctl",
        step_s=[r["timing_s/step"] for r in rows],
        tokens=[r["response_length/mean"] * batch for r in rows],
        mean_len=[r["response_length/mean"] for r in rows],
        gen_s=[r["timing_s/gen"] for r in rows],
        ref_s=[r["timing_s/ref"] for r in rows],
        padding=[r["perf/update_padding_frac"] for r in rows],
        max_len=[r["response_length/max"] for r in rows],
        wall_s=wall,
        threads=torch.get_num_threads(),
        update_tokens=[batch * (r["prompt_length/mean"] + r["response_length/mean"]) for r in rows],
    )


# -- TRL (worker) -----------------------------------------------------------------------------------
_NOTED: set[str] = set()


def trl_config(job: Job):
    from trl import GRPOConfig

    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    batch = job.prompts_per_step * job.group  # TRL's batch counts completions
    micro = job.micro_batch or batch
    kwargs = dict(  # noqa: C408 - keyword arguments of GRPOConfig
        output_dir=job.out,
        use_cpu=job.device == "cpu",
        seed=SEED,
        per_device_train_batch_size=micro,  # one generation of the whole batch, one optimizer step over it
        gradient_accumulation_steps=batch // micro,
        num_generations=job.group,
        num_iterations=1,
        steps_per_generation=batch // micro,
        max_completion_length=job.max_new_tokens,
        max_prompt_length=job.max_prompt_length,
        temperature=1.0,
        top_p=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch_fused",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=job.kl_coef,
        epsilon=0.2,
        max_steps=job.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=job.dtype == "bf16",
        fp16=False,
        gradient_checkpointing=job.grad_ckpt,
        dataloader_num_workers=0,
        use_vllm=False,
        use_transformers_continuous_batching=job.continuous_batching,
        transformers_continuous_batching_config=job.cb_config,
        disable_tqdm=True,
    )
    if "top_k" in fields:  # "no top-k" is None in older TRL, 0 in newer
        kwargs["top_k"] = None if fields["top_k"].default is None else 0
    if job.continuous_batching and "use_transformers_continuous_batching" not in fields:
        raise RuntimeError("this TRL has no use_transformers_continuous_batching (TRL 1.x with transformers >= 5.8)")
    for key in [k for k in kwargs if k not in fields]:  # names that changed across TRL versions
        if key not in _NOTED:
            _NOTED.add(key)
            log(f"note: this TRL's GRPOConfig has no '{key}'; left out")
        kwargs.pop(key)
    return GRPOConfig(**kwargs)


TRL_KEYS = (
    "per_device_train_batch_size",
    "num_generations",
    "generation_batch_size",
    "steps_per_generation",
    "num_iterations",
    "gradient_accumulation_steps",
    "max_completion_length",
    "max_prompt_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "learning_rate",
    "lr_scheduler_type",
    "optim",
    "weight_decay",
    "max_grad_norm",
    "beta",
    "use_bias_correction_kl",
    "epsilon",
    "epsilon_high",
    "loss_type",
    "scale_rewards",
    "importance_sampling_level",
    "mask_truncated_completions",
    "gradient_checkpointing",
    "bf16",
    "fp16",
    "use_vllm",
    "use_transformers_paged",
    "use_transformers_continuous_batching",
    "cache_implementation",
    "disable_dropout",
    "shuffle_dataset",
)


def run_trl(job: Job) -> RunResult:
    import datasets
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PrinterCallback,
        TrainerCallback,
    )
    from trl import GRPOTrainer

    from rlctl.engine.reward.builtin import echo_reward

    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if job.device == "cuda" else (lambda: None)  # a clock read sees the work done

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin = 0.0
            self.step_s: dict[int, float] = {}
            self.logs: dict[int, dict] = {}
            self.threads = 0

        def on_step_begin(self, args, state, control, **kw):
            self.threads = torch.get_num_threads()
            sync()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.step_s[state.global_step] = time.perf_counter() - self.begin

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.logs[state.global_step] = dict(logs)

    t0 = time.perf_counter()
    rows = [json.loads(line) for line in Path(job.data).read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_list(rows)
    model = AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(job.model_dir)
    tok.padding_side = "left"
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=echo_reward,
        args=trl_config(job),
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log dict to stdout

    # Phase timers: wrap two methods of this trainer instance (one perf_counter pair each per step).
    phases: dict[str, dict[int, float]] = {"gen": {}, "prepare": {}}

    def timed(name, inner):
        def wrapper(*a, **k):
            sync()
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                sync()
                step = trainer.state.global_step + 1
                phases[name][step] = phases[name].get(step, 0.0) + time.perf_counter() - start

        return wrapper

    # The update's real and computed token positions per step (prompts and completions padded to each
    # micro-batch's longest), summed on the device and read once after the run
    counted: dict[int, list] = {}
    compute_loss = trainer._compute_loss

    def counted_loss(model, inputs):
        masks = (inputs["prompt_mask"], inputs["completion_mask"])
        real = masks[0].sum() + masks[1].sum()
        entry = counted.setdefault(trainer.state.global_step + 1, [0, 0])
        entry[0], entry[1] = entry[0] + real, entry[1] + sum(m.numel() for m in masks)
        return compute_loss(model, inputs)

    trainer._compute_loss = counted_loss
    trainer._generate = timed("gen", trainer._generate)
    trainer._generate_and_score_completions = timed("prepare", trainer._generate_and_score_completions)
    describe = None
    if job.describe:
        a = trainer.args
        describe = {k: str(getattr(a, k)) for k in TRL_KEYS if hasattr(a, k)}
        describe["accelerate distributed_type"] = str(trainer.accelerator.distributed_type)
        describe["model wrapper"] = type(trainer.model_wrapped).__name__
        describe["reference model"] = str(trainer.ref_model is not None)
        describe["model dtype / attn"] = f"{trainer.model.dtype} / {trainer.model.config._attn_implementation}"
    trainer.train()
    wall = time.perf_counter() - t0
    if describe is not None:
        describe["optimizer"] = type(
            trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        ).__name__
        describe["model wrapper after prepare"] = type(trainer.model_wrapped).__name__
    steps = sorted(timer.step_s)
    if steps != list(range(1, job.steps + 1)) or sorted(timer.logs) != steps:
        raise RuntimeError(f"TRL timed steps {steps} and logged {sorted(timer.logs)}; expected 1..{job.steps}")
    batch = job.prompts_per_step * job.group
    mean_len = [float(timer.logs[s]["completions/mean_length"]) for s in steps]
    real = {s: float(counted[s][0]) for s in steps}
    nan = float("nan")
    return RunResult(
        side="TRL",
        step_s=[timer.step_s[s] for s in steps],
        tokens=[m * batch for m in mean_len],
        mean_len=mean_len,
        gen_s=[phases["gen"].get(s, nan) for s in steps],
        ref_s=[phases["prepare"].get(s, nan) - phases["gen"].get(s, nan) for s in steps],
        padding=[1.0 - real[s] / counted[s][1] for s in steps],
        max_len=[float(timer.logs[s]["completions/max_length"]) for s in steps],
        wall_s=wall,
        threads=timer.threads,
        describe=describe,
        update_tokens=[real[s] for s in steps],
    )


def worker(side: str) -> None:
    """Serve jobs: one JSON line in on stdin, one JSON line out on the original stdout. Everything the
    libraries print goes to stderr."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if side == "trl":
        import datasets

        datasets.disable_progress_bars()
    run = run_rlctl if side == "rlctl" else run_trl
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            result = measured(run, Job(**json.loads(line)))
            out = {"ok": True, "result": dataclasses.asdict(result)}
        except Exception:  # noqa: BLE001 - reported to the parent, which stops the benchmark
            out = {"ok": False, "error": traceback.format_exc()}
        reply.write(json.dumps(out) + "\n")
        reply.flush()


def measured(run, job: Job) -> RunResult:
    """``run(job)`` with this process's peak GPU memory over it (reset at its start), and then everything
    it left freed, so that the other side's runs find the GPU as this one found it."""
    import gc

    import torch

    cuda = job.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        result = run(job)
    finally:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        result.peak_memory = torch.cuda.max_memory_allocated()
        result.memory_after = torch.cuda.memory_reserved()
    return result


SCRIPT = Path(__file__).resolve().parents[1] / "grpo_vs_trl.py"  # a worker runs the script with --worker


class Worker:
    def __init__(self, side: str, device: str = "cpu"):
        self.side = side
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": device}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--worker", side],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def run(self, job: Job, timeout: float | None = None, fatal: bool = True) -> RunResult:
        """The job's result; past ``timeout`` seconds the worker is killed and Overrun raised. A run that
        fails stops the benchmark, or with ``fatal`` False raises RunFailed (its error's last line)."""
        self.proc.stdin.write(json.dumps(dataclasses.asdict(job)) + "\n")
        self.proc.stdin.flush()
        if timeout is not None and not select.select([self.proc.stdout], [], [], max(0.0, timeout))[0]:
            self.proc.kill()
            self.proc.wait()
            raise Overrun(f"the {self.side} worker's run passed the budget's deadline and was killed")
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.side} worker died (exit {self.proc.wait()}); see its stderr above")
        out = json.loads(line)
        if not out["ok"]:
            log(f"{self.side} failed:\n{out['error']}")
            if not fatal:
                raise RunFailed(out["error"].strip().splitlines()[-1])
            raise SystemExit(1)
        return RunResult(**out["result"])

    def close(self, timeout: float = 60) -> None:
        """Let the worker exit, or kill it after ``timeout`` seconds."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Overrun(Exception):
    """A run did not end by the budget's deadline."""


class RunFailed(Exception):
    """A run that may fail (a side the installed versions may not allow) failed; the message says why."""
