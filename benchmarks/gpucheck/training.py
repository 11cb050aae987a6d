"""Checks 5 to 9, on the rlctl runs of the plan (gpucheck.plan). Each check computes every figure it can
from what its runs wrote, also after a run was stopped at its budget or killed (the rows and events
written so far), and judges last.

5  throughput: T, the realistic step: tokens/s, the update's MFU against check 1's measured bf16 rate,
   the share of the step spent generating, each phase's time, peak GPU memory
6  resume: K, SIGKILLed after step 3, resumed (K+) against the uninterrupted R, deterministic kernels
7  LoRA's snapshot against R's; fp16's loss scale; gradient checkpointing's memory (S against R)
8  the snapshot writer process on device tensors: R's asynchronous stall against S's synchronous save
9  the tests marked gpu, in what time is left
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from gpucheck.context import Ctx, bf16_peak
from gpucheck.plan import DIST_VARS, REPO
from gpucheck.report import GIB, MIB, Clock, Fail, Skip
from gpucheck.runs import Run

PHASES = ("gen", "old_log_prob", "ref", "update_actor", "step")
NONDETERMINISTIC = re.compile(r"(\w[\w:.]*) does not have a deterministic implementation")  # torch's warning
DETERMINISM = [
    "trainer.deterministic: true (rlctl.engine.runtime.deterministic_kernels)",
    "torch.use_deterministic_algorithms(True, warn_only=True)",
    "CUBLAS_WORKSPACE_CONFIG=:4096:8",
    "torch.backends.cudnn.deterministic = True",
    "torch.backends.cudnn.benchmark = False",
    "CUDA attention: the math kernel (flash, memory-efficient and cuDNN kernels off)",
]


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# -- 5: the realistic throughput run ----------------------------------------------------------------------
def check_throughput(ctx: Ctx, fig: dict, clock: Clock) -> None:
    run = ctx.plan.get("T")
    fig.update(run.facts())
    fig["shape"] = dict(ctx.size.throughput)
    rows = [r for r in run.rows() if r.get("timing_s/step")]
    steady = rows[1:] or rows  # step 1 warms up (the allocator grows, kernels are chosen); alone, it is all there is
    fig["steady_steps"] = [r.get("step") for r in rows[1:]]
    fig["first_step_s"] = rows[0]["timing_s/step"] if rows else None
    if rows:
        fig.update(throughput_figures(ctx, steady))
        fig["summary"] = throughput_summary(fig)
    extensions = ctx.work / "torch_extensions"
    fig["jit_builds"] = sorted(p.name for p in extensions.iterdir()) if extensions.exists() else []
    if ctx.tiny and run.timed_out:
        fig["stopped"] = "the dry run stops T when its phase's other runs end, as the budget stops it on a GPU"
    if not rows:
        raise Fail(f"run T wrote no step (exit {run.rc}, stopped at its budget: {run.timed_out}): {run.tail()}")
    if not run.timed_out:
        run.ok()
    if ctx.device == "cuda" and run.gpu_peak_mib is None:
        raise Fail("nvidia-smi gave no GPU memory reading of the run")
    if fig["jit_builds"]:
        raise Fail(f"a run JIT-compiled {', '.join(fig['jit_builds'])} (rlctl should need no DeepSpeed op)")


def throughput_figures(ctx: Ctx, steady: list[dict]) -> dict:
    """The medians over ``steady`` rows: tokens/s, generation's tokens/s and share of the step, each
    phase's seconds, and the update's model FLOP rate as 6 N tokens (forward and backward, N the
    parameters, every token of the batch, times the PPO epochs) per second of timing_s/update_actor,
    over check 1's measured matrix-product rate (the MFU) and the datasheet's peak."""
    t = ctx.size.throughput
    sequences, epochs = t["prompts"] * t["group"], t["epochs"]
    out = {
        "tokens_per_s": median(r.get("perf/throughput") for r in steady),
        "gen_tokens_per_s": median(sequences * r["response_length/mean"] / r["timing_s/gen"] for r in steady),
        "gen_share_of_step": round(median(r["timing_s/gen"] / r["timing_s/step"] for r in steady), 4),
        "phases_s": {k: median(r.get(f"timing_s/{k}") for r in steady) for k in PHASES},
        "prompt_length": median(r.get("prompt_length/mean") for r in steady),
        "response_length": median(r.get("response_length/mean") for r in steady),
    }
    tokens = [r["perf/throughput"] * r["timing_s/step"] for r in steady]  # the batch's, prompts and responses
    out["tokens_per_step"] = median(tokens)
    rates = [6 * ctx.params * n * epochs / r["timing_s/update_actor"] / 1e12 for n, r in zip(tokens, steady)]
    # (four significant digits: a tiny CPU dry run's rate is about 1e-4 TFLOP/s, which three decimals made 0)
    tflops = out["update_tflops"] = float(f"{median(rates):.4g}")
    out["update_mfu"] = float(f"{tflops / ctx.matmul_tflops:.4g}") if ctx.matmul_tflops else None
    peak = bf16_peak(ctx.gpu_name)
    out["update_fraction_of_datasheet_bf16"] = round(tflops / peak, 4) if peak else None
    return out


def throughput_summary(fig: dict) -> str:
    memory = f", peak GPU memory {fig['gpu_peak_gib']} GiB" if fig["gpu_peak_gib"] is not None else ""
    mfu = f" (MFU {fig['update_mfu']:.1%})" if fig["update_mfu"] is not None else ""
    steady = fig["steady_steps"]
    which = f"steady steps {steady[0]}-{steady[-1]}" if steady else "step 1 only, warm-up included"
    cut = ", stopped at its budget" if fig["stopped_at_budget"] else ""
    return (
        f"{fig['tokens_per_s']:.0f} tokens/s, generating {fig['gen_share_of_step']:.0%} of the step at "
        f"{fig['gen_tokens_per_s']:.0f} tokens/s, update {fig['update_tflops']} TFLOP/s{mfu}{memory}; "
        f"{which}{cut}; phases (s): " + ", ".join(f"{k} {v:.3g}" for k, v in fig["phases_s"].items() if v is not None)
    )


# -- 6: SIGKILL and resume against an uninterrupted run, under deterministic kernels ---------------------
VOLATILE = ("timing_s/", "perf/throughput", "timestamp")  # wall-clock figures, different in every run


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE) and k != "abandoned"}


def row_differences(ref: list[dict], other: list[dict]) -> list[dict]:
    """Every (step, key) whose value differs between two runs' rows (a key missing on one side too)."""
    out = []
    for a, b in zip(ref, other):
        a, b = stable(a), stable(b)
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diff = None
                if isinstance(a.get(key), (int, float)) and isinstance(b.get(key), (int, float)):
                    diff = abs(a[key] - b[key])
                out.append(
                    {"step": a.get("step"), "key": key, "reference": a.get(key), "resumed": b.get(key), "abs": diff}
                )
    if len(ref) != len(other):
        out.append({"step": None, "key": "rows", "reference": len(ref), "resumed": len(other), "abs": None})
    return out


