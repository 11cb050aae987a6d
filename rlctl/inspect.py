"""What `rlctl inspect` and `rlctl runs` do with a run read back (``rlctl.rundir.record``; its summary:
``rlctl.rundir.summary``): metric selections, health checks for cron, the runs under a root, plots.

Everything here reads files through fsspec (local, s3://, memory://) and never imports torch: cron and
Slurm scripts call it every few minutes. Every file read back may be malformed: a line of metrics.jsonl
or events.jsonl that cannot be read (a crash mid-write, a hand edit) is skipped and reported once per
file, never fatal; a config.yaml that cannot be read is a sentence naming it.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Iterable, Sequence
from typing import Any

from rlctl.errors import ConfigError
from rlctl.events import HALTED, NODE_LOST, POLICY, ROLLBACK, SNAPSHOT_COMMITTED, SNAPSHOT_FAILED
from rlctl.numbers import is_number
from rlctl.rundir.layout import CONFIG
from rlctl.rundir.record import RunRecord
from rlctl.storage import Storage

# what --plot draws unless told: the first four of these that the run has and that ever move
PLOT_METRICS = (
    "critic/score/mean",
    "val/score/mean",
    "actor/grad_norm",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/kl_loss",
)


def open_run(url: str, timeout: float | None = None) -> RunRecord:
    """The run as inspect shows it: its config, metric rows and events read at once (a config that
    cannot be read is a sentence naming it; the lines that cannot be read are its ``warnings()``).
    ``timeout``: a read-only command's bound on storage that does not answer (``Storage.for_reading``);
    None: the default retry budget."""
    run = Storage(url) if timeout is None else Storage.for_reading(url, timeout)
    record = RunRecord(run)  # (the config is read first: a storage failure is said reading it)
    _ = record.config, record.rows, record.events  # read now: a bad config fails first, warnings come first
    return record


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


def check_patterns(view: RunRecord, patterns: Sequence[str]) -> None:
    """A ConfigError naming the first of ``patterns`` (--metrics) that matches no metric key of the run's
    rows, with the nearest key; a run that wrote no row yet is not checked (it has no keys to match)."""
    keys = sorted(set().union(*view.rows))
    for pattern in patterns:
        if keys and not any(fnmatch.fnmatchcase(k, pattern) for k in keys):
            from rlctl.yamlsrc import did_you_mean  # (an error's only: pydantic comes with it)

            raise ConfigError(f"--metrics '{pattern}' matches no metric of {view.url}{did_you_mean(pattern, keys)}")


# -- health check for cron ----------------------------------------------------------------------------
CHECK_CODES = {
    "healthy": 0,
    "warning": 41,
    "halted": 42,
    "crashed": 43,
    "stale": 44,
    "preempted": 45,
    "interrupted": 46,
    "node_lost": 47,
}


def check(view: RunRecord, window: int = 100, stale_after: float = 1800.0, rules=None, now=None) -> tuple[str, str]:
    """(verdict, one line). halted, crashed, preempted, interrupted and node_lost come from the run's
    state; stale is a run that claims to be running (live lease) but wrote no step for ``stale_after`` seconds;
    warning is a snapshot that failed with none committed since, or a policy that fired within the
    last ``window`` steps, in the run or, with ``rules`` (a policy file), when the run's history is
    replayed through them (``replayed_events``: what `rlctl policy replay` lists)."""
    now = time.time() if now is None else now
    state = view.status()
    where = f"step {view.step}/{view.total_steps}"
    mode, _, stale = view.rollout
    if mode != "sync":  # an overlapped rollout: its mode and how stale the last batch was
        where += f" ({mode}" + (f", staleness {stale:g})" if stale is not None else ")")
    if state == "halted":
        halt = view.events_of(HALTED)[-1]
        return "halted", f"HALTED {view.url} at step {halt.get('step')} by policy rule '{halt.get('rule')}'"
    if state == "crashed":
        return "crashed", f"CRASHED {view.url} at {where}: no live writer and no clean end"
    if state == "preempted":
        return "preempted", f"PREEMPTED {view.url} at {where}: resume it"
    if state == "interrupted":
        return "interrupted", f"INTERRUPTED {view.url} at {where} (Ctrl-C): resume it"
    if state == "node_lost":
        nodes = ", ".join(f"{n.get('ip')} (id {str(n.get('id'))[:12]})" for n in view.events_of(NODE_LOST)[-1]["nodes"])
        return "node_lost", f"NODE LOST {view.url} at {where}: Ray node {nodes} was lost; resume it on healthy nodes"
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
    fired = [e for e in view.events_of(POLICY) if e.get("step", 0) > view.step - window]
    if rules:
        fired += [e for e in replayed_events(view, rules) if e["step"] > view.step - window]
    if fired:
        f = fired[-1]
        return "warning", f"WARNING {view.url} at {where}: rule '{f.get('rule')}' fired at step {f.get('step')}"
    return "healthy", f"OK {view.url} {state} at {where}"


def failed_snapshot(view: RunRecord) -> dict[str, Any] | None:
    """The newest ``snapshot_failed`` event when no snapshot was committed after it, else None."""
    for event in reversed(view.events):
        if event.get("event") == SNAPSHOT_COMMITTED:
            return None
        if event.get("event") == SNAPSHOT_FAILED:
            return event
    return None


def _last_progress(view: RunRecord) -> float | None:
    stamp = view.rows[-1].get("timestamp") if view.rows else None
    return float(stamp) if is_number(stamp) else None


def replayed_events(view: RunRecord, rules) -> list[dict[str, Any]]:
    """The firings of ``rules`` over the run's whole history, as `rlctl policy replay` finds them
    (rollbacks and resumes included), as events.jsonl would hold them, in the order written."""
    from rlctl.rundir.replay import replay  # (the policies load only when a policy is named)

    return [item.firing.as_event() for item in replay(view.history, rules)]


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
def list_runs(root: str, warn=None, timeout: float | None = None) -> list[dict[str, Any]]:
    """The runs directly under ``root`` with their status; a run whose config cannot be read is listed
    as ``unreadable``. ``warn`` receives one sentence per unreadable run or file; ``timeout`` as for
    ``open_run``."""
    base = Storage(root) if timeout is None else Storage.for_reading(root, timeout)
    warn = warn or (lambda text: None)
    out = []
    for name in base.listdir():
        if not base.exists(name, CONFIG):
            continue
        try:
            view = open_run(base.url_of(name), timeout)
        except ConfigError as exc:
            warn(f"warning: {exc.message}")
            out.append({"run": base.url_of(name), "status": "unreadable", "step": 0, "total_steps": 0, "updated": None})
            continue
        for text in view.warnings():
            warn(text)
        out.append(
            {
                "run": view.url,
                "status": view.status(),
                "step": view.step,
                "total_steps": view.total_steps,
                "updated": _last_progress(view),
            }
        )
    return out


# -- plot ---------------------------------------------------------------------------------------------
def plot(view: RunRecord, metrics: Sequence[str], path: str) -> list[str]:
    """Draw metrics over steps, rollbacks and snapshots marked, the abandoned rows of rolled-back
    steps in grey so a spike and its recovery show at a glance. Returns the metrics drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in (metrics or PLOT_METRICS) if any(is_number(r.get(k)) for r in view.rows)]
    if not metrics:  # the defaults that move, else those the run has
        moving = [k for k in keys if len({r[k] for r in view.rows if is_number(r.get(k))}) > 1]
        keys = (moving or keys)[:4]
    if not keys:
        raise ConfigError(f"none of the metrics {', '.join(metrics or PLOT_METRICS)} is in {view.url}")
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.2 * len(keys)), sharex=True, squeeze=False)
    commits = [e["step"] for e in view.events_of(SNAPSHOT_COMMITTED) if isinstance(e.get("step"), int)]
    for ax, key in zip(axes[:, 0], keys):
        steps = [r["step"] for r in view.rows if is_number(r.get(key))]
        values = [r[key] for r in view.rows if is_number(r.get(key))]
        sparse = len(steps) < len(view.rows) / 2  # validation: every val_every steps, each point shown
        ax.plot(steps, values, lw=1.2, label=key, marker="o" if sparse else None, ms=3)
        gone = [r for r in view.abandoned if is_number(r.get(key), finite=True)]
        if gone:
            ax.scatter([r["step"] for r in gone], [r[key] for r in gone], s=10, c="0.6", label="rolled back")
        for e in (e for e in view.events_of(ROLLBACK) if is_number(e.get("to_step")) and is_number(e.get("from_step"))):
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
