"""rlctl against TRL's GRPOTrainer on identical GRPO work, measured in one run on the same machine.

    .venv/bin/python benchmarks/grpo_vs_trl.py [--quick] [--steps 15] [--big-steps 6] [--rounds 2]
                                              [--models tiny,25M,var] [--kl no,k3] [--dtype fp32,bf16]
                                              [--max-tokens 1024] [--var-steps 4] [--one-step-off]
                                              [--json FILE]

    python3 benchmarks/grpo_vs_trl.py --device cuda [--budget 480] [--shapes small,realistic]
                                      [--sides rlctl,TRL,TRL-cb] [--rounds 2] [--json FILE]
    .venv/bin/python benchmarks/grpo_vs_trl.py --device cpu --tiny     # its dry run (the test suite's)

Needs `pip install trl accelerate datasets` in the venv (they are not rlctl dependencies). This is a
benchmark, not a test: it prints numbers and asserts nothing about them.

On one GPU (`--device cuda`; docs/performance.md gives the device machine's command, with the wheels of
`make gpu-wheels`). The same identical work, on the GPU check's model: a Qwen2-shaped model of
Qwen2.5-0.5B-Instruct's sizes with seeded random weights and a byte-level BPE tokenizer trained on the
spot (benchmarks/qwen2_random.py, built on the device, saved once for every side), bf16 on both sides as
in the bf16 rows above (TRL: bf16=True over an fp32 module; rlctl: model.dtype bf16). Two shapes, 1 PPO
epoch, no KL: `small`, the GPU check's (8 prompts x 4 samples, 48 new tokens, the echo task's prompts,
the whole batch per update), and `realistic` (64 prompts x 4 = 256 sequences, 512 new tokens after
prompts of ~512 tokens of the tokenizer's own words, updated in micro-batches of 16 sequences with one
optimizer step: rlctl's actor.micro_batch_size, TRL's per_device_train_batch_size 16 with 16 gradient
accumulation steps and steps_per_generation 16, so one generation of the 256). The random model almost
never samples eos at a vocabulary of 151936, so completions run to the cap on every side. Sides,
alternating in each round: rlctl (its HF rollout), TRL (HF `generate`, use_vllm False) and TRL-cb (TRL's
use_transformers_continuous_batching, transformers' `generate_batch`; n/a with its error where this TRL or
transformers has none; it casts the model to bf16 for generation and keeps it so); `--sides` adds
rlctl-off (rollout.mode one_step_off). Per side: s/step, its split into generation, update and other
(scoring, advantages), tokens/s, peak GPU memory (torch.cuda.max_memory_allocated in the side's worker,
reset at each run's start; the worker frees its cache after each run), and the update's model TFLOP/s
and MFU against the GPU's datasheet bf16 peak: 6 FLOPs per matmul weight per real prompt and completion
token, the LM head over completion tokens only. The CPU has no GPU memory and no bf16 peak: n/a. Both
sides' phase clocks wait for the device (torch.cuda.synchronize) before they are read.

The budget (`--budget`, seconds from the start, the model's build included): the shapes share what is
left by weight (small 1, realistic 3). A side's first run of a shape is the fewest steps (warm-up + 1),
which measures its set-up and step times; each later run gets as many steps as its share of the time
left holds (at most the shape's), and when not even the fewest fit, the rounds end there (noted). A run
still going near the deadline is killed and the benchmark reports what it has. `--tiny` runs the same
code on the GPU check's tiny model and shapes.

How it runs. For each model and KL setting, rlctl (through its library API, `rlctl.run.start_run`, which
is what `rlctl start` calls) and TRL (`trl.GRPOTrainer.train()`) each run N GRPO steps from the same
initial weights, alternating rlctl, TRL, rlctl, TRL ... (`--rounds` runs of each), so that machine noise
lands on both. Each side lives in its own long-lived worker process (this file with `--worker rlctl` or
`--worker trl`), started once and warmed up by one short untimed run; the parent then sends it one job
per run and waits, so only one side computes at a time. Two processes, because rlctl's runtime sets
RANK/LOCAL_RANK/WORLD_SIZE and a gloo process group for its world of one, and with those in its process
accelerate takes TRL for a multi-process CPU job and wraps the model in DDP (find_unused_parameters),
which a single TRL process never does. Every run gets a fresh run directory / a fresh Trainer. Per side
the table gives the median step time over the steps after the warm-up, pooled over the rounds, and the
median of per-step generated tokens per second (tokens of each completion up to and including its eos).
The random-weight models stop early at eos now and then, on either side and differently, so tokens/s
is the figure to compare; the mean completion lengths of both sides are printed next to it.

Identical on both sides:

- model weights and tokenizer: one Hugging Face directory written with rlctl's own pieces (its
  character tokenizer; (a) its built-in tiny Llama, `build_tiny_model(RunConfig().model.builtin, ...)`,
  0.14M parameters; (b) a Llama of hidden 512, 8 layers, MLP 1408, head_dim 64, 25.8M parameters, where
  compute dominates), loaded in fp32 with `from_pretrained` (same attention implementation, sdpa);
- prompts: rlctl's built-in echo task (`make_prompts`), one JSONL file, read as `data.path` by rlctl and
  as a `datasets.Dataset` of the same rows by TRL, shuffled by both; `echo_reward` is the reward of both
  (`target` arrives as a keyword on both);
- per step 8 prompts x 4 samples (TRL: per_device_train_batch_size 32 completions, num_generations 4,
  one generation per optimizer step: steps_per_generation 1, num_iterations 1), at most 16 (tiny) or
  32 (25M) new tokens, stopping at eos; sampling at temperature 1.0 with no top-k and no top-p;
- one optimizer step per rollout batch over the whole batch (no micro-batches), AdamW
  (`torch.optim.AdamW`, betas 0.9/0.999, eps 1e-8, no weight decay) at a constant lr of 1e-5, grad-norm
  clip 1.0; the PPO-clip surrogate (epsilon 0.2) on group-normalised advantages, token-mean over the
  batch (TRL's default loss_type "dapo" is exactly that);
- no KL (TRL's default beta 0, rlctl's kl_coef 0: neither loads a reference model), then KL with the k3
  estimator at beta = rlctl's algorithm.kl_coef (`--kl-coef`, 0.04): both then hold a frozen reference
  model and run one extra no-grad forward of it per step;
- one process computing, one intra-op thread (`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`), CPU;
- precision (`--dtype`): fp32 on both sides by default; bf16 runs rlctl with `model.dtype=bf16` and TRL
  with `bf16=True` (TRL's own default). Both then multiply in bf16 and keep fp32 master weights and
  AdamW states, each in its own way: rlctl holds the module in bf16 inside DeepSpeed's bf16 stage-0
  wrapper, TRL keeps an fp32 module under accelerate's bf16 autocast.

Two workloads. Identical work (models tiny and 25M): both sides do the same thing, every micro-batch the
whole batch. Variable lengths (var): the 25M model with 128 new tokens. Its random weights end a
sequence at each token with a probability of about 1/52 (its vocabulary), so the completions spread
from a few tokens to the 128-token cap (the longest of each step is printed; most steps have one at
the cap). TRL pads every completion of the batch to the longest, in generation (`generate` computes
every row until the last ends) and in the update; rlctl drops finished rows from its decode batch and
runs the update with dynamic batching (`actor.max_tokens_per_micro_batch`, `--max-tokens`, 1024 by
default): sequences sorted by length and cut into micro-batches of at most that many padded tokens.
The table prints each side's update padding: the share of the token positions its update computed
that were padding (rlctl's `perf/update_padding_frac`; for TRL, its prompt and completion masks in
`_compute_loss`). The var workload runs in the first `--dtype` and `--kl` only.

Targets. After the table the script prints every throughput target of the project against this run's
figures: rlctl/TRL tokens/s >= 1.0 on identical work in every row, rlctl at >= 60% of the matmul peak at
25M fp32 without KL, and rlctl/TRL >= 1.3 on variable lengths. With `--one-step-off`, the 25M rows also
run rlctl with `rollout.mode: one_step_off` (a third side, alternating with the other two, in the rlctl
worker), and the targets add one_step_off/sync rlctl >= 1.25 and one_step_off/TRL >= 1.2 in tokens/s.

The arithmetic floor. Before the runs, the parent measures the best matmul rate one thread reaches here
(`F.linear` over the projection shapes of the 25M model, at a batch of 1024 tokens and at a decode step's
32) in each precision. A step's work is then counted from below: 2 FLOPs per matmul weight per real token
forward, 4 more backward, over the real prompt and completion tokens only (no padding), for generation,
the update and (with KL) the reference forward; attention scores, norms, sampling and the optimizer are
left out. That work at the peak rate is less time than any implementation could take, so TRL's s/step
over TRL's floor bounds the ratio any implementation could reach on TRL's work on this core.

What a step is:

- rlctl: `timing_s/step` from RUN_DIR/metrics.jsonl: draw prompts, generate (rlctl's batched decode
  loop with a KV cache on the actor's own module, one forward per token), decode, score, reference log-probs (with KL), advantages, then the
  update: one forward with grad (which also gives the old log-probs: the step is exactly on-policy, so
  there is no separate old-log-prob pass), backward, grad clip and AdamW step inside DeepSpeed
  (world of one, gloo: the configured ZeRO-2 trains at stage 0 there, without partitioning). Writing the
  metrics row is not in it.
- TRL: wall time from `on_step_begin` to `on_step_end` of a `TrainerCallback`: `Trainer.training_step`
  (`_prepare_inputs` -> `_generate_and_score_completions`: tokenize, HF `generate`, decode, reward,
  reference log-probs with KL, advantages; then `compute_loss`: one forward with grad, which likewise
  gives the old log-probs since num_iterations is 1, and backward), then grad clip, optimizer and lr
  scheduler steps and zero_grad. Fetching the batch from the dataloader and logging are not in it.
- Phases (printed per configuration): "gen" is rlctl's `timing_s/gen` (generate + decode + score) and
  TRL's time in `GRPOTrainer._generate` (tokenize + generate + decode); "ref" is rlctl's `timing_s/ref`
  and TRL's time in `_generate_and_score_completions` outside `_generate` (reward, reference forward,
  advantages); "update" is the rest of the step.

What differs, by design of each tool:

- rlctl trains inside a DeepSpeed engine (actor.zero_stage 2, which a world of one trains at stage 0:
  the torch AdamW unpartitioned); TRL here runs plain PyTorch through accelerate (no DeepSpeed, no DDP),
  its default for one process;
- rlctl samples with a per-sequence seeded Gumbel-max logits processor (reproducible per sequence);
  TRL uses transformers' multinomial sampling from the global generator. Same distribution, different
  draws, so the completions and their lengths differ;
- TRL 1.x defaults to gradient checkpointing (an extra forward inside backward), bf16 and a
  linear-decay lr schedule; this benchmark turns them off (`gradient_checkpointing=False`, `bf16=False`
  unless `--dtype bf16`, `lr_scheduler_type="constant"`) because rlctl does none of them. `--trl-gradient-checkpointing` puts
  TRL's default checkpointing back. TRL's default optimizer "adamw_torch_fused" is kept: the same
  `torch.optim.AdamW(fused=True)` that rlctl hands to DeepSpeed;
- small terms inside the loss: rlctl has verl's dual clip (c = 3) and clamps k3; TRL multiplies the k3
  term by the importance ratio (use_bias_correction_kl; exactly 1 on-policy); TRL divides rewards by the
  group std + 1e-4, rlctl by std + 1e-6.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in the workers
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed probes for one and warns

import argparse
import dataclasses
import importlib.metadata as md
import json
import platform
import select
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

PROMPTS_PER_STEP = 8
GROUP = 4
LR = 1e-5
SEED = 0
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Job:
    model_dir: str
    data: str  # the JSONL prompts file (both sides read it)
    max_new_tokens: int
    steps: int
    kl_coef: float
    out: str  # a fresh run directory (rlctl) / output_dir (TRL)
    grad_ckpt: bool = False  # TRL only
    describe: bool = False  # TRL only: return the settings the trainer ended up with
    dtype: str = "fp32"  # fp32, or bf16: rlctl model.dtype=bf16, TRL bf16=True (its default)
    max_tokens: int | None = None  # rlctl only: actor.max_tokens_per_micro_batch (dynamic batching)
    mode: str = "sync"  # rlctl only: rollout.mode (--one-step-off adds one_step_off runs)
    device: str = "cpu"  # cpu, or cuda (--device cuda: the model of the GPU check, bf16)
    prompts_per_step: int = PROMPTS_PER_STEP
    group: int = GROUP
    max_prompt_length: int = 64  # rlctl's data.max_prompt_length (TRL 1.x truncates no prompt)
    micro_batch: int | None = None  # sequences per forward/backward of the update (None: the whole batch)
    continuous_batching: bool = False  # TRL only: use_transformers_continuous_batching
    cb_config: dict | None = None  # TRL only: its transformers_continuous_batching_config (None: TRL's sizing)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One workload of --device: the batch, the lengths and the update's micro-batches."""

    name: str
    prompts: int  # per step
    group: int  # samples per prompt
    new_tokens: int
    prompt_tokens: int | None  # about this many tokens per prompt (random words); None: the echo task's prompts
    micro_batch: int | None  # sequences per micro-batch of the update (None: the whole batch)
    steps: int  # per run at most (the budget may take fewer)
    warmup: int  # leading steps of each run left out