def weights_hash(run: Run) -> str | None:
    done = run.events("completed")
    return done[-1].get("weights_sha256") if done else None


def check_resume(ctx: Ctx, fig: dict, clock: Clock) -> None:
    ref, killed = ctx.plan.get("R"), ctx.plan.get("K")
    fig["settings"] = DETERMINISM
    fig["reference"], fig["killed"] = ref.facts(), killed.facts()
    resumed = ctx.plan.get("K+") if killed.killed_after == 3 else None
    runs = [r for r in (ref, killed, resumed) if r is not None]
    logs = [r.output() for r in runs]
    fig["kernels_without_deterministic_version"] = kernels = sorted(
        {m for text in logs for m in NONDETERMINISTIC.findall(text)}
    )
    warnings = {
        line.strip()[:300] for text in logs for line in text.splitlines() if "Warning" in line and "determinis" in line
    }
    fig["determinism_warnings"] = sorted(warnings)[:10]
    fig["grad_norms"] = [r.get("actor/grad_norm") for r in ref.rows()]
    if resumed is not None:
        fig["resumed"] = resumed.facts()
        resume = resumed.events("resume")
        fig["resumed_from_step"] = resume[-1].get("step") if resume else None
        fig["weights_sha256"] = {"reference": weights_hash(ref), "resumed": weights_hash(resumed)}
        diffs = row_differences(ref.rows(), resumed.rows())
        fig["rows_compared"], fig["cells_differing"], fig["differences"] = len(ref.rows()), len(diffs), diffs[:20]
        same = weights_hash(ref) is not None and weights_hash(ref) == weights_hash(resumed)
        fig["summary"] = (
            f"killed after step 3, resumed from step {fig['resumed_from_step']}: weights "
            f"{'identical' if same else 'DIFFER'}, {len(ref.rows())} rows with {len(diffs)} differing values"
            + (f"; kernels without a deterministic version: {', '.join(kernels)}" if kernels else "")
        )
    ref.ok()
    if resumed is None:
        raise Fail(
            f"run K was not killed after step 3 (exit {killed.rc}, last step {killed.last_step()}): {killed.tail()}"
        )
    resumed.ok()
    if not any(n for n in fig["grad_norms"] if n is not None):
        raise Fail("the reference run never changed its weights (every grad norm 0): nothing to compare")
    if fig["resumed_from_step"] != 2:
        raise Fail(f"the resume began at step {fig['resumed_from_step']}, not at the snapshot of step 2")
    if not same or diffs:
        where = ", ".join(sorted({d["key"] for d in diffs})[:8])
        raise Fail(
            f"the resumed run differs from the uninterrupted one (weights {'same' if same else 'differ'}; {where})"
        )


