"""rlctl's `rollout.mode: one_step_off` against `sync` on identical GRPO work, measured in one run.

    .venv/bin/python benchmarks/one_step_off.py [--model tiny,25M] [--steps 8] [--warmup 2] [--rounds 3]
                                               [--json FILE]

This is a benchmark, not a test: it prints numbers and asserts nothing about them.

What it measures. `one_step_off` generates step N+1's batch in a background thread, on a copy of the
weights, while step N trains on the main thread (rlctl/engine/ahead.py); it can only make a step shorter
when generation and training really run at the same time, on separate cores. Per mode the table gives,
over the steps after the warm-up, pooled over the rounds: the median step time (`timing_s/step` of
RUN_DIR/metrics.jsonl), the median generated tokens per second (per step: `response_length/mean` x the
batch's 32 sequences / `timing_s/step`, the completions' tokens up to and including eos; rlctl's own
`perf/throughput` counts prompt and padding-free completion tokens, the attention mask, and is printed
next to it), the median `timing_s/gen` (sync: the generation itself; one_step_off: how long the step
WAITED for its batch, copying the weights into the generator's module for the next batch included), the
median of the rest of the step (the update and everything else on the main thread) and the ratio
one_step_off/sync of generated tokens per second (above 1: one_step_off is faster).

What each side waits on. rlctl is not changed: the worker of a one_step_off run wraps, in its own
process, `RolloutAhead._make` (the background generation of one batch: its wall time and the CPU time of
its thread, `time.thread_time`), `GeneratingActor.load_from` (the weight copy, on the main thread) and
`Trainer.train_step` (the step's wall time, the main thread's CPU time, and the whole process's CPU time:
process CPU / wall is how many cores the step used, 1.0 at most for one thread, 2.0 at most here;
and the time from one step's start to the next's, which adds to `timing_s/step` the metrics row and
the checks between steps, time that the background generation overlaps too).
The background batches counted are those that the measured steps trained. If the two threads run in
parallel, a one_step_off step takes about max(rest of the step, background generation) + the copy; if
not, the background generation's wall time exceeds its thread's CPU time (it waits for the GIL or a
core) and the step takes about their sum.

How it runs. The parent writes the model directories (with `build_model_dir` of
benchmarks/grpo_vs_trl.py: rlctl's character tokenizer with (a) its built-in tiny Llama, 16 new tokens,
(b) a Llama of hidden 512, 8 layers, MLP 1408, head_dim 64, 25.8M parameters, 32 new tokens) and the
echo prompts (`make_prompts`, 256 rows). Then, per model, it runs sync, one_step_off, sync, one_step_off
... (`--rounds` of each), every run in a fresh interpreter (this file with `--worker`) and a fresh run
directory, one at a time, through the library API the CLI uses (`rlctl.run.start_run`) with
grpo_vs_trl.py's rlctl config (`rlctl_overrides`: GRPO, 8 prompts x 4 samples, temperature 1.0, no KL,
AdamW lr 1e-5, ZeRO-2 world of one, fp32, no checkpoints) plus `rollout.mode`. Every process runs with
OMP_NUM_THREADS=1, torch.set_num_threads(1) (trainer.num_threads 1) and DS_ACCELERATOR=cpu; the
background thread's torch thread count is recorded too. The first `--warmup` steps of each run (first
calls into kernels; in one_step_off step 1 generates its own batch synchronously) are left out. The load
average is printed before and after: the machine may be shared.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in the workers
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse
import dataclasses
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_vs_trl import GROUP, PROMPTS_PER_STEP, SEED, Job, build_model_dir, rlctl_overrides  # noqa: E402

MODES = ("sync", "one_step_off")
NEW_TOKENS = {"tiny": 16, "25M": 32}
BATCH = PROMPTS_PER_STEP * GROUP


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- one run (worker process) -----------------------------------------------------------------------
def install_probes() -> dict[str, list[dict]]:
    """Wrap three rlctl methods in this process only, to time what each thread does."""
    import torch

    from rlctl.engine import ahead
    from rlctl.engine.trainer import Trainer

    probes: dict[str, list[dict]] = {"make": [], "copy": [], "step": []}
    make, load_from, train_step = ahead.RolloutAhead._make, ahead.GeneratingActor.load_from, Trainer.train_step

    def timed_make(self, step, trained, synced=False):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return make(self, step, trained, synced)
        finally:
            probes["make"].append(
                {
                    "step": step,
                    "thread": threading.current_thread().name,
                    "wall": time.perf_counter() - w0,
                    "cpu": time.thread_time() - c0,
                    "torch_threads": torch.get_num_threads(),
                }
            )

    def timed_copy(self, actor):
        w0 = time.perf_counter()
        load_from(self, actor)
        probes["copy"].append({"wall": time.perf_counter() - w0})

    def timed_step(self, step):
        w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        row = train_step(self, step)
        wall = time.perf_counter() - w0
        probes["step"].append(
            {
                "step": step,
                "start": w0,
                "wall": wall,
                "main_cpu": time.thread_time() - c0,
                "process_cpu": time.process_time() - p0,
            }
        )
        return row

    ahead.RolloutAhead._make = timed_make
    ahead.GeneratingActor.load_from = timed_copy
    Trainer.train_step = timed_step
    return probes


def run_one(spec: dict) -> dict:
    import torch

    from rlctl.config import load_config
    from rlctl.run import start_run

    torch.set_num_threads(1)
    probes = install_probes()
    job = Job(**spec["job"])
    cfg = load_config(None, [*rlctl_overrides(job), f"rollout.mode={spec['mode']}"])
    t0 = time.perf_counter()
    start_run(cfg, job.out)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (Path(job.out) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if [r["step"] for r in rows] != list(range(1, job.steps + 1)):
        raise RuntimeError(f"steps {[r['step'] for r in rows]} in {job.out}; expected 1..{job.steps}")
    keys = ("timing_s/step", "timing_s/gen", "perf/throughput", "response_length/mean")
    return {
        "mode": spec["mode"],
        "rows": [{k: r[k] for k in keys} | {"update": r.get("timing_s/update_actor")} for r in rows],
        "probes": probes,
        "wall_s": wall,
        "threads": torch.get_num_threads(),
    }


def worker(spec_file: str, out_file: str) -> None:
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    result = run_one(json.loads(Path(spec_file).read_text()))
    Path(out_file).write_text(json.dumps(result))


def launch(job: Job, mode: str, work: Path, n: int) -> dict:
    """One run in a fresh interpreter; its output goes to a log file, shown if it fails."""
    spec, out, logf = work / f"spec-{n}.json", work / f"result-{n}.json", work / f"log-{n}.txt"
    spec.write_text(json.dumps({"job": dataclasses.asdict(job), "mode": mode}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with logf.open("w") as fh:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(spec), str(out)]
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if rc != 0:
        log(logf.read_text()[-6000:])
        raise SystemExit(f"the {mode} run failed (exit {rc}); its output is above")
    return json.loads(out.read_text())


# -- summary (parent) -------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def per_run(run: dict, warm: int) -> list[dict]:
    return [p for p in run["probes"]["step"] if p["step"] > warm]


def bg_of(run: dict, warm: int) -> list[dict]:
    """The batches the measured steps trained, generated in the background (none in sync)."""
    return [m for m in run["probes"]["make"] if m["step"] > warm and m["thread"] != "MainThread"]


def summarize(runs: list[dict], warm: int) -> dict:
    rows = [r for run in runs for r in run["rows"][warm:]]
    step = [r["timing_s/step"] for r in rows]
    gen = [r["timing_s/gen"] for r in rows]
    steps = [p for run in runs for p in per_run(run, warm)]
    bg = [m for run in runs for m in bg_of(run, warm)]
    copies = [c["wall"] for run in runs for c in run["probes"]["copy"]]
    return {
        "s_per_step": med(step),
        "tok_per_s": med([r["response_length/mean"] * BATCH / r["timing_s/step"] for r in rows]),
        "perf_throughput": med([r["perf/throughput"] for r in rows]),
        "gen_s": med(gen),
        "rest_s": med([s - g for s, g in zip(step, gen)]),
        "update_s": med([r["update"] for r in rows if r["update"] is not None]),
        "mean_len": statistics.fmean(r["response_length/mean"] for r in rows),
        "period_s": med([b["start"] - a["start"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1]),
        "cores": med([p["process_cpu"] / p["wall"] for p in steps]),
        "main_cpu_s": med([p["main_cpu"] for p in steps]),
        "bg_wall_s": med([m["wall"] for m in bg]),
        "bg_cpu_s": med([m["cpu"] for m in bg]),
        "bg_torch_threads": sorted({m["torch_threads"] for m in bg}),
        "copy_s": med(copies),
        "run_medians": [round(med([r["timing_s/step"] for r in run["rows"][warm:]]), 4) for run in runs],
        "run_cores": [round(med([p["process_cpu"] / p["wall"] for p in per_run(run, warm)]), 2) for run in runs],
        "run_bg": [[round(med([m[k] for m in bg_of(run, warm)]), 3) for k in ("wall", "cpu")] for run in runs],
        "wall_s": [round(run["wall_s"], 1) for run in runs],
        "threads": sorted({run["threads"] for run in runs}),
        "n_steps": len(rows),
    }


def print_table(table: list[tuple[str, dict, dict]]) -> None:
    head = (
        f"{'model':6s} {'mode':12s} {'s/step':>8s} {'gen tok/s':>9s} {'perf/thr':>9s} {'gen(wait)':>9s} "
        f"{'rest':>7s} {'update':>7s} {'cores':>5s} {'mean len':>8s} {'ratio':>6s}"
    )
    print(head)
    print("-" * len(head))
    for model, s, o in table:
        for mode, x in (("sync", s), ("one_step_off", o)):
            ratio = f"{o['tok_per_s'] / s['tok_per_s']:6.2f}" if mode == "one_step_off" else f"{'':6s}"
            print(
                f"{model:6s} {mode:12s} {x['s_per_step']:8.4f} {x['tok_per_s']:9.0f} {x['perf_throughput']:9.0f} "
                f"{x['gen_s']:9.4f} {x['rest_s']:7.4f} {x['update_s']:7.4f} {x['cores']:5.2f} "
                f"{x['mean_len']:8.1f} {ratio}"
            )
    print()
    print(
        "s/step: median timing_s/step; gen tok/s: median of per-step generated tokens (response_length/mean x "
        f"{BATCH}) / timing_s/step; perf/thr: median perf/throughput (all attention-mask tokens / step); "
        "gen(wait): median timing_s/gen (one_step_off: the wait for the batch, plus the weight copy); rest: "
        "median step - gen; update: median timing_s/update_actor; cores: median process CPU / wall per step; "
        "ratio: one_step_off / sync of gen tok/s (above 1: one_step_off is faster). Medians over the steps "
        "after the warm-up, pooled over the rounds."
    )


def print_waits(table: list[tuple[str, dict, dict]]) -> None:
    print()
    print("what each side waits on (one_step_off), medians in s:")
    for model, s, o in table:
        ideal = max(s["rest_s"], s["gen_s"]) + o["copy_s"]
        serial = s["rest_s"] + s["gen_s"] + o["copy_s"]
        print(
            f"  {model}: background generation per batch: wall {o['bg_wall_s']:.4f}, its thread's CPU "
            f"{o['bg_cpu_s']:.4f} (sync generates in {s['gen_s']:.4f}); torch threads in it {o['bg_torch_threads']}"
        )
        print(
            f"  {model}: main thread: waits {o['gen_s']:.4f} for its batch (weight copy {o['copy_s']:.4f} of it), "
            f"rest of the step {o['rest_s']:.4f} wall / {o['main_cpu_s']:.4f} CPU of the whole step "
            f"(sync: rest {s['rest_s']:.4f}, main CPU {s['main_cpu_s']:.4f})"
        )
        print(
            f"  {model}: step {o['s_per_step']:.4f} vs perfectly parallel max(sync rest, sync gen) + copy "
            f"{ideal:.4f} and fully serial sync rest + sync gen + copy {serial:.4f}; cores used "
            f"{o['cores']:.2f} (sync {s['cores']:.2f})"
        )
        print(
            f"  {model}: from one step's start to the next's (the step plus the metrics row, checks and "
            f"bookkeeping between steps, which the background generation overlaps too): sync {s['period_s']:.4f}, "
            f"one_step_off {o['period_s']:.4f}, ratio sync/one_step_off {s['period_s'] / o['period_s']:.2f}"
        )
    for model, s, o in table:
        for mode, x in (("sync", s), ("one_step_off", o)):
            bg = f", background generation [wall, CPU] {x['run_bg']}" if mode == "one_step_off" else ""
            print(
                f"  {model} {mode}: per run: median s/step {x['run_medians']}, cores {x['run_cores']}{bg}, "
                f"run wall {x['wall_s']} s"
            )


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="25M", help="comma list of: tiny, 25M")
    ap.add_argument("--steps", type=int, default=8, help="steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--prompts", type=int, default=256, help="rows of the echo task")
    ap.add_argument("--json", default=None, help="also write the figures and every per-step number here")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.models = [m.strip() for m in args.model.split(",") if m.strip()]
    if args.worker is None:
        if bad := [m for m in args.models if m not in NEW_TOKENS]:
            ap.error(f"unknown model {bad}; choose from {list(NEW_TOKENS)}")
        if args.steps <= args.warmup:
            ap.error(f"{args.steps} steps leave nothing after a warm-up of {args.warmup}")
    return args


def measure(args: argparse.Namespace, work: Path) -> tuple[list, dict]:
    import transformers

    from rlctl.engine.reward.builtin import make_prompts

    transformers.utils.logging.disable_progress_bar()
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(args.prompts, SEED)))
    table, raw, n = [], {}, 0
    for model in args.models:
        model_dir = work / f"model-{model}"
        params = build_model_dir(model, model_dir)
        log(f"{model}: {params / 1e6:.2f}M parameters, {NEW_TOKENS[model]} new tokens")
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES:
                n += 1
                job = Job(str(model_dir), str(data), NEW_TOKENS[model], args.steps, 0.0, str(work / f"run-{n}"))
                res = launch(job, mode, work, n)
                runs[mode].append(res)
                step = [x["timing_s/step"] for x in res["rows"][args.warmup :]]
                log(
                    f"[{model} round {r + 1}] {mode:12s}: median {med(step):.4f} s/step, run {res['wall_s']:.1f} s, "
                    f"load {loadavg()}"
                )
        table.append((model, summarize(runs["sync"], args.warmup), summarize(runs["one_step_off"], args.warmup)))
        raw[model] = runs
    return table, raw


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(*args.worker)
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(
        f"work: GRPO {PROMPTS_PER_STEP} prompts x {GROUP} samples, fp32, no KL; "
        + ", ".join(f"{m}: {NEW_TOKENS[m]} new tokens" for m in args.models)
        + f"; {args.steps} steps per run, the first {args.warmup} left out; {args.rounds} rounds of sync, "
        f"one_step_off; {os.cpu_count()} CPUs, OMP_NUM_THREADS=1, torch.set_num_threads(1)"
    )
    load_before, t0 = loadavg(), time.perf_counter()
    print(f"load average before (1, 5, 15 min): {load_before}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlctl-one-step-off-") as tmp:
        table, raw = measure(args, Path(tmp))
    load_after = loadavg()
    print()
    print_table(table)
    print_waits(table)
    print()
    print(f"load average after (1, 5, 15 min): {load_after}; total {time.perf_counter() - t0:.0f} s")
    if args.json:
        figures = [{"model": m, "sync": s, "one_step_off": o} for m, s, o in table]
        out = {"command": sys.argv, "load_before": load_before, "load_after": load_after, "table": figures}
        Path(args.json).write_text(json.dumps({**out, "runs": raw}, indent=1))


if __name__ == "__main__":
    main()
