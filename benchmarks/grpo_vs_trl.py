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
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trlcompare/, beside this file

from trlcompare.common import (  # noqa: E402
    GROUP,
    LR,
    PROMPTS_PER_STEP,
    SEED,
    Job,
    RunResult,
    build_model_dir,
    log,
    versions,
)
from trlcompare.device import SHAPES, SIDES, main_device  # noqa: E402
from trlcompare.sides import Worker, worker  # noqa: E402
from trlcompare.summary import gemm_peak, matmul_params, print_targets, step_flops, summarize  # noqa: E402


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
