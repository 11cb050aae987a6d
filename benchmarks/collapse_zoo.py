"""A zoo of runs that go wrong by themselves, and what each ready-made policy saves of them.

    .venv/bin/python benchmarks/collapse_zoo.py [--only NAME ...] [--variants none default ...]
        [--jobs 2] [--out runs/collapse-zoo] [--prove-replay] [--controls]

Each collapse is a configuration of a built-in task that goes wrong on its own: no drill, no injected
value, seeded (the same seed gives the same run). Each is run side by side under

- ``none``: no policy (the collapse itself, verified to happen);
- ``warn-only``: replayed over the ``none`` run's metrics (``rlctl policy replay``): a policy that only
  warns changes nothing in training, so its firings on the run are the replay's exactly
  (``--prove-replay`` runs it for real on one collapse and compares the firing steps);
- ``default`` and ``conservative``: real runs, but where the policy never fires on the ``none`` run's
  metrics (replayed), which is then its run exactly, as the warn-only proof shows;
- ``calibrated``: a real run under the policy ``rlctl policy calibrate --until H`` proposes from the
  ``none`` run's first H steps (the healthy stretch before the collapse).

The step a collapse becomes visible is the first step from which its signature metric leaves the band
of the healthy stretch (its min and max over steps 1..H) and never comes back (a non-finite value is out
of every band). For each variant the table gives the first firing (its step, lead or lag against that
step, rule and actions), the rollbacks and the steps of training they threw away (the rows moved to
metrics.abandoned.jsonl), the exit code and last step, the final reward (the mean of the task's true
score over the last 20 steps trained: the echo reward, logged beside a hacked reward with weight 0) and
the last validation score, whether that final reward is no worse than the best 20-step stretch before
the collapse (``>best``), and whether a person would have had to act (the run halted, exit 20, or
nothing rolled it back: the collapse ran its course). ``--controls`` runs the base config without a collapse (sync, one_step_off, async 4
ahead, and 4 updates a batch, lr-diverge's healthy twin): the reward a healthy run reaches by the same
step, and the firings on healthy overlapped runs and on a run whose ``actor/ppo_kl`` is not 0.

A run already finished under --out is read, not run again.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
BASE = {
    "seed": 0,
    "trainer": {"total_steps": 150, "prompts_per_step": 16, "val_every": 20},
    "algorithm": {"group_size": 8},
    "actor": {"lr": 2.0e-3, "zero_stage": 2},
    "rollout": {"max_new_tokens": 8},
    "checkpoint": {"every": 10, "keep_last": 4},
}
ECHO = "rlctl.engine.reward.builtin:echo_reward"
TRUE_SCORE = "critic/score/echo/mean"  # with reward.sources; else critic/score/mean is the true score


@dataclass(frozen=True)
class Collapse:
    """A configuration that goes wrong by itself; ``signature``: the metric that shows it and which way
    (``>``: it rises out of the healthy band, ``<``: it falls out); ``healthy``: the last step of the
    healthy stretch (calibrate's --until and the band's end)."""

    name: str
    what: str
    overrides: dict
    signature: tuple[str, str]
    healthy: int
    extra: dict = field(default_factory=dict)


COLLAPSES = (
    Collapse(
        "lr-diverge",
        "lr 1e-2 (5x demo's), 4 optimizer steps a batch: the updates overshoot",
        {"actor": {"lr": 1.0e-2, "mini_batch_size": 32}},
        ("actor/entropy", "<"),
        40,
    ),
    Collapse(
        "length-hack",
        "no KL, no clip (clip 0.99/10, no dual clip), a reward that counts target letters without bound",
        {
            "reward": {
                "sources": [
                    {"function": "benchmarks.zoo.rewards:letter_count", "name": "hacked"},
                    {"function": ECHO, "name": "echo", "weight": 0.0},
                ]
            },
            "algorithm": {"kl_coef": 0.0, "clip_ratio_low": 0.99, "clip_ratio_high": 10.0, "clip_ratio_c": None},
            "rollout": {"max_new_tokens": 16},
        },
        ("response/degenerate_frac", ">"),
        30,
    ),
    Collapse(
        "entropy-collapse",
        "sampling temperature 0.3 and lr 3e-3: the policy turns greedy on its early guesses",
        {"actor": {"lr": 3.0e-3}, "rollout": {"temperature": 0.3}},
        ("actor/entropy", "<"),
        10,
    ),
    Collapse(
        "off-policy",
        "async rollout 4 steps ahead, lr 1e-2: samples from weights 4 updates old",
        {"actor": {"lr": 1.0e-2}, "rollout": {"mode": "async", "max_staleness": 4}},
        ("actor/entropy", "<"),
        20,
    ),
    Collapse(
        "tool-quota",
        "the tools demo (rlctl start tools-demo) with a lookup tool whose quota runs out after 8,000 calls",
        {
            "model": {
                "builtin": {
                    "tokenizer": "chat",
                    "added_tokens": ['<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'],
                }
            },
            "data": {"builtin_task": "lookup", "apply_chat_template": True},
            "reward": {"function": "rlctl.engine.reward.lookup:lookup_reward"},
            "actor": {"lr": 3.0e-3},
            "rollout": {
                "multi_turn": {
                    "tools": [{"function": "benchmarks.zoo.tools:lookup", "hidden": ["word"]}],
                    "max_turns": 2,
                    "max_total_tokens": 128,
                    "tool_workers": 1,
                }
            },
        },
        ("tool/error_frac", ">"),
        50,
    ),
)
# Healthy runs of the base config (the demo's lr 2e-3), sync and overlapped: the reward a run that does
# not collapse reaches by the same step, and runs stale-drift must leave alone. Run without a policy,
# the policies replayed over them (``--controls``).
CONTROLS = (
    Collapse("control-sync", "the zoo's base config: sync, lr 2e-3", {}, ("", ">"), 0),
    Collapse("control-one-step-off", "one_step_off, lr 2e-3", {"rollout": {"mode": "one_step_off"}}, ("", ">"), 0),
    Collapse(
        "control-async-4", "async 4 ahead, lr 2e-3", {"rollout": {"mode": "async", "max_staleness": 4}}, ("", ">"), 0
    ),
    # lr-diverge's healthy twin: 4 optimizer steps a batch at the base lr (a run whose actor/ppo_kl is not 0)
    Collapse("control-4-updates", "4 updates a batch, lr 2e-3", {"actor": {"mini_batch_size": 32}}, ("", ">"), 0),
)
VARIANTS = ("none", "warn-only", "default", "conservative", "calibrated")
RUN_VARIANTS = ("none", "default", "conservative", "calibrated", "warn-only")  # warn-only: with --prove-replay


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def rlctl(*args: str, **kw) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("rlctl")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
    }
    return subprocess.run([str(exe), *args], env=env, **kw)


def run_dir(out: Path, c: Collapse, variant: str) -> Path:
    return out / f"{c.name}-{variant}"


def start(out: Path, c: Collapse, variant: str) -> Path:
    """One real run of collapse ``c`` under ``variant`` unless it has finished before."""
    run = run_dir(out, c, variant)
    if (run / "exit_code").exists():
        return run
    subprocess.run(["rm", "-rf", str(run)], check=True)
    policies: list[str] = []
    if variant == "calibrated":
        policies = [str(calibrate(out, c))]
    elif variant != "none":
        policies = [variant]
    if variant in ("default", "conservative") and not replay_firings(run_dir(out, c, "none"), variant):
        return run  # it never fires on the no-policy run, so its run is that one (report() says so)
    config = merge(merge(BASE, c.overrides), {"name": f"zoo-{c.name}", "policies": policies})
    path = out / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with open(out / f"{run.name}.log", "wb") as log:
        code = rlctl("start", str(path), "--run-dir", str(run), stdout=log, stderr=subprocess.STDOUT).returncode
    (run / "exit_code").write_text(str(code))
    return run


def calibrate(out: Path, c: Collapse) -> Path:
    """The policy ``rlctl policy calibrate`` proposes from the no-policy run's healthy stretch."""
    path = out / f"{c.name}-calibrated.policy.yaml"
    if not path.exists():
        proposed = rlctl(
            "policy",
            "calibrate",
            str(run_dir(out, c, "none")),
            "--until",
            str(c.healthy),
            capture_output=True,
            check=True,
        ).stdout
        path.write_bytes(proposed)
    return path