@dataclasses.dataclass
class RunResult:
    side: str
    step_s: list[float]  # per step, all steps
    tokens: list[float]  # generated tokens per step (completions up to and including eos)
    mean_len: list[float]  # mean completion length per step
    gen_s: list[float]  # generation seconds per step
    ref_s: list[float]  # scoring + reference forward (+ advantages) per step, outside generation
    padding: list[float]  # per step, the share of the token positions the update computed that were padding
    max_len: list[float]  # longest completion per step
    wall_s: float  # the whole run, setup included
    threads: int  # torch intra-op threads seen during the run
    describe: dict | None = None
    update_tokens: list[float] | None = None  # real (unpadded) prompt + completion tokens the update trained on
    peak_memory: int | None = None  # torch.cuda.max_memory_allocated over the run, reset at its start (CUDA)
    memory_after: int | None = None  # torch.cuda.memory_reserved once the run is freed (CUDA)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the shared inputs (parent) ---------------------------------------------------------------------
def build_model_dir(key: str, out: Path) -> int:
    """Write model + tokenizer with rlctl's own pieces; returns the parameter count."""
    from rlctl.config import RunConfig
    from rlctl.engine.model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    if key == "tiny":
        model = build_tiny_model(RunConfig().model.builtin, tok, SEED)
    else:
        model = llama(tok, hidden=512, layers=8, mlp=1408, heads=8)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def llama(tok, hidden: int, layers: int, mlp: int, heads: int):
    """A Llama of these sizes for the tokenizer ``tok`` (head_dim hidden / heads, untied embeddings),
    initialised from SEED without touching the caller's RNG."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return LlamaForCausalLM(cfg)


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


class Worker:
    def __init__(self, side: str, device: str = "cpu"):
        self.side = side
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": device}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", side],
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


# -- summary (parent) -------------------------------------------------------------------------------
def summarize(results: list[RunResult], warmup: int) -> dict:
    def pooled(attr: str) -> list[float]:
        return [x for r in results for x in getattr(r, attr)[warmup:]]

    step_s = pooled("step_s")
    tok_s = [t / s for r in results for t, s in zip(r.tokens[warmup:], r.step_s[warmup:])]
    gen, ref = statistics.median(pooled("gen_s")), statistics.median(pooled("ref_s"))
    return {
        "s_per_step": statistics.median(step_s),
        "tok_per_s": statistics.median(tok_s),
        "mean_len": statistics.fmean(pooled("mean_len")),
        "gen_s": gen,
        "ref_s": ref,
        "update_s": statistics.median([s - g - f for s, g, f in zip(step_s, pooled("gen_s"), pooled("ref_s"))]),
        "padding": statistics.fmean(pooled("padding")),
        "max_len": max(pooled("max_len")),
        "run_medians": [statistics.median(r.step_s[warmup:]) for r in results],
        "wall_s": [round(r.wall_s, 1) for r in results],
        "threads": sorted({r.threads for r in results}),
        "n_steps": len(step_s),
    }


def matmul_params(model_dir: str) -> int:
    """Weights that take part in a matrix multiply per token (every nn.Linear, the LM head included; not
    the embedding, which is a lookup)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def gemm_peak(dtype_name: str, hidden: int = 512, mlp: int = 1408) -> tuple[float, str]:
    """The best matmul rate one thread of this machine reaches, in FLOP/s, over the shapes a step of the
    25M model runs (a whole batch of tokens and a decode step's 32, through the attention and MLP
    projections, as F.linear does them). Measured here, in this run."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    best, where = 0.0, ""
    for m in (32, 1024):
        for k, n in ((hidden, hidden), (hidden, mlp), (mlp, hidden)):
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            reps = max(3, int(2e9 / (2 * m * k * n)))
            for _ in range(3):
                F.linear(x, w)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    F.linear(x, w)
                times.append((time.perf_counter() - t) / reps)
            rate = 2 * m * k * n / min(times)
            if rate > best:
                best, where = rate, f"{m}x{k} @ {k}x{n}"
    return best, where


def step_flops(n_mm: int, prompt_tokens: float, completion_len: float, kl: bool) -> float:
    """A lower bound on one step's arithmetic: matmul FLOPs over real tokens only (no padding), 2 per
    weight per token forward and 4 more backward; generation (one forward per token), the update
    (forward + backward) and, with KL, the reference forward. Attention scores and everything else are
    left out, so a step can never take less than this over the peak rate."""
    tokens = PROMPTS_PER_STEP * GROUP * (prompt_tokens + completion_len)
    return n_mm * tokens * (2 + 6 + (2 if kl else 0))


def print_targets(table: list, peaks: dict, offs: dict) -> None:
    """Each ratio of the throughput targets against its target, from this run's table (``offs``: the
    one_step_off runs' summaries by (model, dtype, kl))."""
    print("targets, from this run:")
    for label, dtype, kl, r, t in table:
        ratio = r["tok_per_s"] / t["tok_per_s"]
        name = label.split()[0]
        want = 1.3 if name == "var" else 1.0
        what = "variable lengths" if name == "var" else "identical work"
        print(
            f"  {what:16s} {name:5s} {dtype:5s} kl={kl:3s} rlctl/TRL tok/s {ratio:5.2f}  target >= {want:.2f}: "
            f"{'met' if ratio >= want else 'NOT met'}"
            + (
                f" (longest completion {r['max_len']:.0f} / {t['max_len']:.0f}; padding {r['padding']:.0%} / "
                f"{t['padding']:.0%})"
                if name == "var"
                else ""
            )
        )
        if name == "25M" and dtype == "fp32" and kl == "no":
            at = r["flops"] / r["s_per_step"] / peaks[dtype][0]
            print(
                f"  {'matmul peak':16s} 25M   fp32  kl=no  rlctl at {at:6.1%}  target >= 60%: {'met' if at >= 0.6 else 'NOT met'}"
            )
    for (name, dtype, kl), o in offs.items():
        r, t = next((r, t) for lb, d, k, r, t in table if (lb.split()[0], d, k) == (name, dtype, kl))
        for than, base, want in (("sync rlctl", r, 1.25), ("TRL", t, 1.2)):
            ratio = o["tok_per_s"] / base["tok_per_s"]
            print(
                f"  {'one_step_off':16s} {name:5s} {dtype:5s} kl={kl:3s} one_step_off/{than} tok/s {ratio:5.2f}  "
                f"target >= {want:.2f}: {'met' if ratio >= want else 'NOT met'} ({o['s_per_step']:.4f} s/step)"
            )
    if not offs:
        print("  one_step_off     not run (--one-step-off runs it on the 25M model)")


