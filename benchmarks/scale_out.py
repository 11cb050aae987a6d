"""Snapshot and weight-sync time against the number of ranks, and the universal-checkpoint conversion time
against snapshot size, measured in one run.

    .venv/bin/python benchmarks/scale_out.py [--model 25M] [--nproc 1,2,3] [--zero 2,3] [--steps 4]
                                             [--rounds 1] [--convert-models 6M] [--convert-repeats 2]
                                             [--json FILE]

This is a benchmark, not a test: it prints numbers and asserts nothing about them. The default run takes
about 8 minutes on the project's 2-core machine; `--rounds 2`, `--steps 8`, `--model 100M` or
`--convert-models 6M,100M` make it longer and the medians firmer.

What it measures. Per ZeRO stage and number of ranks, real runs of the installed console script
(`.venv/bin/rlctl start --nproc N`, GRPO on the echo task, 6 prompts x 4 samples, 8 new tokens, fp32,
`checkpoint.every 1`, everything else rlctl's defaults: asynchronous snapshots by the writer process, on
the local disk of the run directory), read back from the run directory:

- snapshot: the `snapshot_committed` events of RUN_DIR/events.jsonl, their `bytes` (the whole snapshot),
  `commit_s` (from the snapshot's start to its commit marker) and `stall_s` (how long training waited for
  it). The first snapshot of a run starts the writer process and is left out: medians over the rest;
- weight sync: with the `hf` rollout backend the generator IS the actor's module, so nothing is copied
  (`HFRollout.sync_weights` does nothing) and rlctl records no time for it. What stands for a weight
  sync there is ZeRO-3's parameter gather before each generation (`DSModule.full_parameters`, a
  `deepspeed.zero.GatheredParameters` over every parameter) and the release after it. rlctl does not time
  these apart from `timing_s/gen`, which holds them and the generation. So every process of the run
  (the `rlctl` driver, which trains in a world of one, and each rank, forked by the run's starter or exec'd)
  loads a probe from this script at start (a `sitecustomize` on PYTHONPATH, the run's environment only;
  rlctl is not changed) that wraps `DSModule.full_parameters` and records the wall time of entering
  (gather) and leaving (release) each call made by the rollout's `generate`. Per step the slowest rank
  counts; the first step is left out. Under ZeRO-2 the parameters are whole on every rank and the
  context is a no-op: the gather column shows that (microseconds), and its ratio is not printed;
- `timing_s/gen` and `timing_s/step` of RUN_DIR/metrics.jsonl (the slowest rank's), medians over the
  steps after the first.

Each figure is printed beside its ratio to one rank of the same ZeRO stage. The runs go round-robin over
(nproc, stage) within a round, `--rounds` times, so that the load of a shared machine falls on all.

Universal-checkpoint conversion: rlctl converts a snapshot written by another number of ranks with
`rlctl.engine.universal.to_universal` (DeepSpeed's `ds_to_universal` in-process, one worker) before an
elastic resume. This script times that function, each call in a fresh interpreter (this file with
`--convert`), on the actor's DeepSpeed directory (RUN_DIR/checkpoints/step-N/actor) of the last snapshot
of each ZeRO-2 run above (the same model saved by 1, 2, 3 ranks) and of one ZeRO-2 run (`--convert-nproc`
ranks, 1 by default; 2 steps) of each model of `--convert-models`; alternating, `--convert-repeats` times each; it
prints the median seconds, the snapshot directory's size and MB/s (MB = 1e6 bytes of input).

Models: rlctl's character tokenizer with a Llama of hidden/layers/MLP/heads 256/8/704/4 (6M), 512/8/1408/8
(25M, the model of benchmarks/one_step_off.py and grpo_vs_trl.py) or 1024/8/2816/16 (100M), written by
the script. Every process runs with OMP_NUM_THREADS=1 (trainer.num_threads 1) and DS_ACCELERATOR=cpu.
The load average is printed before and after: the machine may be shared.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in every run's processes
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse
import dataclasses
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SEED = 0  # grpo_vs_trl.py's
MODELS = {"6M": (256, 8, 704, 4), "25M": (512, 8, 1408, 8), "100M": (1024, 8, 2816, 16)}
PROMPTS, GROUP, NEW_TOKENS = 6, 4, 8  # 24 sequences a step: a whole share for 1, 2 or 3 ranks
PROBE_VAR = "RLCTL_SCALE_OUT_PROBE"
SITECUSTOMIZE = f"""import importlib.util, os, sys
if os.environ.get({PROBE_VAR!r}):
    spec = importlib.util.spec_from_file_location("scale_out_probe", {str(HERE)!r})
    module = sys.modules["scale_out_probe"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install_probe(os.environ[{PROBE_VAR!r}])
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the probe, loaded into every process of a run by the sitecustomize above ----------------------------
class _Timed:
    """A ``full_parameters`` context whose entering (the gather) and leaving (the release) are timed."""

    def __init__(self, inner, path: str, row: dict):
        self.inner, self.path, self.row = inner, path, row

    def __enter__(self):
        t0 = time.perf_counter()
        out = self.inner.__enter__()
        self.row["gather_s"] = time.perf_counter() - t0
        return out

    def __exit__(self, *exc):
        t0 = time.perf_counter()
        out = self.inner.__exit__(*exc)
        self.row["release_s"] = time.perf_counter() - t0
        with open(self.path, "a") as fh:
            fh.write(json.dumps(self.row) + "\n")
        return out


def install_probe(out_dir: str) -> None:
    """Wrap ``DSModule.full_parameters`` in this process only; one JSON line per call to ``out_dir``."""
    import torch.distributed as dist

    from rlctl.engine import ds_module

    original = ds_module.DSModule.full_parameters
    path = os.path.join(out_dir, f"probe-{os.getpid()}.jsonl")

    def full_parameters(self):
        caller = sys._getframe(1).f_code.co_qualname
        rank = dist.get_rank() if dist.is_initialized() else 0
        return _Timed(original(self), path, {"caller": caller, "rank": rank, "stage": self.zero_stage})

    ds_module.DSModule.full_parameters = full_parameters


# -- models and runs ----------------------------------------------------------------------------------
def build_model(key: str, out: Path) -> int:
    """Write a Llama of size ``key`` with rlctl's character tokenizer; returns the parameter count."""
    sys.path.insert(0, str(HERE.parent))  # (this file also loads as the runs' probe, from elsewhere)
    from grpo_vs_trl import llama

    from rlctl.engine.model import build_char_tokenizer

    hidden, layers, mlp, heads = MODELS[key]
    tok = build_char_tokenizer()
    model = llama(tok, hidden=hidden, layers=layers, mlp=mlp, heads=heads)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


@dataclasses.dataclass
class Spec:
    model: str
    model_dir: str
    nproc: int
    zero: int
    steps: int
    every: int
    run_dir: str


def rlctl_command(spec: Spec, data: str) -> list[str]:
    sys.path.insert(0, str(HERE.parent))
    from grpo_vs_trl import Job, rlctl_overrides

    job = Job(spec.model_dir, data, NEW_TOKENS, spec.steps, 0.0, spec.run_dir)
    sets = [
        *rlctl_overrides(job),  # grpo_vs_trl.py's: GRPO, fp32, no KL, AdamW, checkpoint.every 0 (set below)
        f"trainer.prompts_per_step={PROMPTS}",
        f"algorithm.group_size={GROUP}",
        f"actor.zero_stage={spec.zero}",
        f"checkpoint.every={spec.every}",
    ]
    exe = HERE.parents[1] / ".venv" / "bin" / "rlctl"
    exe = str(exe) if exe.exists() else shutil.which("rlctl") or "rlctl"
    cmd = [exe, "start", "--run-dir", spec.run_dir, "--nproc", str(spec.nproc)]
    return cmd + [arg for s in sets for arg in ("--set", s)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def launch(spec: Spec, data: str, work: Path) -> dict:
    """One `rlctl start` in a subprocess with the probe loaded; what its run directory says."""
    probe = Path(spec.run_dir + "-probe")
    probe.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", **{PROBE_VAR: str(probe)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "site"), env.get("PYTHONPATH")]))
    logf = Path(spec.run_dir + ".log")
    t0 = time.perf_counter()
    with logf.open("w") as fh:
        rc = subprocess.run(rlctl_command(spec, data), stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        log(logf.read_text()[-6000:])
        raise SystemExit(f"rlctl start failed (exit {rc}) for {spec}; its output is above")
    run = Path(spec.run_dir)
    rows = read_jsonl(run / "metrics.jsonl")
    if [r["step"] for r in rows] != list(range(1, spec.steps + 1)):
        raise SystemExit(f"steps {[r['step'] for r in rows]} in {run}; expected 1..{spec.steps}")
    snaps = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "snapshot_committed"]
    calls = [c for f in sorted(probe.glob("probe-*.jsonl")) for c in read_jsonl(f) if "generate" in c["caller"]]
    return {
        **dataclasses.asdict(spec),
        "wall_s": wall,
        "snapshots": [{k: e[k] for k in ("step", "bytes", "stall_s", "commit_s", "location")} for e in snaps],
        "gen_s": [r["timing_s/gen"] for r in rows],
        "step_s": [r["timing_s/step"] for r in rows],
        "gather_s": slowest_rank(calls, "gather_s"),
        "release_s": slowest_rank(calls, "release_s"),
    }


def slowest_rank(calls: list[dict], key: str) -> list[float]:
    """Per generation (the n-th call on every rank), the slowest rank's time."""
    by_rank: dict[int, list[float]] = {}
    for c in calls:
        by_rank.setdefault(c["rank"], []).append(c[key])
    return [max(xs) for xs in zip(*by_rank.values())] if by_rank else []


# -- the conversion (worker process) --------------------------------------------------------------------
def convert(src: str, dst: str) -> None:
    import deepspeed.checkpoint.ds_to_universal  # noqa: F401  (loaded already in a resuming rank: not timed)

    from rlctl.engine.universal import to_universal

    t0 = time.perf_counter()
    to_universal(src, dst)
    seconds = time.perf_counter() - t0
    out = sum(f.stat().st_size for f in Path(dst).rglob("*") if f.is_file())
    print(json.dumps({"seconds": seconds, "out_bytes": out}))


def convert_once(src: str, work: Path) -> dict:
    dst = work / "universal" / "actor"
    cmd = [sys.executable, str(HERE), "--convert", src, str(dst)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            log(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"converting {src} failed (exit {proc.returncode}); its output is above")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work / "universal", ignore_errors=True)


def conversions(sources: list[dict], repeats: int, work: Path) -> list[dict]:
    """Each source converted ``repeats`` times, alternating; its median seconds."""
    for s in sources:
        s["in_bytes"] = sum(f.stat().st_size for f in Path(s["path"]).rglob("*") if f.is_file())
        s["seconds"] = []
    for r in range(repeats):
        for s in sources:
            res = convert_once(s["path"], work)
            s["seconds"].append(res["seconds"])
            s["out_bytes"] = res["out_bytes"]
            log(f"[convert {r + 1}] {s['model']} from {s['nproc']} ranks: {res['seconds']:.2f} s, load {loadavg()}")
    return sources


# -- summary -------------------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict]) -> dict:
    """Medians pooled over a configuration's runs: snapshots after each run's first, steps after the first."""
    snaps = [s for r in runs for s in r["snapshots"] if s["step"] > r["snapshots"][0]["step"]]
    return {
        "bytes": med([s["bytes"] for s in snaps]),
        "commit_s": med([s["commit_s"] for s in snaps]),
        "stall_s": med([s["stall_s"] for s in snaps]),
        "gather_s": med([x for r in runs for x in r["gather_s"][1:]]),
        "release_s": med([x for r in runs for x in r["release_s"][1:]]),
        "gen_s": med([x for r in runs for x in r["gen_s"][1:]]),
        "step_s": med([x for r in runs for x in r["step_s"][1:]]),
        "n_snapshots": len(snaps),
        "first_commit_s": [r["snapshots"][0]["commit_s"] for r in runs],
        "wall_s": [round(r["wall_s"], 1) for r in runs],
    }


def print_scaling(table: dict, stages: list[int], nprocs: list[int]) -> None:
    cols = ("commit_s", "stall_s", "gather_s", "release_s", "gen_s", "step_s")
    head = f"{'ZeRO':>4s} {'nproc':>5s} {'MB':>7s} " + " ".join(f"{c:>16s}" for c in cols)
    print(head)
    print("-" * len(head))
    for zero in stages:
        base = table[(zero, nprocs[0])]
        for n in nprocs:
            x, cells = table[(zero, n)], []
            for c in cols:
                no_ratio = zero < 3 and c in ("gather_s", "release_s")
                ratio = "" if no_ratio else f"({x[c] / base[c]:.2f}x)"
                cells.append(f"{x[c]:8.4f} {ratio:>7s}")
            print(f"{zero:4d} {n:5d} {x['bytes'] / 1e6:7.1f} " + " ".join(f"{c:>16s}" for c in cells))
    print()
    print(
        f"medians; (Nx): the ratio to {nprocs[0]} rank(s) of the same ZeRO stage. MB: snapshot bytes / 1e6. "
        "commit_s, stall_s: snapshot_committed events after each run's first; gather_s, release_s: the "
        "slowest rank's ZeRO parameter gather before / release after each generation (the hf rollout's "
        "weight sync; a no-op under ZeRO-2, no ratio); gen_s, step_s: timing_s/gen, timing_s/step, steps "
        "after the first."
    )
    for (zero, n), x in sorted(table.items()):
        print(f"  ZeRO-{zero} nproc {n}: first snapshot commit_s {x['first_commit_s']}, run wall {x['wall_s']} s")


def print_conversions(sources: list[dict]) -> None:
    print()
    print("universal-checkpoint conversion (rlctl.engine.universal.to_universal), ZeRO-2 snapshots:")
    head = f"{'model':>6s} {'params':>7s} {'ranks':>5s} {'in MB':>8s} {'out MB':>8s} {'seconds':>8s} {'MB/s':>7s}"
    print(head)
    print("-" * len(head))
    for s in sources:
        sec = med(s["seconds"])
        print(
            f"{s['model']:>6s} {s['params'] / 1e6:6.1f}M {s['nproc']:5d} {s['in_bytes'] / 1e6:8.1f} "
            f"{s['out_bytes'] / 1e6:8.1f} {sec:8.2f} {s['in_bytes'] / 1e6 / sec:7.1f}"
        )
    print(
        "seconds: median of the repeats, each " + ", ".join(f"{[round(x, 2) for x in s['seconds']]}" for s in sources)
    )


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- main ----------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="25M", choices=list(MODELS), help="the model of the scaling runs")
    ap.add_argument("--nproc", default="1,2,3", help="comma list of rank counts; ratios are to the first")
    ap.add_argument("--zero", default="2,3", help="comma list of ZeRO stages")
    ap.add_argument("--steps", type=int, default=4, help="steps per scaling run (a snapshot after each)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each configuration, round-robin")
    ap.add_argument("--convert-models", default="6M", help="other model sizes to convert (comma list; '' none)")
    ap.add_argument("--convert-nproc", type=int, default=1, help="ranks of the runs of --convert-models")
    ap.add_argument("--convert-repeats", type=int, default=2, help="conversions of each snapshot, alternating")
    ap.add_argument("--prompts", type=int, default=256, help="rows of the echo task")
    ap.add_argument("--json", default=None, help="also write the figures and every per-run number here")
    ap.add_argument("--convert", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.nprocs = [int(x) for x in args.nproc.split(",") if x.strip()]
    args.stages = [int(x) for x in args.zero.split(",") if x.strip()]
    args.extra = [m.strip() for m in args.convert_models.split(",") if m.strip()]
    if bad := [m for m in args.extra if m not in MODELS]:
        ap.error(f"unknown model {bad}; choose from {list(MODELS)}")
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first snapshot and step are left out)")
    return args


def scaling_runs(args, work: Path, data: str, model_dir: str) -> dict[tuple[int, int], list[dict]]:
    runs: dict[tuple[int, int], list[dict]] = {(z, n): [] for z in args.stages for n in args.nprocs}
    count = 0
    for r in range(args.rounds):
        for n in args.nprocs:
            for zero in args.stages:
                count += 1
                spec = Spec(args.model, model_dir, n, zero, args.steps, 1, str(work / f"run-{count}"))
                res = launch(spec, data, work)
                runs[(zero, n)].append(res)
                log(
                    f"[round {r + 1}] ZeRO-{zero} nproc {n}: commit_s {med([s['commit_s'] for s in res['snapshots']]):.3f}, "
                    f"gen {med(res['gen_s']):.3f} s, run {res['wall_s']:.1f} s, load {loadavg()}"
                )
                keep = zero == 2 and r == args.rounds - 1  # the last ZeRO-2 snapshots are converted
                if not keep:
                    shutil.rmtree(work / f"run-{count}" / "checkpoints", ignore_errors=True)
    return runs


def conversion_sources(args, runs, work: Path, data: str, params: dict[str, int]) -> list[dict]:
    sources = []
    if 2 in args.stages:
        for n in args.nprocs:
            last = runs[(2, n)][-1]["snapshots"][-1]["location"]
            sources.append({"model": args.model, "params": params[args.model], "nproc": n, "path": last + "/actor"})
    for i, model in enumerate(args.extra):
        spec = Spec(model, str(work / f"model-{model}"), args.convert_nproc, 2, 2, 2, str(work / f"conv-{i}"))
        res = launch(spec, data, work)
        log(f"{model}: a ZeRO-2 snapshot of {res['snapshots'][-1]['bytes'] / 1e6:.1f} MB, run {res['wall_s']:.1f} s")
        path = res["snapshots"][-1]["location"] + "/actor"
        sources.append({"model": model, "params": params[model], "nproc": args.convert_nproc, "path": path})
    return sorted(sources, key=lambda s: (s["params"], s["nproc"]))


def measure(args, work: Path) -> tuple[dict, dict, list[dict]]:
    from rlctl.engine.reward.builtin import make_prompts

    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    data = str(work / "prompts.jsonl")
    Path(data).write_text("".join(json.dumps(r) + "\n" for r in make_prompts(args.prompts, SEED)))
    params = {}
    for model in dict.fromkeys([args.model, *args.extra]):
        params[model] = build_model(model, work / f"model-{model}")
        log(f"{model}: {params[model] / 1e6:.2f}M parameters")
    runs = scaling_runs(args, work, data, str(work / f"model-{args.model}"))
    table = {key: summarize(rs) for key, rs in runs.items()}
    sources = conversions(conversion_sources(args, runs, work, data, params), args.convert_repeats, work)
    return table, runs, sources


def main() -> None:
    args = parse_args()
    if args.convert:
        return convert(*args.convert)
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(
        f"work: GRPO {PROMPTS} prompts x {GROUP} samples, {NEW_TOKENS} new tokens, fp32, {args.model} model, "
        f"{args.steps} steps per run, a snapshot after each; nproc {args.nprocs}, ZeRO {args.stages}, "
        f"{args.rounds} round(s); {os.cpu_count()} CPUs, OMP_NUM_THREADS=1"
    )
    load_before, t0 = loadavg(), time.perf_counter()
    print(f"load average before (1, 5, 15 min): {load_before}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlctl-scale-out-") as tmp:
        table, runs, sources = measure(args, Path(tmp))
    load_after = loadavg()
    print()
    print_scaling(table, args.stages, args.nprocs)
    print_conversions(sources)
    print()
    print(f"load average after (1, 5, 15 min): {load_after}; total {time.perf_counter() - t0:.0f} s")
    if args.json:
        out = {"command": sys.argv, "load_before": load_before, "load_after": load_after}
        figures = [{"zero": z, "nproc": n, **x} for (z, n), x in sorted(table.items())]
        raw = [r for rs in runs.values() for r in rs]
        Path(args.json).write_text(json.dumps({**out, "table": figures, "conversions": sources, "runs": raw}, indent=1))


if __name__ == "__main__":
    main()