def jsonl(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()] if path.exists() else []


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def band(rows: list[dict], c: Collapse) -> tuple[float, float]:
    """The signature metric's min and max over the healthy stretch (steps 1..c.healthy)."""
    values = [r[c.signature[0]] for r in rows if r["step"] <= c.healthy and finite(r.get(c.signature[0]))]
    return min(values), max(values)


def out_of_band(rows: list[dict], c: Collapse, lo: float, hi: float) -> list[tuple[int, bool]]:
    """(step, out of the band) for each row past the healthy stretch that has the signature metric."""
    metric, way = c.signature
    return [
        (r["step"], not finite(r[metric]) or (r[metric] > hi if way == ">" else r[metric] < lo))
        for r in rows
        if r["step"] > c.healthy and metric in r
    ]


def visible_step(rows: list[dict], c: Collapse, lo: float, hi: float) -> int | None:
    """The first step from which the signature metric stays out of the healthy band for good."""
    out = None
    for step, gone in out_of_band(rows, c, lo, hi):
        out = (out or step) if gone else None
    return out


def true_score(row: dict) -> float | None:
    return row.get(TRUE_SCORE, row.get("critic/score/mean"))


def read(run: Path, c: Collapse, firings: list[dict] | None = None) -> dict:
    rows = jsonl(run / "metrics.jsonl")
    events = jsonl(run / "events.jsonl")
    fired = firings if firings is not None else [e for e in events if e.get("event") == "policy"]
    rollbacks = [e for e in events if e.get("event") == "rollback"]
    scores = [s for r in rows if finite(s := true_score(r))]
    vals = [r["val/score/mean"] for r in rows if finite(r.get("val/score/mean"))]
    first = fired[0] if fired else {}
    return {
        "exit": int((run / "exit_code").read_text()) if firings is None else None,
        "last_step": max((r["step"] for r in rows), default=0),
        "first": first,
        "first_all": fired,
        "firings": len(fired),
        "rollbacks": len(rollbacks),
        "lost": sum(e.get("from_step", 0) - e.get("to_step", 0) for e in rollbacks),
        "halted": any(e.get("event") == "halted" for e in events),
        "final": statistics.fmean(scores[-20:]) if scores else float("nan"),
        "val": vals[-1] if vals else float("nan"),
        "rows": rows,
    }