# -- 7: LoRA, fp16, gradient checkpointing ---------------------------------------------------------------
def snapshot_bytes(run: Run) -> int | None:
    committed = run.events("snapshot_committed")
    return committed[-1].get("bytes") if committed else None


def check_lora(ctx: Ctx, fig: dict, clock: Clock) -> None:
    lora, full = ctx.plan.get("L"), ctx.plan.get("R")
    fig.update(lora.facts())
    fig["lora_rank"] = ctx.size.lora_rank
    sizes = fig["snapshot_bytes"] = {"lora": snapshot_bytes(lora), "full": snapshot_bytes(full)}
    if None not in sizes.values():
        ratio = fig["full_over_lora"] = round(sizes["full"] / sizes["lora"], 1)
        fig["summary"] = (
            f"rank {ctx.size.lora_rank} all-linear: snapshot {sizes['lora'] / MIB:.1f} MiB against "
            f"{sizes['full'] / MIB:.1f} MiB for full fine-tuning ({ratio}x smaller)"
        )
    lora.ok()
    if None in sizes.values():
        raise Fail(f"a snapshot is missing: {sizes}")
    if fig["full_over_lora"] <= 1:
        raise Fail("the LoRA snapshot is not smaller than the full one")


def check_fp16(ctx: Ctx, fig: dict, clock: Clock) -> None:
    if not ctx.plan.has("F"):
        raise Skip("fp16 under DeepSpeed needs CUDA (rlctl refuses it on a CPU without oneDNN fp16)")
    run = ctx.plan.get("F")
    fig.update(run.facts())
    rows = run.rows()
    fig["loss_scale"] = [r.get("actor/loss_scale") for r in rows]
    fig["overflow_skipped"] = [r.get("actor/overflow_skipped") for r in rows]
    fig["summary"] = f"loss scale by step {fig['loss_scale']}, overflowed optimizer steps {fig['overflow_skipped']}"
    run.ok()
    if None in fig["loss_scale"] or min(fig["loss_scale"]) >= 2.0**16:
        raise Fail("the loss scale never moved from 2^16 (rewards of 1e5 should overflow fp16 gradients)")


def check_ckpt(ctx: Ctx, fig: dict, clock: Clock) -> None:
    """S (gradient checkpointing) against R (without), both of the small shape; the peak GPU memory is
    compared where nvidia-smi gave both runs' own processes' (side by side, the whole GPU's is not one run's)."""
    without, with_ = ctx.plan.get("R"), ctx.plan.get("S")
    fig["with"], fig["without"] = with_.facts(), without.facts()
    one, two = (
        (with_.rows() or [{}])[0],
        (without.rows() or [{}])[0],
    )  # step 1 of each: the same shapes, both warming up
    fig["update_s_step1"] = {"with": one.get("timing_s/update_actor"), "without": two.get("timing_s/update_actor")}
    fig["memory_sources"] = {"with": with_.gpu_source, "without": without.gpu_source}
    comparable = with_.gpu_source == without.gpu_source == "process"
    if comparable:
        saved = fig["saved_gib"] = round((without.gpu_peak_mib - with_.gpu_peak_mib) / 1024, 2)
        fig["summary"] = (
            f"peak GPU memory {with_.gpu_peak_mib / 1024:.2f} GiB with, {without.gpu_peak_mib / 1024:.2f} GiB "
            f"without ({saved} GiB saved); update of step 1 {one.get('timing_s/update_actor')} s against "
            f"{two.get('timing_s/update_actor')} s"
        )
    else:
        fig["summary"] = (
            f"trained with gradient checkpointing; peak GPU memory not compared (sources {fig['memory_sources']})"
        )
    with_.ok()
    if comparable and fig["saved_gib"] <= 0:
        raise Fail("gradient checkpointing did not lower the peak GPU memory")


# -- 8: the snapshot writer process with device tensors ---------------------------------------------------
STAGING = (
    "each device tensor is copied by the training process into a shared-memory host storage (once per "
    "storage and snapshot), which the writer process copies into staging buffers of its own; training "
    "goes on once that copy is made, and the writer serializes, hashes and writes from it"
)


def fence_wait(rows: list[dict], snapshot_step: int) -> float | None:
    """Seconds the update after a snapshot took beyond the others (its optimizer step waits at the fence
    until the writer has its copy), against the median of the steady steps before and after it."""
    update = {r["step"]: r.get("timing_s/update_actor") for r in rows}
    after = update.get(snapshot_step + 1)
    others = [v for s, v in update.items() if s not in (1, snapshot_step + 1) and v is not None]
    return None if after is None or not others else round(max(0.0, after - statistics.median(others)), 4)


