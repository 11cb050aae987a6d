"""benchmarks/grpo_vs_trl.py --device, rlctl against TRL on one GPU, run as its CPU dry run (--device cpu --tiny):
the same code as on a GPU (the GPU check's model built on the spot, the realistic shape, every side, the memory and
MFU columns, the budget), so it cannot rot while no GPU is lent. The budget's step planning and the
update's FLOP rate are checked on numbers made here."""

import json
import subprocess
import sys
import types

import pytest

from helpers import REPO

BENCH = REPO / "benchmarks" / "grpo_vs_trl.py"
SIDES = {"rlctl", "TRL", "TRL-cb"}


@pytest.fixture
def bench(monkeypatch):
    """The benchmark's modules (benchmarks/trlcompare/), imported here: what the checks below call."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from trlcompare import device  # (it holds what the checks call: Shape, RunResult, plan_steps, side_summary)

    return types.SimpleNamespace(**vars(device))


def result(bench, step_s, gen_s, ref_s, tokens, update_tokens, wall_s=10.0, peak=None):
    n = len(step_s)
    return bench.RunResult(
        "rlctl", step_s, tokens, [1.0] * n, gen_s, ref_s, [0.0] * n, [1.0] * n, wall_s, 1, None, update_tokens, peak
    )


def test_the_budget_plans_each_run_from_the_sides_last_one(bench):
    shape = bench.Shape("s", 8, 4, 48, None, None, steps=6, warmup=1)
    assert bench.plan_steps(shape, None, 1000.0, 4) == 2  # a side's first run of a shape: the fewest steps
    seen = result(bench, [2.0, 1.0, 1.0], [0.5] * 3, [0.1] * 3, [8.0] * 3, [20.0] * 3, wall_s=7.0)  # set-up 3 s
    assert bench.plan_steps(shape, seen, 1000.0, 1) == 6  # at most shape.steps
    assert bench.plan_steps(shape, seen, 24.0, 3) == 5  # (24 s / 3 runs - 3 s of set-up) / 1 s per step
    assert bench.plan_steps(shape, seen, 6.0, 5) == 2  # a short share: still the fewest, since they fit
    assert bench.plan_steps(shape, seen, 4.9, 1) is None  # 3 s + 2 steps do not fit: the rounds end


def test_the_update_rate_counts_real_tokens_and_the_cpu_has_no_memory_or_mfu(bench):
    facts = {"matmul_params": 100, "head_params": 10}
    runs = [result(bench, [9.0, 1.0], [0.5, 0.5], [0.1, 0.1], [8.0, 8.0], [20.0, 20.0])]
    cpu = bench.side_summary(runs, 1, facts, None)
    flops = 6 * (90 * 20 + 10 * 8)  # the warm-up step left out; the LM head over completion tokens only
    assert cpu["update_tflops"] == pytest.approx(flops / 0.4 / 1e12) and cpu["update_s"] == pytest.approx(0.4)
    assert cpu["peak_memory_gib"] is None and cpu["update_mfu"] is None
    runs[0].peak_memory = 3 << 30
    gpu = bench.side_summary(runs, 1, facts, peak=flops / 0.4 / 1e12 * 4)
    assert gpu["peak_memory_gib"] == 3.0 and gpu["update_mfu"] == 0.25


def test_the_gpu_comparison_runs_whole_on_the_cpu(tmp_path):
    pytest.importorskip("trl", reason="TRL comes with the bench extra: pip install -e '.[bench]'")
    out = tmp_path / "bench.json"
    # one shape (the realistic one: prompts, micro-batches); the budget's sharing between shapes is the
    # planning test's above, and each shape runs the same code
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--rounds", "1", "--budget", "200"]
    cmd += ["--shapes", "realistic"]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, (done.stdout, done.stderr[-4000:])
    report = json.loads(out.read_text())
    assert (report["device"], report["gpu"], report["bf16_peak_tflops"]) == ("cpu", None, None)
    assert 0 < report["wall_s"] <= report["budget_s"] == 200
    assert list(report["shapes"]) == ["realistic"]
    for name, shape in report["shapes"].items():
        sides = shape["sides"]
        assert shape["rounds"] == 1 and shape["notes"] == [], (name, shape["notes"])
        assert {"rlctl", "TRL"} <= set(sides) and set(sides) | set(shape["failed"]) == SIDES, shape["failed"]
        for side, s in sides.items():
            assert s["n_steps"] == 1, side  # 2 steps a run, 1 of them warm-up
            assert s["tok_per_s"] > 0 and s["gen_s"] > 0 and s["update_s"] > 0 and s["update_tflops"] > 0
            assert s["peak_memory_gib"] is None and s["update_mfu"] is None and s["memory_after_gib"] == [None]
            assert 0 < s["mean_len"] <= shape["shape"]["new_tokens"]
        assert shape["ratios"]["rlctl/TRL tok/s"] > 0 and shape["ratios"]["rlctl/TRL peak memory"] is None
    assert report["shapes"]["realistic"]["shape"]["micro_batch"] == 8  # 16 sequences in two micro-batches
    assert 25 <= report["shapes"]["realistic"]["prompt_tokens"] <= 34  # ~32-token prompts (tiny)
    lines = done.stdout.splitlines()
    assert any(line.startswith("target, realistic shape: rlctl/TRL tok/s >= 1.0: ") for line in lines)
    rows = [line.split() for line in lines if line.startswith("  rlctl ")]
    assert len(rows) == 1 and all(row[7:] == ["n/a", row[8], "n/a"] for row in rows)  # memory, TFLOP/s, MFU