def replay_firings(run: Path, policy: str) -> list[dict]:
    """Where ``policy`` would have fired on ``run`` (``rlctl policy replay --format json``)."""
    out = rlctl("policy", "replay", str(run), "--policy", policy, "--format", "json", capture_output=True, check=True)
    return orjson.loads(out.stdout)


def best_before(rows: list[dict], step: int | None) -> float:
    """The best mean true score of 20 consecutive steps before ``step``."""
    scores = [s for r in rows if (step is None or r["step"] < step) and finite(s := true_score(r))]
    return max((statistics.fmean(scores[i : i + 20]) for i in range(max(1, len(scores) - 19))), default=float("nan"))


def report(out: Path, c: Collapse) -> None:
    none = read(run_dir(out, c, "none"), c)
    lo, hi = band(none["rows"], c)
    seen = visible_step(none["rows"], c, lo, hi)
    best = best_before(none["rows"], seen)
    print(f"\n{c.name}: {c.what}")
    print(
        f"  collapse visible at step {seen} ({c.signature[0]} {c.signature[1]} [{lo:.3g}, {hi:.3g}], its band over steps 1-{c.healthy}); "
        f"best 20-step true score before it {best:.3f}"
    )
    print(
        f"  {'variant':>12} {'fires':>5} {'lead':>5} {'rule':>22} {'actions':>28} {'rb':>3} {'lost':>4} "
        f"{'exit':>4} {'step':>4} {'final':>6} {'val':>6} {'>best':>5} {'person':>6}"
    )
    for variant in VARIANTS:
        run = run_dir(out, c, variant)
        if variant == "warn-only":
            replayed = replay_firings(run_dir(out, c, "none"), "warn-only")
            r = read(run_dir(out, c, "none"), c, replayed)
            r["exit"] = none["exit"]
            if (run / "exit_code").exists():  # --prove-replay: the real run's firings are the replay's
                real = [(e["step"], e["rule"]) for e in read(run, c)["first_all"]]
                same = real == [(e["step"], e["rule"]) for e in replayed]
                print(f"  warn-only run for real: {len(real)} firings, the replay's exactly: {same}")
        elif (run / "exit_code").exists():
            r = read(run, c)
        elif variant in ("default", "conservative") and not replay_firings(run_dir(out, c, "none"), variant):
            r = {**none, "first": {"rule": "never fires (= none)"}}
        else:
            continue
        f = r["first"]
        lead = "-" if "step" not in f or seen is None else f"{seen - f['step']:+d}"
        actions = ",".join(a.get("type", "?") if isinstance(a, dict) else str(a) for a in f.get("actions", []))
        kept = r["final"] >= best
        print(
            f"  {variant:>12} {f.get('step', '-'):>5} {lead:>5} {f.get('rule', '-'):>22} {actions[:28]:>28} "
            f"{r['rollbacks']:>3} {r['lost']:>4} {r['exit']:>4} {r['last_step']:>4} {r['final']:>6.3f} "
            f"{r['val']:>6.3f} {'yes' if kept else 'no':>5} {'yes' if r['exit'] or not r['rollbacks'] else 'no':>6}"
        )