# -- --device: the GPU check's model on one device, two shapes (parent) -------------------------------------
T0 = time.monotonic()  # the budget counts from the script's start
# The GPU check's small shape (benchmarks/gpu_check.py, Size.small: 8 prompts x 4, 48 new tokens, 1 epoch, the
# echo task's prompts) and a realistic one: 256 sequences x 512 new tokens after ~512-token prompts, 1 epoch,
# updated in micro-batches of 16 sequences. --tiny: the same code on the GPU check's tiny model, in seconds.
SHAPES = {
    "small": Shape("small", 8, 4, 48, None, None, steps=6, warmup=1),
    "realistic": Shape("realistic", 64, 4, 512, 512, 16, steps=4, warmup=1),
}
TINY_SHAPES = {
    "small": Shape("small", 4, 4, 8, None, None, steps=3, warmup=1),
    "realistic": Shape("realistic", 4, 4, 16, 32, 8, steps=3, warmup=1),
}
SHAPE_WEIGHT = {"small": 1, "realistic": 3}  # shares of the budget left when a shape starts
SIDES = {  # side: (worker, rlctl's rollout.mode / TRL's continuous batching)
    "rlctl": ("rlctl", "sync"),
    "TRL": ("trl", False),
    "TRL-cb": ("trl", True),
    "rlctl-off": ("rlctl", "one_step_off"),
}
RESERVE_S = 15  # the budget's end kept for the report and the workers' exit
# --tiny: continuous batching's KV cache sized for the tiny shapes; by default it takes half the device's
# free memory (TRL's max_memory_percent), which on a CPU is the host's and far more than a dry run needs
TINY_CB = {"num_blocks": 16, "max_batch_tokens": 512}


