"""The per-side summary of the CPU comparison, the matmul work of a step and the one-thread peak it is
measured against, and the targets printed after the table (benchmarks/grpo_vs_trl.py)."""

from __future__ import annotations

import statistics
import time

from trlcompare.common import GROUP, PROMPTS_PER_STEP, RunResult


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
