"""--device: the GPU check's model on one device, two shapes, every side under one budget
(benchmarks/grpo_vs_trl.py)."""

from __future__ import annotations

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

from trlcompare.common import GIB, SEED, Job, RunResult, Shape, log, versions
from trlcompare.sides import Overrun, RunFailed, Worker
from trlcompare.summary import summarize

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