@dataclasses.dataclass
class ShapeRuns:
    """One shape's runs by side, and why any round or side was left out."""

    shape: Shape
    runs: dict[str, list[RunResult]]
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # side: the error that ended it
    notes: list[str] = dataclasses.field(default_factory=list)
    rounds: int = 0  # rounds every side that had not failed ran
    stopped: bool = False  # a run passed the budget's deadline and was killed: no further shape runs


def device_prompts(shape: Shape, tok, n: int) -> list[dict]:
    """The shape's prompt rows: the echo task's (``prompt_tokens`` None), or random words of the tokenizer's
    corpus up to about ``prompt_tokens`` tokens (uniform within +-6%), each row's target its first word."""
    import random

    from qwen2_random import corpus_words

    from rlctl.engine.reward.builtin import make_prompts

    if shape.prompt_tokens is None:
        return make_prompts(n, SEED)
    words = corpus_words(2000)
    cost = {w: len(tok(" " + w, add_special_tokens=False)["input_ids"]) for w in words}
    rng, rows = random.Random(SEED), []
    for _ in range(n):
        want = rng.randint(int(shape.prompt_tokens * 0.94), int(shape.prompt_tokens * 1.06))
        picked, used = [], 0
        while used + cost[w := rng.choice(words)] <= want:
            picked.append(w)
            used += cost[w]
        rows.append({"prompt": " ".join(picked), "target": picked[0]})
    return rows


def plan_steps(shape: Shape, seen: RunResult | None, left: float, runs_left: int) -> int | None:
    """Steps of a side's next run: the fewest (warm-up + 1) for its first run of the shape, which measures
    its set-up and step times; then as many as this run's share of the time ``left`` holds, at most
    ``shape.steps``. None when not even the fewest fit in ``left``: the rounds end there."""
    least = shape.warmup + 1
    if seen is None:
        return least
    step = statistics.median(seen.step_s)
    setup = max(0.0, seen.wall_s - sum(seen.step_s))
    if setup + least * step > left:
        return None
    return max(least, min(shape.steps, int((left / runs_left - setup) / step)))


