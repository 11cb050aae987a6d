"""The campaign's workload and its uninterrupted reference, the plan of trials, and one trial: a run
signalled at its moment, resumed as a scheduler would, and judged against the reference."""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from campaign.processes import (
    COMMIT_DELAY,
    CORRUPT_EVENTS,
    CORRUPT_SIGNS,
    EVERY,
    SIGNAL_EXIT,
    SPIKE_STEP,
    STEP_LINE,
    VOLATILE,
    Child,
    Store,
    child_env,
)


# -- the workload and its reference --------------------------------------------------------------------
def write_config(path: Path, steps: int) -> None:
    """The campaign's run: the tiny built-in model, a snapshot every EVERY steps, a rollback rule the
    KL drill trips at SPIKE_STEP."""
    rule = {"name": "kl-drill", "when": "actor/ppo_kl > 1.0", "actions": [{"type": "rollback"}]}
    cfg = {
        "name": "fault-campaign",
        "trainer": {"total_steps": steps, "prompts_per_step": 8},
        "algorithm": {"group_size": 4},
        "rollout": {"max_new_tokens": 8},
        "checkpoint": {"every": EVERY},
        "policies": [{"rules": [rule]}],
    }
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def snapshot_steps(steps: int) -> list[int]:
    """The snapshots such a run commits: step 0 (a rollback policy wants one), every EVERY, the last."""
    return sorted({0, *range(EVERY, steps + 1, EVERY), steps})


def stable_row(row: dict[str, Any]) -> str:
    """A metric row's deterministic keys, as canonical JSON (NaN spelled the same on both sides)."""
    kept = {k: v for k, v in row.items() if not k.startswith(VOLATILE) and k != "abandoned"}
    return json.dumps(kept, sort_keys=True)


def read_jsonl(store: Store, url: str) -> tuple[list[dict[str, Any]], int]:
    """The rows of a JSONL file and the number of lines that did not parse."""
    rows, bad = [], 0
    for line in (store.cat(url) or b"").splitlines():
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def completed_hash(events: list[dict[str, Any]]) -> str | None:
    done = [e for e in events if e.get("event") == "completed"]
    return done[-1].get("weights_sha256") if done else None


class ReferenceFailed(Exception):
    """The uninterrupted run did not complete as planned: there is nothing to compare trials with."""


@dataclass
class Reference:
    """What an uninterrupted run did, and the timings the trials' moments are drawn from."""

    rows: dict[int, str]
    sha256: str
    startup_s: float  # launch to the first step's row (then the quickest of the trials' starts)
    step_s: float  # median time between two rows
    rollback_s: float  # the spiking step's row to its replay's row
    wall_s: float


def run_reference(store: Store, cfg: Path, timeout: float) -> Reference:
    url = store.url("reference")
    child = Child(["start", str(cfg), "--run-dir", url], child_env(store))
    rc = child.finish(timeout)
    events, _ = read_jsonl(store, f"{url}/events.jsonl")
    rows, bad = read_jsonl(store, f"{url}/metrics.jsonl")
    sha = completed_hash(events)
    rolled_back = any(e.get("event") == "rollback" for e in events)
    if rc != 0 or sha is None or bad or not rolled_back:
        why = f"exit {rc}, weights sha256 {sha}, unreadable rows {bad}, rolled back {rolled_back}"
        raise ReferenceFailed(f"the {store.name} reference run failed ({why}):\n{child.stderr}")
    times = [t for t, line in child.lines if STEP_LINE.match(line)]
    spike = child.step_times(SPIKE_STEP)
    if len(spike) != 2:
        raise ReferenceFailed(f"the {store.name} reference printed {len(spike)} rows of step {SPIKE_STEP}, not 2")
    return Reference(
        rows={r["step"]: stable_row(r) for r in rows},
        sha256=sha,
        startup_s=times[0],
        step_s=statistics.median(b - a for a, b in zip(times, times[1:])),
        rollback_s=spike[1] - spike[0],
        wall_s=child.wall_s,
    )


# -- the plan ------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """One trial, fixed before anything runs: the signal, the moment and where in its window."""

    index: int
    storage: str
    signal: str
    moment: str
    u: float  # where in the moment's window, 0..1
    step: int  # mid-step and mid-resume: the step after whose row the first signal comes
    snapshot: int  # mid-commit: the snapshot whose commit is cut
    u_resume: float  # mid-resume: where in the resume's start-up


