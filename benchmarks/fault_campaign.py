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
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import fsspec
import orjson

REPO = Path(__file__).resolve().parents[1]
RLCTL = str(Path(sys.executable).parent / "rlctl")
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}
SIGNAL_EXIT = {"SIGKILL": 137, "SIGTERM": 75}
MOMENTS = ("start-up", "mid-step", "mid-commit", "mid-resume", "mid-rollback")
VOLATILE = ("timing_s/", "perf/throughput", "timestamp")
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STEP_LINE = re.compile(r"^step (\d+)/\d+\s")
CORRUPT_SIGNS = ("warning: skipping snapshot", "trying an older snapshot", "quarantin")  # on stderr
CORRUPT_EVENTS = ("snapshot_quarantined", "snapshot_unusable")
SPIKE_STEP = 5
EVERY = 2
COMMIT_DELAY = 0.4
FAULTS = f"metric@{SPIKE_STEP}=actor/ppo_kl:5.0,commit_delay={COMMIT_DELAY}"
BUCKET = "rlctl-campaign"
POLL_S = 0.02


# -- storage -------------------------------------------------------------------------------------------
@dataclass
class Store:
    """Where the runs of one storage kind live, seen through fsspec (listings never cached)."""

    name: str
    base: str
    env: dict[str, str]
    fs: Any

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def cat(self, url: str) -> bytes | None:
        try:
            return self.fs.cat_file(url)
        except FileNotFoundError:
            return None

    def exists(self, url: str) -> bool:
        return self.fs.exists(url)

    def uncommitted(self, run_url: str, step: int) -> bool:
        """The snapshot of ``step`` has files and no manifest yet: its commit is under way."""
        try:
            names = [str(p).rsplit("/", 1)[-1] for p in self.fs.ls(f"{run_url}/checkpoints/step-{step:06d}")]
        except FileNotFoundError:
            return False
        return bool(names) and "manifest.json" not in names

    def remove(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(url, recursive=True)


def local_store(root: Path) -> Store:
    root.mkdir(parents=True, exist_ok=True)
    return Store("local", str(root), {}, fsspec.filesystem("file"))


@contextlib.contextmanager
def s3_store(prefix: str) -> Iterator[Store]:
    """A moto S3 server on loopback in its own process (as tests/conftest.py ``s3_env``), a bucket on
    it, and the environment that points rlctl's s3fs at it."""
    server = Path(sys.executable).parent / "moto_server"
    if not server.exists():
        raise SystemExit("moto_server is not installed in this environment: pip install 'moto[server]'")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=quiet, stderr=quiet)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(endpoint, proc)
        opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "test", "secret": "test"}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **opts)
        fs.mkdir(BUCKET)
        env = {"FSSPEC_S3": json.dumps(opts), "AWS_DEFAULT_REGION": "us-east-1"}
        yield Store("s3", f"s3://{BUCKET}/{prefix}", env, fs)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wait_for_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit(f"moto_server did not answer at {url}") from None
            time.sleep(0.1)


# -- one rlctl process ---------------------------------------------------------------------------------
class Child:
    """One rlctl process; its stderr is read as it comes, each line with its time since launch."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.args = args
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [RLCTL, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self.signal_at: float | None = None
        self.row_at_signal: int | None = None
        self.wall_s = 0.0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((self.elapsed(), line.rstrip("\n")))

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def step_times(self, step: int) -> list[float]:
        """When the row of ``step`` was printed (twice for a step replayed after a rollback)."""
        return [t for t, line in list(self.lines) if (m := STEP_LINE.match(line)) and int(m[1]) == step]

    def last_step(self) -> int | None:
        steps = [int(m[1]) for _, line in list(self.lines) if (m := STEP_LINE.match(line))]
        return steps[-1] if steps else None

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Poll ``predicate`` while the process lives; whether it came true."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if not self.alive():
                return predicate()
            time.sleep(POLL_S)
        return False

    def pause(self, seconds: float) -> None:
        """Wait ``seconds``, cut short if the process ends."""
        self.wait_until(lambda: False, seconds)

    def send(self, kind: str) -> None:
        if self.alive():
            self.signal_at, self.row_at_signal = self.elapsed(), self.last_step()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, SIGNALS[kind])

    def finish(self, timeout: float) -> int | None:
        """The exit code in shell terms (128 + N for signal N); None when it hung and was killed."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = None
        self._reader.join(timeout=10)
        self.wall_s = self.elapsed()
        return None if rc is None else (128 - rc if rc < 0 else rc)

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in list(self.lines))


def child_env(store: Store) -> dict[str, str]:
    """One thread per process, the CPU accelerator, the campaign's drills and the storage's settings."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env.update(threads, DS_ACCELERATOR="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0", TOKENIZERS_PARALLELISM="false")
    env.update(RLCTL_FAULTS=FAULTS, **store.env)
    return env


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
