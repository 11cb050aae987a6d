"""Fault campaign: random SIGKILLs and SIGTERMs at random moments, each run then requeued until it
completes, and compared with an uninterrupted reference run.

    .venv/bin/python benchmarks/fault_campaign.py [--trials 30] [--storage local,s3] [--seed 0]
        [--log campaign.jsonl] [--signals SIGKILL,SIGTERM] [--moments start-up,mid-commit,...]

The workload is a small run of the built-in tiny model (12 steps, a snapshot every 2 steps) with a
rollback policy and a KL-spike drill at step 5, so every run rolls back once mid-run; the drill also
holds each snapshot's manifest back 0.4 s (``commit_delay``) to widen the mid-commit window. Every
rlctl process gets the same drills (``metric@5`` fires once per process, at the first run of step 5).

Per storage (local disk; S3 on a moto server on loopback, started here), one uninterrupted reference
run gives the per-step metric rows, the final weights' sha256 and the timings the moments are drawn
from. Each trial starts the same config in a fresh run directory and sends its signal at one moment:

- start-up      a random time between launch and the first row (before step 1): up to 85% of the
                quickest start-up seen, the reference's or a trial's;
- mid-step      a random time after the row of a random step;
- mid-commit    while a random snapshot is written but its manifest is not (a step directory without
                ``manifest.json``);
- mid-resume    the run is first stopped mid-step, then the resume that follows is signalled during
                its start-up;
- mid-rollback  a random time between the spiking step's row and its replay's row.

The signalled process must exit 137 (SIGKILL) or 75 (SIGTERM), or 0 when it had trained its last step
before the signal (a SIGTERM that a run trains on through is a failure), and after an exit 75
``inspect --check`` must say preempted (45). The run is then requeued as
examples/slurm-requeue.sbatch does (``resume --from latest`` when config.yaml exists, else ``start``
again) until an exit 0, at most ``--max-requeues`` times. A trial is bit-exact when the final weights'
sha256 equals the reference's and every row of the final metrics.jsonl equals the reference's row of
its step (timings and timestamps aside). Lost steps: reference steps missing from the final history.
Corrupt loads: resumes that exited 1 or 11, or skipped, quarantined or failed to load a snapshot (a
warning on stderr, a ``snapshot_quarantined`` or ``snapshot_unusable`` event). Any other exit code and
any traceback count as a failure; the full stderr of such a process goes to the JSONL log. Exit
status 1 when any trial failed.

The trial plan (signal, moment and the random draws of each trial) comes from ``--seed`` alone; the
signal and moment pairs are dealt in shuffled rounds so that every pair is covered; a storage's plan
does not depend on the other storages asked for. Trials run one after the other, each rlctl process
with one thread: on 2 idle cores about 20 s per trial on local disk and 30 s on S3 (30 trials on
each, about 25 minutes).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # campaign/, beside this file
from campaign.processes import FAULTS, MOMENTS, REPO, SIGNALS, SPIKE_STEP, Store, local_store, s3_store  # noqa: E402
from campaign.trials import Plan, ReferenceFailed, make_plan, run_reference, run_trial, write_config  # noqa: E402

# -- the table -----------------------------------------------------------------------------------------
COLUMNS = ("storage", "signal", "moment", "trials", "moment hit", "resumed", "bit-exact", "lost steps", "corrupt loads")
COLUMNS += ("failed", "exits of signalled")


def table_row(key: tuple[str, str, str], recs: list[dict[str, Any]]) -> list[str]:
    exits = collections.Counter("hung" if rc is None else str(rc) for r in recs for rc in r["signal_exits"])
    cells = [
        len(recs),
        sum(all(p.get("seen", True) for p in r["processes"]) for r in recs),
        sum(r["resumed"] for r in recs),
        sum(r["bit_exact"] for r in recs),
        sum(len(r["lost_steps"]) for r in recs),
        sum(r["corrupt_loads"] for r in recs),
        sum(not r["ok"] for r in recs),
        " ".join(f"{rc}×{n}" for rc, n in sorted(exits.items())),
    ]
    return [*key, *map(str, cells)]


def table(records: list[dict[str, Any]], storages: list[str]) -> list[str]:
    """Markdown: one row per storage, signal and moment; a total per storage and over all."""
    order = {name: i for i, name in enumerate([*storages, *SIGNALS, *MOMENTS])}
    groups = collections.defaultdict(list)
    for r in records:
        groups[(r["storage"], r["signal"], r["moment"])].append(r)
    rows = [table_row(k, groups[k]) for k in sorted(groups, key=lambda k: [order[x] for x in k])]
    for storage in storages:
        recs = [r for r in records if r["storage"] == storage]
        if recs:
            rows.append(table_row((f"**{storage}**", "all", "all"), recs))
    if len(storages) > 1:
        rows.append(table_row(("**all**", "all", "all"), records))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


# -- the campaign --------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=30, help="trials per storage (default 30)")
    ap.add_argument("--storage", default="local,s3", help="comma-separated: local, s3 (default both)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the trial plan (default 0)")
    ap.add_argument("--signals", default=",".join(SIGNALS), help="comma-separated: SIGKILL, SIGTERM")
    ap.add_argument("--moments", default=",".join(MOMENTS), help="comma-separated: " + ", ".join(MOMENTS))
    ap.add_argument("--steps", type=int, default=12, help="steps of the run (default 12)")
    ap.add_argument("--max-requeues", type=int, default=4, help="requeues before a trial counts as stuck")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a process counts as hung")
    ap.add_argument("--log", help="JSONL of every trial (default runs/fault-campaign-<time>.jsonl)")
    ap.add_argument("--workdir", help="where the local runs go (default a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories of trials that passed")
    args = ap.parse_args()
    args.storage = split_choices(ap, "--storage", args.storage, ("local", "s3"))
    args.signals = split_choices(ap, "--signals", args.signals, tuple(SIGNALS))
    args.moments = split_choices(ap, "--moments", args.moments, MOMENTS)
    if args.steps <= SPIKE_STEP:
        ap.error(f"--steps must be above the drill's step {SPIKE_STEP}")
    return args


def split_choices(ap: argparse.ArgumentParser, flag: str, value: str, valid: tuple[str, ...]) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or any(v not in valid for v in items):
        ap.error(f"{flag}: {value!r}; choose from {', '.join(valid)}")
    return items


def open_store(name: str, workdir: Path) -> contextlib.AbstractContextManager[Store]:
    if name == "s3":
        return s3_store(workdir.name)
    return contextlib.nullcontext(local_store(workdir / "local"))


def verdict(rec: dict[str, Any]) -> str:
    if rec["ok"]:
        return "resumed bit-exactly"
    return "FAILED: " + "; ".join(f["what"] for f in rec["failures"])


def run_storage(name: str, plan: list[Plan], cfg: Path, workdir: Path, args, log) -> tuple[list, dict]:
    """The reference run and the trials of one storage, each trial logged as it ends."""
    records = []
    with open_store(name, workdir) as store:
        try:
            ref = run_reference(store, cfg, args.timeout)
        except ReferenceFailed as exc:
            print(exc, file=sys.stderr)
            log.write(json.dumps({"reference": name, "error": str(exc)}) + "\n")
            return [], {"reference": name, "error": str(exc).splitlines()[0]}
        summary = {"reference": name, **{k: v for k, v in asdict(ref).items() if k != "rows"}}
        log.write(json.dumps(summary) + "\n")
        print(f"{name} reference: {ref.wall_s:.1f} s, first row at {ref.startup_s:.1f} s", file=sys.stderr)
        for p in plan:
            rec = run_trial(p, ref, store, cfg, args)
            records.append(rec)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(
                f"[{p.index + 1}] {name} {p.signal} {p.moment}: {verdict(rec)} ({rec['wall_s']:.0f} s)", file=sys.stderr
            )
            if rec["ok"] and not args.keep:
                store.remove(rec["run"])
    return records, summary


def main() -> int:
    args = parse_args()
    exe = os.path.relpath(sys.executable, Path.cwd()) if sys.executable.startswith(str(Path.cwd())) else sys.executable
    print(f"```\n$ {shlex.join([exe, *sys.argv])}\n```\n", flush=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlctl-fault-campaign-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "campaign.yaml"
    write_config(cfg, args.steps)
    log_path = Path(args.log or REPO / "runs" / f"fault-campaign-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    plan = make_plan(args.seed, args.storage, args.trials, args.signals, args.moments, args.steps)
    t0, records, refs = time.monotonic(), [], []
    with log_path.open("w") as log:
        log.write(
            json.dumps({"campaign": sys.argv[1:], "config": json.loads(cfg.read_text()), "faults": FAULTS}) + "\n"
        )
        for name in args.storage:
            recs, ref = run_storage(name, [p for p in plan if p.storage == name], cfg, workdir, args, log)
            records += recs
            refs.append(ref)
    print("\n".join(table(records, args.storage)))
    print(footer(records, refs, time.monotonic() - t0, log_path))
    passed = all(r["ok"] for r in records) and all("sha256" in r for r in refs)
    passed = passed and len({r["sha256"] for r in refs}) == 1
    if passed and not args.keep and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if passed else 1


def footer(records: list[dict[str, Any]], refs: list[dict[str, Any]], seconds: float, log_path: Path) -> str:
    """What the table does not say: the time taken, the references, where the details are."""
    per_trial = statistics.mean(r["wall_s"] for r in records) if records else 0.0
    lines = [f"\n{len(records)} trials in {seconds / 60:.1f} min, references included ({per_trial:.0f} s per trial)."]
    for ref in refs:
        if "error" in ref:
            lines.append(f"{ref['reference']} reference: {ref['error']}")
        else:
            lines.append(
                f"{ref['reference']} reference: {ref['wall_s']:.0f} s, final weights sha256 {ref['sha256'][:16]}"
            )
    lines.append(f"Every trial, and the stderr of every failure: {log_path}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