def make_plan(seed: int, storages: list[str], trials: int, kinds: list[str], moments: list[str], steps: int):
    """Per storage, the (signal, moment) pairs dealt in shuffled rounds, each trial with its own draws;
    a storage's trials depend only on the seed and its name (``--storage s3`` repeats the S3 half)."""
    plan = []
    for storage in storages:
        rng = random.Random(f"{seed}:{storage}")
        deck: list[tuple[str, str]] = []
        for index in range(trials):
            if not deck:
                deck = [(k, m) for k in kinds for m in moments]
                rng.shuffle(deck)
            kind, moment = deck.pop()
            draws = (rng.random(), rng.randint(1, steps - 1), rng.choice(snapshot_steps(steps)), rng.random())
            plan.append(Plan(index, storage, kind, moment, *draws))
    return plan


# -- a trial -------------------------------------------------------------------------------------------
@dataclass
class Trial:
    """One trial under way: its plan, what it is compared with, where it runs, and its record."""

    plan: Plan
    ref: Reference
    store: Store
    cfg: Path
    args: argparse.Namespace
    url: str
    rec: dict[str, Any]

    def child(self, args: list[str]) -> Child:
        return Child(args, child_env(self.store))

    def requeue_args(self) -> list[str]:
        """What examples/slurm-requeue.sbatch runs: resume a run that has its config, else start it."""
        if self.store.exists(f"{self.url}/config.yaml"):
            return ["resume", self.url, "--from", "latest"]
        return ["start", str(self.cfg), "--run-dir", self.url]

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.store, f"{self.url}/events.jsonl")[0]

    def fail(self, what: str, child: Child | None = None) -> None:
        """A failure of the trial; with the full stderr of the process it concerns."""
        self.rec["failures"].append({"what": what, **({"stderr": child.stderr[-20000:]} if child else {})})


def signal_in_startup(child: Child, kind: str, u: float, ref: Reference, timeout: float) -> dict[str, Any]:
    """Send ``kind`` at a point of the start-up drawn by ``u``: from 0.2 s after launch to 85% of the
    quickest start-up seen (start-up times vary with the load)."""
    child.wait_until(lambda: child.elapsed() >= 0.2 + u * max(0.85 * ref.startup_s - 0.2, 0.0), timeout)
    seen = child.last_step() is None
    child.send(kind)
    return {"moment": "start-up", "seen": seen and child.signal_at is not None}


def signal_at_moment(t: Trial, child: Child) -> dict[str, Any]:
    """Wait for the plan's moment in the first process of a trial, then send the plan's signal; whether
    the moment was seen (the process may end, or a window close, before)."""
    plan, ref, timeout = t.plan, t.ref, t.args.timeout
    moment = "mid-step" if plan.moment == "mid-resume" else plan.moment
    if moment == "start-up":
        return signal_in_startup(child, plan.signal, plan.u, ref, timeout)
    if moment == "mid-step":
        seen = child.wait_until(lambda: bool(child.step_times(plan.step)), timeout)
        child.pause(plan.u * ref.step_s)
    elif moment == "mid-commit":
        seen = child.wait_until(lambda: t.store.uncommitted(t.url, plan.snapshot), timeout)
        child.pause(plan.u * 0.8 * COMMIT_DELAY)
        seen = seen and t.store.uncommitted(t.url, plan.snapshot)
    else:  # mid-rollback: between the spiking step's row and its replay's
        seen = child.wait_until(lambda: bool(child.step_times(SPIKE_STEP)), timeout)
        child.pause(plan.u * ref.rollback_s)
        seen = seen and len(child.step_times(SPIKE_STEP)) == 1
    child.send(plan.signal)
    return {"moment": moment, "seen": seen and child.signal_at is not None}


def note_process(t: Trial, child: Child, rc: int | None, role: str) -> dict[str, Any]:
    """Add a process to the trial's record; a traceback on its stderr is a failure."""
    tail = [line for _, line in child.lines if line.strip()][-3:]
    proc = {"role": role, "verb": child.args[0], "rc": rc, "wall_s": round(child.wall_s, 2)}
    proc.update(signal_at_s=child.signal_at and round(child.signal_at, 3), last_row=child.last_step(), tail=tail)
    t.rec["processes"].append(proc)
    if "Traceback (most recent call last)" in child.stderr:
        t.fail(f"{role}: `rlctl {child.args[0]}` printed a traceback", child)
    return proc