def run_shape(
    shape: Shape, sides: list[str], workers: dict, base: dict, until: float, deadline: float, rounds: int
) -> ShapeRuns:
    """Alternate the sides' runs of ``shape`` for ``rounds`` rounds, each sized to end by ``until``; a run
    still going at ``deadline`` (less half the reserve) is killed, and the benchmark stops there."""
    out = ShapeRuns(shape, {side: [] for side in sides})
    for r in range(rounds):
        for i, side in enumerate(sides):
            if side in out.failed:
                continue
            left = until - time.monotonic()
            seen = out.runs[side][-1] if out.runs[side] else None
            steps = plan_steps(shape, seen, left, (rounds - r) * len(sides) - i)
            if steps is None:
                out.notes.append(f"round {r + 1} and later cut by the budget ({left:.0f} s left at {side})")
                return out
            which, knob = SIDES[side]
            job = Job(
                **{**base, "out": f"{base['out']}-{side}-{r + 1}"},
                steps=steps,
                mode=knob if which == "rlctl" else "sync",
                continuous_batching=knob if which == "trl" else False,
            )
            try:
                timeout = deadline - RESERVE_S / 2 - time.monotonic()
                res = workers[which].run(job, timeout=timeout, fatal=which == "rlctl" and knob == "sync")
            except RunFailed as exc:
                out.failed[side] = str(exc)
                continue
            except Overrun as exc:
                out.notes.append(f"round {r + 1}, {side}: {exc}; the benchmark stopped there")
                out.stopped = True
                return out
            out.runs[side].append(res)
            log(
                f"[{shape.name} round {r + 1}] {side:9s}: {steps} steps, median "
                f"{statistics.median(res.step_s[shape.warmup :]):.3f} s/step, run {res.wall_s:.1f} s"
            )
        out.rounds = r + 1
    return out


def side_summary(results: list[RunResult], warmup: int, facts: dict, peak: float | None) -> dict:
    """summarize()'s figures, with peak GPU memory (GiB, the highest of the runs; None on the CPU), the
    update's model TFLOP/s and its share of the bf16 peak (None where no peak is known: the CPU). The
    update's FLOPs: 6 per matmul weight per real prompt and completion token (forward and backward), the
    LM head over completion tokens only (both sides compute logits there alone); attention's score and
    value products and padding left out, so both sides are credited the same work."""
    summ = summarize(results, warmup)
    body, head = facts["matmul_params"] - facts["head_params"], facts["head_params"]
    rates = []
    for r in results:
        for s, g, f, tok, upd in list(zip(r.step_s, r.gen_s, r.ref_s, r.tokens, r.update_tokens))[warmup:]:
            rates.append(6 * (body * upd + head * tok) / max(1e-9, s - g - f) / 1e12)
    memory = [r.peak_memory for r in results if r.peak_memory is not None]
    summ["peak_memory_gib"] = round(max(memory) / GIB, 2) if memory else None
    summ["memory_after_gib"] = [None if r.memory_after is None else round(r.memory_after / GIB, 2) for r in results]
    summ["update_tflops"] = statistics.median(rates)
    summ["update_mfu"] = round(summ["update_tflops"] / peak, 4) if peak else None
    return summ


def shape_report(sr: ShapeRuns, facts: dict, peak: float | None) -> dict:
    """The shape's per-side summaries (sides with a measured step), ratios against TRL's and what was cut."""
    w = sr.shape.warmup
    sides = {side: side_summary(rs, w, facts, peak) for side, rs in sr.runs.items() if rs}
    ratios = {}
    for side in [s for s in sides if s != "TRL"]:
        for base in [b for b in ("TRL", "TRL-cb") if b in sides and b != side]:
            ratios[f"{side}/{base} tok/s"] = round(sides[side]["tok_per_s"] / sides[base]["tok_per_s"], 3)
            m, mb = sides[side]["peak_memory_gib"], sides[base]["peak_memory_gib"]
            ratios[f"{side}/{base} peak memory"] = round(m / mb, 3) if m and mb else None
    return {
        "shape": dataclasses.asdict(sr.shape),
        "rounds": sr.rounds,
        "sides": sides,
        "ratios": ratios,
        "failed": sr.failed,
        "notes": sr.notes,
    }


