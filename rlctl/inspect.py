"""Reading a run without touching it: status, summary, metric selections, health checks, plots.

Everything here reads files through fsspec (local, s3://, memory://) and never imports torch: cron and
Slurm scripts call it every few minutes. Every file read back may be malformed: a line of metrics.jsonl
or events.jsonl that cannot be read (a crash mid-write, a hand edit) is skipped and reported once per
file, never fatal; a config.yaml that cannot be read is a sentence naming it.
"""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlctl.errors import ConfigError
from rlctl.metrics import BadLines, parse_rows
from rlctl.rundir.directory import read_config_data
from rlctl.rundir.layout import ABANDONED, CONFIG, EVENTS, METRICS
from rlctl.rundir.lease import lease_state, read_lease
from rlctl.storage import Storage

KEY_METRICS = (
    "critic/score/mean",
    "val/score/mean",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/entropy",
    "response_length/mean",
    "perf/throughput",
)
# what --plot draws unless told: the first four of these that the run has and that ever move
PLOT_METRICS = (
    "critic/score/mean",
    "val/score/mean",
    "actor/grad_norm",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/kl_loss",
)
TERMINAL = ("start", "resume", "completed", "halted", "preempted", "crashed", "interrupted")


@dataclass
class RunView:
    url: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]]
    lease: dict[str, Any] | None
    bad_lines: list[int] = field(default_factory=list)  # of metrics.jsonl
    unreadable: list[BadLines] = field(default_factory=list)  # per file, for the warnings

    @property
    def total_steps(self) -> int:
        value = self.setting("trainer", "total_steps")
        return value if isinstance(value, int) else 0

    def setting(self, section: str, key: str) -> Any:
        """``config[section][key]`` as the file has it (None where the file lacks it or is odd)."""
        part = self.config.get(section)
        return part.get(key) if isinstance(part, dict) else None

    def warnings(self) -> list[str]:
        """One warning per file with lines that could not be read."""
        return [w for bad in self.unreadable if (w := bad.warning()) is not None]

    @property
    def step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    def events_of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") in kinds]


def open_run(url: str) -> RunView:
    run = Storage(url)
    config = read_config_data(run)
    metrics, events = BadLines(run.url_of(METRICS)), BadLines(run.url_of(EVENTS))
    rows = _read(run, METRICS, metrics, require_step=True)
    view = RunView(url, config, rows, _read(run, EVENTS, events), read_lease(run), metrics.lines)
    view.unreadable = [metrics, events]
    return view


def _read(run: Storage, rel: str, on_bad, require_step: bool = False) -> list[dict[str, Any]]:
    try:
        data = run.read_bytes(rel)
    except FileNotFoundError:
        return []
    return list(parse_rows(data, on_bad, require_step=require_step))


# -- status -----------------------------------------------------------------------------------------
def status(view: RunView, lease_timeout: float | None = None) -> str:
    """running (a live lease), completed, halted (by a policy), preempted (stopped by a signal: resume
    it), interrupted (Ctrl-C: resume it), or crashed (no live lease and none of the above: killed, or
    an error)."""
    configured = view.setting("trainer", "lease_timeout")
    timeout = lease_timeout or (float(configured) if isinstance(configured, (int, float)) else 120.0)
    if lease_state(view.lease, timeout) == "live":
        return "running"
    last = next((e["event"] for e in reversed(view.events) if e.get("event") in TERMINAL), None)
    return last if last in ("completed", "halted", "preempted", "interrupted") else "crashed"


def snapshots(view: RunView) -> list[Any]:
    """The run's snapshots (needs the checkpoint storage, so it reads the validated config)."""
    from rlctl.rundir.directory import validate_run_config
    from rlctl.rundir.snapshots import snapshot_manager

    run = Storage(view.url)
    return snapshot_manager(run, validate_run_config(run, view.config)).scan()