def check_signalled(t: Trial, child: Child, seen: dict[str, Any]) -> None:
    """The signalled process must exit 137 (SIGKILL) or 75 (SIGTERM), or 0 when it ended before the
    signal or had trained its last step by then; after an exit 75 ``inspect --check`` must say 45."""
    kind = t.plan.signal
    rc = child.finish(t.args.timeout)
    proc = note_process(t, child, rc, f"signalled {child.args[0]}")
    proc.update(seen, row_at_signal=child.row_at_signal)
    t.rec["signal_exits"].append(rc)
    proc["check"] = inspect_check(t)
    if rc == 75 and proc["check"] not in (None, 45):
        t.fail(f"after {kind} (exit 75) `rlctl inspect --check` exited {proc['check']}, expected 45 (preempted)")
    done_before = child.signal_at is None or kind == "SIGKILL" or child.row_at_signal == max(t.ref.rows)
    if rc == SIGNAL_EXIT[kind] or (rc == 0 and done_before and completed_hash(t.events()) is not None):
        return
    got = "hung (killed after the timeout)" if rc is None else f"exited {rc}"
    if rc == 0:
        when = "before step 1" if child.row_at_signal is None else f"after step {child.row_at_signal}"
        got += f" (the signal came {when}; the run trained on to the end)"
    t.fail(f"{kind} at {seen['moment']}: `rlctl {child.args[0]}` {got}, expected {SIGNAL_EXIT[kind]}", child)


def inspect_check(t: Trial) -> int | None:
    """``rlctl inspect RUN --check``'s exit code; None when there is no run directory to inspect yet."""
    if not t.store.exists(f"{t.url}/config.yaml"):
        return None
    return t.child(["inspect", t.url, "--check"]).finish(t.args.timeout)


def requeue(t: Trial) -> bool:
    """Requeue until an exit 0, at most ``--max-requeues`` times; whether the run got there."""
    for n in range(1, t.args.max_requeues + 1):
        bad_before = bad_snapshot_events(t)
        child = t.child(t.requeue_args())
        rc = child.finish(t.args.timeout)
        proc = note_process(t, child, rc, f"requeue {n}")
        signs = rc in (1, 11) or any(sign in child.stderr for sign in CORRUPT_SIGNS)
        if child.args[0] == "resume" and (signs or bad_snapshot_events(t) > bad_before):
            proc["corrupt_load"] = True
            t.rec["corrupt_loads"] += 1
        if rc == 0:
            return True
        t.fail(f"requeue {n}: `rlctl {child.args[0]}` exited {rc}", child)
    return False


def bad_snapshot_events(t: Trial) -> int:
    """How many snapshots the run has found unusable or quarantined so far (its events say)."""
    return sum(e.get("event") in CORRUPT_EVENTS for e in t.events())


def judge(t: Trial, resumed: bool) -> None:
    """Compare the final run with the reference: weights, every metric row, lost and repeated steps."""
    rec, ref, events = t.rec, t.ref, t.events()
    rows, bad = read_jsonl(t.store, f"{t.url}/metrics.jsonl")
    counts = collections.Counter(r.get("step") for r in rows)
    final = {r["step"]: stable_row(r) for r in rows if "step" in r}
    sha = completed_hash(events)
    rec.update(
        resumed=resumed and sha is not None,
        weights_match=sha == ref.sha256,
        lost_steps=sorted(set(ref.rows) - set(final)),
        rows_differ=sorted(s for s in final if s in ref.rows and final[s] != ref.rows[s]),
        repeated_steps=sorted(s for s, n in counts.items() if n > 1),
        extra_steps=sorted(set(final) - set(ref.rows), key=str),
        unreadable_metric_lines=bad,
        events=dict(collections.Counter(e.get("event") for e in events)),
    )
    wrong = [k for k in ("lost_steps", "rows_differ", "repeated_steps", "extra_steps") if rec[k]]
    wrong += ["unreadable_metric_lines"] * bool(bad) + ["weights_sha256"] * (not rec["weights_match"])
    rec["bit_exact"] = rec["resumed"] and not wrong
    if not rec["resumed"]:
        t.fail(f"the run never completed in {len(rec['processes'])} processes")
    elif wrong:
        t.fail("not bit-exact: " + ", ".join(f"{k} {rec.get(k)}" for k in wrong))


def run_trial(plan: Plan, ref: Reference, store: Store, cfg: Path, args) -> dict[str, Any]:
    url = store.url(f"trial-{plan.index:03d}")
    rec: dict[str, Any] = {**asdict(plan), "run": url, "processes": [], "failures": []}
    rec.update(corrupt_loads=0, signal_exits=[])
    t, t0 = Trial(plan, ref, store, cfg, args, url, rec), time.monotonic()
    first = t.child(["start", str(cfg), "--run-dir", url])
    check_signalled(t, first, signal_at_moment(t, first))
    if (rows := [at for at, line in first.lines if STEP_LINE.match(line)]) and rows[0] < ref.startup_s:
        ref.startup_s = rows[0]  # start-up windows follow the quickest start seen (the load varies)
    if plan.moment == "mid-resume":
        second = t.child(t.requeue_args())
        seen = signal_in_startup(second, plan.signal, plan.u_resume, ref, args.timeout)
        check_signalled(t, second, {**seen, "moment": "mid-resume"})
    judge(t, requeue(t))
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    rec["ok"] = rec["bit_exact"] and not rec["failures"]
    return rec