def na(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def print_shape(report: dict) -> None:
    shape = report["shape"]
    print(
        f"\n{shape['name']}: {shape['prompts']} prompts x {shape['group']} samples, {shape['new_tokens']} new "
        f"tokens, prompts of {report['prompt_tokens']:.0f} tokens on average, update micro-batch "
        f"{shape['micro_batch'] or 'the whole batch'}, 1 epoch; {report['rounds']} round(s)"
    )
    head = (
        f"  {'side':9s} {'s/step':>8s} {'gen s':>8s} {'update s':>8s} {'other s':>8s} {'tok/s':>9s} "
        f"{'mean len':>8s} {'peak GiB':>8s} {'upd TFLOP/s':>11s} {'upd MFU':>7s}"
    )
    print(head)
    for side, s in report["sides"].items():
        print(
            f"  {side:9s} {s['s_per_step']:8.3f} {s['gen_s']:8.3f} {s['update_s']:8.3f} {s['ref_s']:8.3f} "
            f"{s['tok_per_s']:9.0f} {s['mean_len']:8.1f} {na(s['peak_memory_gib'], '8.2f'):>8s} "
            f"{s['update_tflops']:11.3f} {na(s['update_mfu'], '7.1%'):>7s}"
        )
    for key, value in report["ratios"].items():
        print(f"  {key}: {na(value, '.2f')}")
    for side, why in report["failed"].items():
        print(f"  {side}: n/a, its run failed: {why}")
    for note in report["notes"]:
        print(f"  note: {note}")


def device_setup(args, work: Path) -> tuple[dict, dict]:
    """Write the model directory and each shape's prompts; (the model's facts, each shape's job fields)."""
    from qwen2_random import QWEN_05B, TINY_MODEL, write_model_dir
    from transformers import AutoTokenizer

    model_dir = work / "qwen2-random"
    shape_of, vocab, words = (TINY_MODEL, 500, 2000) if args.tiny else (QWEN_05B, 151643, 150000)
    t = time.monotonic()
    facts = write_model_dir(model_dir, shape_of, vocab=vocab, words=words, device=args.device)
    facts["build_s"] = round(time.monotonic() - t, 1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    bases = {}
    for name, shape in (TINY_SHAPES if args.tiny else SHAPES).items():
        rows = device_prompts(shape, tok, max(256, 2 * shape.prompts * shape.steps))
        data = work / f"prompts-{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        lengths = [len(ids) for ids in tok([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]]
        bases[name] = dict(
            model_dir=str(model_dir),
            data=str(data),
            max_new_tokens=shape.new_tokens,
            kl_coef=0.0,
            dtype="bf16",
            device=args.device,
            prompts_per_step=shape.prompts,
            group=shape.group,
            max_prompt_length=max(lengths),
            micro_batch=shape.micro_batch,
            cb_config=TINY_CB if args.tiny else None,
        )
        facts[f"prompt_tokens/{name}"] = statistics.fmean(lengths)
    return facts, bases


def device_runs(args, workers: dict, work: Path, facts: dict, bases: dict, peak: float | None) -> dict:
    """Every shape's rounds, the shapes sharing the budget left by their weights; each shape's report."""
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    deadline = T0 + args.budget
    reports = {}
    try:
        for i, name in enumerate(shapes):
            left = deadline - RESERVE_S - time.monotonic()
            until = time.monotonic() + left * SHAPE_WEIGHT[name] / sum(SHAPE_WEIGHT[n] for n in shapes[i:])
            shape = (TINY_SHAPES if args.tiny else SHAPES)[name]
            base = {**bases[name], "out": str(work / f"run-{name}")}
            sr = run_shape(shape, sides, workers, base, until, deadline, args.rounds or 2)
            reports[name] = shape_report(sr, facts, peak) | {"prompt_tokens": facts[f"prompt_tokens/{name}"]}
            if sr.stopped:
                break
    finally:
        for w in workers.values():  # past the deadline less the reserve, a worker still busy is killed
            w.close(timeout=max(1.0, deadline - RESERVE_S / 2 - time.monotonic()))
    return reports


def main_device(args) -> None:
    """--device: rlctl, TRL and TRL's continuous batching on the GPU check's model, two shapes, one budget."""
    import torch
    import transformers

    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    gpu = torch.cuda.get_device_name() if cuda else None
    from qwen2_random import bf16_peak

    peak = bf16_peak(gpu) if gpu else None
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"versions: python {platform.python_version()}, {versions()}")
    print(f"device: {gpu or 'cpu'} (bf16 peak {na(peak, '.0f')} TFLOP/s); budget {args.budget:.0f} s", flush=True)
    # the workers import their libraries while the model is built (device_runs closes them)
    workers = {"rlctl": Worker("rlctl", args.device), "trl": Worker("trl", args.device)}
    with tempfile.TemporaryDirectory(prefix="rlctl-vs-trl-") as tmp:
        try:
            facts, bases = device_setup(args, Path(tmp))
        except BaseException:
            for w in workers.values():
                w.close(timeout=10)
            raise
        log(f"model: {facts['params'] / 1e6:.1f}M parameters, built and saved in {facts['build_s']} s")
        reports = device_runs(args, workers, Path(tmp), facts, bases, peak)
    for report in reports.values():
        print_shape(report)
    real = reports.get("realistic", {}).get("ratios", {})
    print()
    for key, want in (("rlctl/TRL tok/s", 1.0), ("rlctl-off/TRL tok/s", 1.3)):
        got = real.get(key)
        verdict = "not run" if got is None else "met" if got >= want else "NOT met"
        print(f"target, realistic shape: {key} >= {want}: {verdict}" + ("" if got is None else f" ({got:.2f})"))
    wall = time.monotonic() - T0
    print(
        f"model: {facts['params'] / 1e6:.1f}M parameters ({facts['matmul_params'] / 1e6:.1f}M in matrix products), "
        f"bf16 on both sides (rlctl: a bf16 module in DeepSpeed's stage-0 bf16 wrapper; TRL: bf16=True, autocast "
        f"over an fp32 module). total {wall:.0f} s of the {args.budget:.0f} s budget"
    )
    if args.json:
        meta = {"command": sys.argv, "device": args.device, "gpu": gpu, "bf16_peak_tflops": peak}
        meta |= {"versions": versions(), "model": facts, "budget_s": args.budget, "wall_s": round(wall, 1)}
        Path(args.json).write_text(json.dumps(meta | {"shapes": reports}, indent=1))


def versions() -> str:
    out = []
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "deepspeed", "rlctl"):
        try:
            out.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 6 tiny / 4 big steps, warm-up 2")
    ap.add_argument("--steps", type=int, default=None, help="steps per run, tiny model (default 15)")
    ap.add_argument("--big-steps", type=int, default=None, help="steps per run, 25M model (default 6)")
    ap.add_argument("--rounds", type=int, default=None, help="runs of each side per configuration (default 2)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="leading steps of each run left out (default 3 tiny, 2 for 25M; --quick: 2)",
    )
    ap.add_argument(
        "--models",
        default="tiny,25M,var",
        help="comma list of: tiny, 25M, var (the 25M model, 128 new tokens: lengths spread from a few tokens "
        "to the cap; rlctl with actor.max_tokens_per_micro_batch; run in the first --dtype and --kl only)",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=1024, help="var: rlctl's actor.max_tokens_per_micro_batch (default 1024)"
    )
    ap.add_argument("--var-steps", type=int, default=None, help="steps per run, var workload (default 4)")
    ap.add_argument("--kl", default="no,k3", help="comma list of: no, k3")
    ap.add_argument(
        "--dtype",
        default="fp32",
        help="comma list of: fp32, bf16 (rlctl model.dtype, TRL bf16=True "
        "under accelerate's autocast; both keep fp32 master weights in the optimizer)",
    )
    ap.add_argument("--kl-coef", type=float, default=0.04, help="rlctl algorithm.kl_coef = TRL beta for k3")
    ap.add_argument("--prompts", type=int, default=256, help="rows of the echo task")
    ap.add_argument(
        "--trl-gradient-checkpointing",
        action="store_true",
        help="keep TRL's default gradient checkpointing (rlctl does not checkpoint)",
    )
    ap.add_argument(
        "--one-step-off",
        action="store_true",
        help="25M: also run rlctl with rollout.mode one_step_off, alternating with the other two sides",
    )
    ap.add_argument("--json", default=None, help="also write every per-step number to this file")
    ap.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="the GPU comparison: the GPU check's Qwen2-shaped ~0.5B random model in bf16, shapes small and "
        "realistic (--shapes), sides rlctl, TRL and TRL's continuous batching (--sides); without it, the CPU "
        "comparison above. --device cpu --tiny is its dry run",
    )
    ap.add_argument("--tiny", action="store_true", help="--device: the GPU check's tiny model and shapes")
    ap.add_argument(
        "--budget",
        type=float,
        default=480.0,
        help="--device: seconds from the start for everything; runs get fewer steps, then rounds are cut, "
        "rather than overrun it (default 480: one 600 s call with the wheels' install and 60 s to spare)",
    )
    ap.add_argument("--shapes", default="small,realistic", help="--device: comma list of: small, realistic")
    ap.add_argument(
        "--sides",
        default="rlctl,TRL,TRL-cb",
        help="--device: comma list of: rlctl, TRL, TRL-cb (TRL with use_transformers_continuous_batching; "
        "n/a where this TRL or transformers has none), rlctl-off (rlctl with rollout.mode one_step_off)",
    )
    ap.add_argument("--worker", choices=["rlctl", "trl"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.device:
        bad = [s for s in args.sides.split(",") if s.strip() not in SIDES]
        bad += [s for s in args.shapes.split(",") if s.strip() not in SHAPES]
        if bad or "rlctl" not in args.sides.split(","):
            ap.error(f"--sides must name rlctl and --sides/--shapes only known names; unknown: {bad}")
        return main_device(args)
    if args.tiny:
        ap.error("--tiny goes with --device")

    rounds = args.rounds or (1 if args.quick else 2)
    tiny_warm = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    big_warm = args.warmup if args.warmup is not None else 2
    specs = {
        "tiny": (16, args.steps or (6 if args.quick else 15), tiny_warm),
        "25M": (32, args.big_steps or (4 if args.quick else 6), big_warm),
        "var": (128, args.var_steps or (3 if args.quick else 4), args.warmup if args.warmup is not None else 1),
    }  # max new tokens, steps, warm-up
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    kls = [k.strip() for k in args.kl.split(",") if k.strip()]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [m for m in models if m not in specs] + [k for k in kls if k not in ("no", "k3")]
    if bad := bad + [d for d in dtypes if d not in ("fp32", "bf16")]:
        ap.error(f"unknown model, kl or dtype: {bad}")
    for m in models:
        if specs[m][1] <= specs[m][2]:
            ap.error(f"{m}: {specs[m][1]} steps leave nothing after a warm-up of {specs[m][2]}")

    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"versions: python {platform.python_version()}, {versions()}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs; OMP_NUM_THREADS=1 and torch.set_num_threads(1) "
        "in both workers"
    )
    print(
        f"work: {PROMPTS_PER_STEP} prompts x {GROUP} samples per step, lr {LR}, temperature 1.0; "
        + "; ".join(
            f"{m}: {specs[m][0]} new tokens, {specs[m][1]} steps per run, warm-up {specs[m][2]}" for m in models
        )
        + f"; {rounds} run(s) per side per configuration, alternating rlctl, TRL; k3 coefficient {args.kl_coef}; "
        f"TRL gradient checkpointing {'on' if args.trl_gradient_checkpointing else 'off'}; precision "
        f"{', '.join(dtypes)}",
        flush=True,
    )

    warnings.filterwarnings("ignore")
    import transformers

    from rlctl.engine.model import build_char_tokenizer
    from rlctl.engine.reward.builtin import make_prompts

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    table, raw, described, offs = [], {}, [], {}
    peaks = {d: gemm_peak(d) for d in dtypes}  # before the workers start: nothing else computes
    t_all = time.perf_counter()
    workers = {"rlctl": Worker("rlctl"), "TRL": Worker("trl")}
    try:
        with tempfile.TemporaryDirectory(prefix="rlctl-vs-trl-") as tmp:
            work = Path(tmp)
            data = work / "prompts.jsonl"
            rows = make_prompts(args.prompts, SEED)
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tok = build_char_tokenizer()
            prompt_tokens = statistics.fmean(len(tok(r["prompt"])["input_ids"]) for r in rows)
            # One short untimed run per worker first: first-in-process costs (lazy imports, DeepSpeed and
            # accelerate set-up, first calls into kernels) are then in no measured run.
            warm_dir = work / "model-warmup"
            build_model_dir("tiny", warm_dir)
            for side, w in workers.items():
                w.run(Job(str(warm_dir), str(data), 4, 2, 0.0, str(work / f"warmup-{side}")))
            n = 0
            for m in models:
                max_new, steps, warm = specs[m]
                model_dir = work / f"model-{m}"
                params = build_model_dir("25M" if m == "var" else m, model_dir)
                n_mm = matmul_params(str(model_dir))
                label = f"{m} ({params / 1e6:.2g}M)" if m == "tiny" else f"{m} ({params / 1e6:.1f}M)"
                pairs = [(d, k) for d in dtypes for k in kls]
                for dtype, kl in pairs[:1] if m == "var" else pairs:  # var: the first precision and KL only
                    coef = 0.0 if kl == "no" else args.kl_coef
                    sides = ("rlctl", "TRL", "off") if args.one_step_off and m == "25M" else ("rlctl", "TRL")
                    runs: dict[str, list[RunResult]] = {side: [] for side in sides}
                    for r in range(rounds):
                        for side in sides:
                            n += 1
                            describe = side == "TRL" and r == 0 and m == models[0]
                            job = Job(
                                str(model_dir),
                                str(data),
                                max_new,
                                steps,
                                coef,
                                str(work / f"run-{n}"),
                                args.trl_gradient_checkpointing,
                                describe,
                                dtype,
                                args.max_tokens if m == "var" else None,
                                "one_step_off" if side == "off" else "sync",
                            )
                            res = workers["rlctl" if side == "off" else side].run(job)
                            if res.describe:
                                described.append((f"{m} {dtype} kl={kl}", res.describe))
                            runs[side].append(res)
                            log(
                                f"[{m} {dtype} kl={kl} round {r + 1}] {side:5s}: median "
                                f"{statistics.median(res.step_s[warm:]):.4f} s/step, mean length "
                                f"{statistics.fmean(res.mean_len[warm:]):.1f}, run {res.wall_s:.1f} s, "
                                f"threads {res.threads}"
                            )
                    r_sum, t_sum = summarize(runs["rlctl"], warm), summarize(runs["TRL"], warm)
                    for summ in (r_sum, t_sum):  # the arithmetic floor of this side's work
                        summ["flops"] = step_flops(n_mm, prompt_tokens, summ["mean_len"], kl != "no")
                        summ["floor_s"] = summ["flops"] / peaks[dtype][0]
                    if "off" in runs:
                        offs[(m, dtype, kl)] = summarize(runs["off"], warm)
                    table.append((label, dtype, kl, r_sum, t_sum))
                    raw[f"{m}/{dtype}/{kl}"] = {side: [dataclasses.asdict(x) for x in xs] for side, xs in runs.items()}
                    label = m
    finally:
        for w in workers.values():
            w.close()
    total = time.perf_counter() - t_all

    print()
    head = (
        f"{'model':13s} {'dtype':5s} {'kl':3s} {'rlctl s/step':>12s} {'TRL s/step':>10s} {'rlctl tok/s':>11s} "
        f"{'TRL tok/s':>9s} {'ratio(tok/s)':>12s}  {'mean len rlctl/TRL':>18s}  {'padding rlctl/TRL':>17s}"
    )
    print(head)
    print("-" * len(head))
    for label, dtype, kl, r, t in table:
        print(
            f"{label:13s} {dtype:5s} {kl:3s} {r['s_per_step']:12.4f} {t['s_per_step']:10.4f} "
            f"{r['tok_per_s']:11.0f} {t['tok_per_s']:9.0f} {r['tok_per_s'] / t['tok_per_s']:12.2f}  "
            f"{r['mean_len']:10.1f} / {t['mean_len']:<5.1f}  {r['padding']:8.0%} / {t['padding']:<6.0%}"
        )
    print()
    print(
        "ratio(tok/s) = rlctl tok/s / TRL tok/s (above 1: rlctl is faster). s/step: median step time; tok/s: "
        "median of per-step generated tokens / step time; both over the steps after the warm-up, pooled over "
        "the runs. padding: the share of the token positions each side's update computed that were padding "
        "(TRL pads prompts and completions to the batch's longest; rlctl to each micro-batch's)."
    )
    print()
    print_targets(table, peaks, offs)
    print()
    print(
        "phases, median s (gen: generation; ref: scoring + reference forward + advantages; update: the rest), "
        "per-run median s/step, and run wall times including setup:"
    )
    for label, dtype, kl, r, t in table:
        for side, s in (("rlctl", r), ("TRL", t)):
            print(
                f"  {label.split()[0]:5s} {dtype:5s} {kl:3s} {side:5s} gen {s['gen_s']:.4f}  ref {s['ref_s']:.4f}  "
                f"update {s['update_s']:.4f} | runs {[round(x, 4) for x in s['run_medians']]} | "
                f"wall {s['wall_s']} s | threads {s['threads']}"
            )
    print()
    print(
        "arithmetic floor: one thread's best matmul rate, measured before the runs: "
        + "; ".join(f"{d} {rate / 1e9:.0f} GFLOP/s ({where})" for d, (rate, where) in peaks.items())
        + f". A step's matmul work over real tokens ({prompt_tokens:.2f} prompt tokens + the mean completion "
        "length per sequence; generation, update, reference) at that rate is the least time any implementation "
        "could take; TRL s/step over TRL's floor is the highest ratio any implementation could reach on TRL's "
        "work:"
    )
    for label, dtype, kl, r, t in table:
        print(
            f"  {label.split()[0]:5s} {dtype:5s} {kl:3s} {t['flops'] / 1e9:7.1f} GFLOP/step  floor "
            f"{t['floor_s']:.4f} s  rlctl at {r['flops'] / r['s_per_step'] / peaks[dtype][0]:6.1%} of peak, TRL at "
            f"{t['flops'] / t['s_per_step'] / peaks[dtype][0]:6.1%}  highest possible ratio "
            f"{t['s_per_step'] / t['floor_s']:.2f} (2x TRL needs {2 * t['floor_s'] / t['s_per_step']:.0%} of peak)"
        )
    for where, d in described:
        print(f"TRL settings as its trainer saw them ({where}):")
        print("  " + ", ".join(f"{k}={v}" for k, v in d.items()))
    print(
        "Not identical by design: rlctl trains in DeepSpeed (ZeRO-2 configured, stage 0 in a world of one), "
        "TRL in plain PyTorch via accelerate; rlctl samples with per-sequence seeded Gumbel-max, TRL with multinomial sampling (same "
        "distribution, different draws and lengths); see the module docstring."
    )
    print(f"total {total:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": sys.argv,
                    "table": [{"model": lb, "dtype": d, "kl": kl, "rlctl": r, "trl": t} for lb, d, kl, r, t in table],
                    "gemm_peak_flops": {d: rate for d, (rate, _) in peaks.items()},
                    "prompt_tokens": prompt_tokens,
                    "runs": raw,
                    "one_step_off": {"/".join(key): o for key, o in offs.items()},
                    "trl_settings": dict(described),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