def controls(out: Path, jobs: int) -> None:
    """The healthy overlapped runs: their largest rollout/logprob_diff and each ready-made policy's firings."""
    with ThreadPoolExecutor(jobs) as pool:
        runs = list(pool.map(lambda c: start(out, c, "none"), CONTROLS))
    for c, run in zip(CONTROLS, runs):
        r = read(run, c)
        gap = max((x["rollout/logprob_diff"] for x in r["rows"] if finite(x.get("rollout/logprob_diff"))), default=0)
        fired = {p: len(replay_firings(run, p)) for p in ("warn-only", "default", "conservative")}
        print(
            f"{c.name}: exit {r['exit']}, {r['last_step']} steps, largest logprob_diff {gap:.3f}, "
            f"final reward {r['final']:.3f}, replayed firings {fired}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=[c.name for c in COLLAPSES])
    ap.add_argument("--variants", nargs="+", choices=RUN_VARIANTS, default=list(RUN_VARIANTS[:4]))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/collapse-zoo"))
    ap.add_argument("--prove-replay", action="store_true", help="also run warn-only for real, to compare")
    ap.add_argument("--controls", action="store_true", help="the healthy overlapped runs instead")
    args = ap.parse_args()
    if args.controls:
        args.out.mkdir(parents=True, exist_ok=True)
        return controls(args.out, args.jobs)
    args.variants = [v for v in args.variants if v != "warn-only"] + (["warn-only"] if args.prove_replay else [])
    args.out.mkdir(parents=True, exist_ok=True)
    zoo = [c for c in COLLAPSES if not args.only or c.name in args.only]
    with ThreadPoolExecutor(args.jobs) as pool:  # the no-policy runs first: calibrate reads them
        list(pool.map(lambda c: start(args.out, c, "none"), zoo))
        rest = [(c, v) for c in zoo for v in args.variants if v != "none"]
        list(pool.map(lambda cv: start(args.out, *cv), rest))
    for c in zoo:
        report(args.out, c)


if __name__ == "__main__":
    main()