def summary(view: RunView) -> dict[str, Any]:
    snaps = [s for s in snapshots(view) if s.committed]
    good = [s for s in snaps if s.good]
    skips = view.events_of("skip")
    return {
        "run": view.url,
        "status": status(view),
        "step": view.step,
        "total_steps": view.total_steps,
        "last_snapshot": snaps[-1].step if snaps else None,
        "last_good_snapshot": good[-1].step if good else None,
        "rollbacks": len(view.events_of("rollback")),
        "policy_firings": len(view.events_of("policy")),
        "skipped_batches": sum(e["batches"] for e in skips if isinstance(e.get("batches"), int)),
        "skipped_prompts": sum(len(e["prompts"]) for e in skips if isinstance(e.get("prompts"), list)),
        "bad_lines": view.bad_lines,
        "metrics": {
            key: {"latest": series[-1], "trend": sparkline(series)}
            for key in KEY_METRICS
            if (series := [r[key] for r in view.rows if isinstance(r.get(key), (int, float))])
        },
    }


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 24) -> str:
    """The trend of ``values`` in ``width`` characters (bucket means); '!' marks a non-finite bucket."""
    if not values:
        return ""
    n = min(width, len(values))
    buckets = [values[i * len(values) // n : (i + 1) * len(values) // n] for i in range(n)]
    means = [sum(b) / len(b) for b in buckets]
    finite = [m for m in means if math.isfinite(m)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    span = hi - lo or 1.0
    return "".join(SPARKS[round((m - lo) / span * 7)] if math.isfinite(m) else "!" for m in means)


# -- selections -------------------------------------------------------------------------------------
def select(
    rows: Iterable[dict[str, Any]],
    patterns: Sequence[str] = (),
    *,
    last: int | None = None,
    since: int | None = None,
    until: int | None = None,
    every: int | None = None,
) -> tuple[list[str], list[dict[str, Any]]]:
    """Rows filtered by step and columns chosen by glob (``actor/*``); 'step' always comes first."""
    picked = [
        r
        for r in rows
        if (since is None or r.get("step", 0) >= since)
        and (until is None or r.get("step", 0) <= until)
        and (not every or r.get("step", 0) % every == 0)
    ]
    if last is not None:
        picked = picked[-last:] if last else []
    keys: list[str] = []
    for r in picked:
        keys += [k for k in r if k not in keys]
    if patterns:
        keys = [k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    columns = ["step", *[k for k in keys if k != "step"]]
    return columns, [{c: r.get(c) for c in columns} for r in picked]


# -- health check for cron ----------------------------------------------------------------------------
CHECK_CODES = {
    "healthy": 0,
    "warning": 41,
    "halted": 42,
    "crashed": 43,
    "stale": 44,
    "preempted": 45,
    "interrupted": 46,
}


def check(view: RunView, window: int = 100, stale_after: float = 1800.0, rules=None, now=None) -> tuple[str, str]:
    """(verdict, one line). halted, crashed, preempted and interrupted come from the run's state; stale
    is a run that claims to be running (live lease) but wrote no step for ``stale_after`` seconds;
    warning is a snapshot that failed with none committed since, or a policy that fired within the
    last ``window`` steps, in the run or, with ``rules`` (a policy file), when the last ``window`` rows
    are replayed through it."""
    now = time.time() if now is None else now
    state = status(view)
    where = f"step {view.step}/{view.total_steps}"
    if state == "halted":
        halt = view.events_of("halted")[-1]
        return "halted", f"HALTED {view.url} at step {halt.get('step')} by policy rule '{halt.get('rule')}'"
    if state == "crashed":
        return "crashed", f"CRASHED {view.url} at {where}: no live writer and no clean end"
    if state == "preempted":
        return "preempted", f"PREEMPTED {view.url} at {where}: resume it"
    if state == "interrupted":
        return "interrupted", f"INTERRUPTED {view.url} at {where} (Ctrl-C): resume it"
    if state == "running":
        last_time = _last_progress(view)
        if last_time is not None and now - last_time > stale_after:
            return "stale", f"STALE {view.url} at {where}: no new step for {_ago(now - last_time)}"
    failed = failed_snapshot(view)
    if failed is not None:
        return "warning", (
            f"WARNING {view.url} at {where}: snapshot of step {failed.get('step')} failed and none was "
            f"committed since: {failed.get('error')}"
        )
    fired = [e for e in view.events_of("policy") if e.get("step", 0) > view.step - window]
    if rules:
        fired += _replay(view.rows[-window:], rules)
    if fired:
        f = fired[-1]
        return "warning", f"WARNING {view.url} at {where}: rule '{f.get('rule')}' fired at step {f.get('step')}"
    return "healthy", f"OK {view.url} {state} at {where}"


def failed_snapshot(view: RunView) -> dict[str, Any] | None:
    """The newest ``snapshot_failed`` event when no snapshot was committed after it, else None."""
    for event in reversed(view.events):
        if event.get("event") == "snapshot_committed":
            return None
        if event.get("event") == "snapshot_failed":
            return event
    return None


def _last_progress(view: RunView) -> float | None:
    stamp = view.rows[-1].get("timestamp") if view.rows else None
    return float(stamp) if isinstance(stamp, (int, float)) else None


def _replay(rows: list[dict[str, Any]], rules) -> list[dict[str, Any]]:
    from rlctl.policies import PolicyEngine

    engine = PolicyEngine(rules)
    return [f.as_event() for r in rows for f in engine.evaluate(r["step"], r)]


def _ago(seconds: float) -> str:
    return (
        f"{seconds / 3600:.1f}h" if seconds >= 3600 else f"{seconds / 60:.0f}m" if seconds >= 60 else f"{seconds:.0f}s"
    )


def parse_duration(text: str) -> float:
    """'30m', '2h', '90s', '45' (seconds) -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip()
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise ConfigError(f"--stale-after expects a duration like 30m, 2h or 90s; got {text!r}") from None


# -- runs under a root --------------------------------------------------------------------------------
def list_runs(root: str, warn=None) -> list[dict[str, Any]]:
    """The runs directly under ``root`` with their status; a run whose config cannot be read is listed
    as ``unreadable``. ``warn`` receives one sentence per unreadable run or file."""
    base = Storage(root)
    warn = warn or (lambda text: None)
    out = []
    for name in base.listdir():
        if not base.exists(name, CONFIG):
            continue
        try:
            view = open_run(base.url_of(name))
        except ConfigError as exc:
            warn(f"warning: {exc.message}")
            out.append({"run": base.url_of(name), "status": "unreadable", "step": 0, "total_steps": 0, "updated": None})
            continue
        for text in view.warnings():
            warn(text)
        out.append(
            {
                "run": view.url,
                "status": status(view),
                "step": view.step,
                "total_steps": view.total_steps,
                "updated": _last_progress(view),
            }
        )
    return out


# -- plot ---------------------------------------------------------------------------------------------
def plot(view: RunView, metrics: Sequence[str], path: str) -> list[str]:
    """Draw metrics over steps, rollbacks and snapshots marked, the abandoned rows of rolled-back
    steps in grey so a spike and its recovery show at a glance. Returns the metrics drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    abandoned = _read(Storage(view.url), ABANDONED, None, require_step=True)
    keys = [k for k in (metrics or PLOT_METRICS) if any(_numbers(r.get(k)) for r in view.rows)]
    if not metrics:  # the defaults that move, else those the run has
        moving = [k for k in keys if len({r[k] for r in view.rows if _numbers(r.get(k))}) > 1]
        keys = (moving or keys)[:4]
    if not keys:
        raise ConfigError(f"none of the metrics {', '.join(metrics or PLOT_METRICS)} is in {view.url}")
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.2 * len(keys)), sharex=True, squeeze=False)
    commits = [e["step"] for e in view.events_of("snapshot_committed") if isinstance(e.get("step"), int)]
    for ax, key in zip(axes[:, 0], keys):
        steps = [r["step"] for r in view.rows if isinstance(r.get(key), (int, float))]
        values = [r[key] for r in view.rows if isinstance(r.get(key), (int, float))]
        sparse = len(steps) < len(view.rows) / 2  # validation: every val_every steps, each point shown
        ax.plot(steps, values, lw=1.2, label=key, marker="o" if sparse else None, ms=3)
        gone = [r for r in abandoned if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if gone:
            ax.scatter([r["step"] for r in gone], [r[key] for r in gone], s=10, c="0.6", label="rolled back")
        for e in (e for e in view.events_of("rollback") if _numbers(e.get("to_step"), e.get("from_step"))):
            ax.axvspan(e["to_step"], e["from_step"], color="tab:red", alpha=0.12)
            ax.axvline(e["from_step"], color="tab:red", lw=0.8)
        for s in commits:
            ax.axvline(s, color="tab:green", lw=0.4, alpha=0.5)
        ax.set_ylabel(key, fontsize=8)
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("step (green: snapshots, red: rollbacks)")
    fig.suptitle(view.url, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return keys


def _numbers(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