def committed(run: Run) -> list[dict]:
    return [
        {k: e.get(k) for k in ("step", "bytes", "stall_s", "commit_s")} | {"save_s": e["stall_s"] + e["commit_s"]}
        for e in run.events("snapshot_committed")
    ]


def check_writer(ctx: Ctx, fig: dict, clock: Clock) -> None:
    """R's asynchronous snapshots (the writer process) against S's synchronous one."""
    run, sync = ctx.plan.get("R"), ctx.plan.get("S")
    fig["writers"] = dict(ctx.plan.writers)
    fig["asynchronous"], fig["synchronous"] = committed(run), committed(sync)
    fallbacks = run.events("snapshot_writer_fallback") + sync.events("snapshot_writer_fallback")
    fig["fallbacks"] = [e.get("reason") for e in fallbacks]
    fig["writer_process_seen"] = bool(run.writer_pids)
    size = fig["asynchronous"][0]["bytes"] if fig["asynchronous"] else 0
    fig["host_staging"] = {
        "how": STAGING,
        "snapshot_gib": round(size / GIB, 3),
        "dev_shm_peak_gib": round(run.shm_peak / GIB, 3),
        "writer_peak_rss_gib": round(run.writer_hwm_kib / (1 << 20), 3),
    }
    stall = save = None
    if fig["asynchronous"] and fig["synchronous"]:
        first = fig["asynchronous"][0]
        fence = fig["fence_wait_s"] = fence_wait(run.rows(), first["step"])
        stall = fig["asynchronous_stall_s"] = round(first["stall_s"] + (fence or 0.0), 4)
        save = fig["synchronous_save_s"] = round(fig["synchronous"][0]["save_s"], 4)
        fig["stall_over_save"] = round(stall / save, 3) if save else None
        fig["summary"] = (
            f"asynchronous stall {stall:.3g} s (save call {first['stall_s']:.3g} s + fence {fence} s) against a "
            f"synchronous save of {save:.3g} s for {size / GIB:.2f} GiB; /dev/shm peak "
            f"{fig['host_staging']['dev_shm_peak_gib']} GiB, writer peak RSS {fig['host_staging']['writer_peak_rss_gib']} GiB"
        )
    if stall is None:
        raise Fail(
            f"a snapshot was not committed (asynchronous {len(fig['asynchronous'])}, synchronous {len(fig['synchronous'])})"
        )
    if fig["fallbacks"] or not fig["writer_process_seen"]:
        raise Fail(f"the snapshots were not written by the writer process: {fig['fallbacks'] or 'no writer seen'}")
    if ctx.device == "cuda" and stall >= save:
        raise Fail("the asynchronous snapshot stalled training as long as a synchronous save")


# -- 9: the tests marked gpu ----------------------------------------------------------------------------
def check_gpu_tests(ctx: Ctx, fig: dict, clock: Clock) -> None:
    if ctx.device != "cuda":
        raise Skip("no CUDA device: every test marked gpu would be skipped")
    if clock.left() < 20:
        raise Skip(f"{clock.left():.0f} s left: too little for the gpu tests")
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    fig["files"] = files
    fig["entry_point"] = ensure_entry_point()
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    budget = clock.left() - 3
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-m", "gpu", "-p", "no:cacheprovider", *files]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=budget)
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output, rc = exc.stdout or "", None
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
    fig["output_tail"] = output.splitlines()[-25:]
    found = re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR)", output)
    fig["counts"] = counts = {k.lower(): found.count(k) for k in sorted(set(found))}
    fig["exit"] = rc
    text = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no test reported"
    if rc is None:
        fig["summary"] = f"stopped at its budget of {budget:.0f} s after {text}"
        if counts.get("failed") or counts.get("error"):
            raise Fail(f"pytest -m gpu: {text} before its budget ran out")
        raise Skip(f"pytest -m gpu ran out of its {budget:.0f} s after {text}")
    fig["summary"] = text
    if rc != 0:
        raise Fail(f"pytest -m gpu exited {rc} ({text})")


def ensure_entry_point() -> str:
    """The tests run the `rlctl` console script beside this Python. Where it is missing (a bare image that
    was carried only the wheels), the console script pip would write for rlctl is written there (rlctl
    itself runs from this tree, on PYTHONPATH)."""
    script = Path(sys.executable).parent / "rlctl"
    if script.exists():
        return f"{script} was there"
    script.write_text(f"#!{sys.executable}\nimport sys\n\nfrom rlctl.cli import main\n\nsys.exit(main())\n")
    script.chmod(0o755)
    return f"wrote {script}"
