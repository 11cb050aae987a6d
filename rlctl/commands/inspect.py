"""rlctl inspect RUN_DIR [...]: summary, metric and event dumps, --follow, --plot, --check."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from rlctl.commands.options import format_option, timeout_option
from rlctl.commands.render import cell, emit, emit_document
from rlctl.errors import ConfigError


@click.command("inspect")
@click.argument("run_dir")
@click.option(
    "--metrics", "patterns", metavar="GLOBS", help="Comma-separated metric names or globs: 'actor/*,critic/score/mean'."
)
@click.option("--last", type=int, metavar="N", help="Only the last N rows.")
@click.option("--since-step", "since", type=int, metavar="N", help="Rows from this step on.")
@click.option("--until-step", "until", type=int, metavar="N", help="Rows up to this step.")
@click.option("--every", type=click.IntRange(min=1), metavar="K", help="Every K-th step.")
@format_option
@click.option("--events", is_flag=True, help="List events: snapshots, resumes, policy firings, rollbacks ...")
@click.option("--follow", is_flag=True, help="Stream new rows as the run writes them, until it ends.")
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False), metavar="FILE.png", help="Draw the metrics to FILE.png."
)
@click.option("--check", is_flag=True, help="One line and an exit code for cron (see the README).")
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    metavar="N",
    help="--check: a policy firing within this many steps is a warning.",
)
@click.option(
    "--stale-after",
    default="30m",
    show_default=True,
    metavar="DURATION",
    help="--check: a running run with no new step for this long is stale.",
)
@click.option(
    "--policy",
    "policy_file",
    type=click.Path(dir_okay=False),
    help="--check: also replay the run through this policy file, as `rlctl policy replay` does; "
    "a firing within --window steps is a warning.",
)
@timeout_option
def inspect(
    run_dir,
    patterns,
    last,
    since,
    until,
    every,
    fmt,
    events,
    follow,
    plot_path,
    check,
    window,
    stale_after,
    policy_file,
    timeout,
):
    """Show a run: a summary by default; metric rows with --metrics/--last/--since-step/--until-step/
    --every; --events; --follow; --plot FILE.png; --check for cron. Data goes to stdout only."""
    from rlctl import inspect as lib

    view = lib.open_run(run_dir, timeout)
    for warning in view.warnings():
        click.echo(warning, err=True)
    globs = [p.strip() for p in (patterns or "").split(",") if p.strip()]
    if check:
        check_run(view, window, stale_after, policy_file)
    if globs and not follow:
        lib.check_patterns(view, globs)
    if plot_path:
        drawn = lib.plot(view, globs and lib.select(view.rows, globs)[0][1:], plot_path)
        click.echo(f"drew {', '.join(drawn)}", err=True)
        click.echo(plot_path)
        return
    if events:
        emit(["time", "event", "step", "details"], [event_row(e) for e in view.events], fmt)
        return
    if follow:
        follow_rows(run_dir, globs, fmt, timeout)
        return
    if globs or last is not None or since is not None or until is not None or every:
        columns, rows = lib.select(view.rows, globs, last=last, since=since, until=until, every=every)
        emit(columns, rows, fmt)
        return
    from rlctl.rundir.summary import state_summary

    summary = state_summary(view)
    if fmt == "table":
        print_summary(summary)
    elif fmt in ("json", "jsonl"):
        emit_document(summary, fmt)
    else:
        raise ConfigError("--format csv needs rows: add --metrics, --last or --events")


def check_run(view, window: int, stale_after: str, policy_file: str | None) -> None:
    """--check: one line for cron, and the verdict's exit code."""
    from rlctl import inspect as lib

    rules = None
    if policy_file:
        from rlctl.policies import load_policies

        rules = load_policies([policy_file])
    verdict, line = lib.check(view, window, lib.parse_duration(stale_after), rules)
    click.echo(line)
    sys.exit(lib.CHECK_CODES[verdict])


def event_row(event: dict[str, Any]) -> dict[str, Any]:
    """An event as time, event, step and the rest as details."""
    details = {k: v for k, v in event.items() if k not in ("time", "event", "step")}
    return {"time": event.get("time"), "event": event.get("event"), "step": event.get("step"), "details": details}


def print_summary(s: dict[str, Any]) -> None:
    lines = [
        ("run", s["run"]),
        ("status", s["status"]),
        ("step", f"{s['step']} / {s['total_steps']}"),
        ("rollout", _rollout(s["rollout"])),
        ("snapshot", f"{_opt(s['last_snapshot'])} (last good: {_opt(s['last_good_snapshot'])})"),
        (
            "rollbacks",
            f"{s['rollbacks']}   policy firings: {s['policy_firings']}   skipped batches: "
            f"{s['skipped_batches']}, prompts: {s['skipped_prompts']}",
        ),
    ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        click.echo(f"{key.ljust(width)}  {value}")
    if s["metrics"]:
        click.echo("")
        mw = max(len(k) for k in s["metrics"])
        click.echo(f"{'metric'.ljust(mw)}  {'latest':>10}  trend")
        for key, m in s["metrics"].items():
            click.echo(f"{key.ljust(mw)}  {cell(m['latest']):>10}  {m['trend']}")


def _rollout(r: dict[str, Any]) -> str:
    stale = f", staleness {r['staleness']:g} at the last step" if r["staleness"] is not None else ""
    return f"{r['mode']} on {r['backend']}{stale}"


def _opt(step: int | None) -> str:
    return "none" if step is None else f"step {step}"


def follow_rows(run_dir: str, globs: list[str], fmt: str, timeout: float, interval: float = 1.0) -> None:
    """Print rows as they arrive; return when the run is no longer running and nothing new came (each
    reading gives up on storage that does not answer after ``timeout`` seconds)."""
    from rlctl import inspect as lib

    printed, header = 0, True
    columns: list[str] | None = None
    while True:
        view = lib.open_run(run_dir, timeout)
        fresh = [r for r in view.rows if r.get("step", 0) > printed]
        if fresh:
            cols, rows = lib.select(fresh, globs)
            columns = columns or cols
            emit(columns, rows, "jsonl" if fmt == "json" else fmt, header=header)
            header = False
            printed = fresh[-1]["step"]
        elif view.status() != "running":
            return
        time.sleep(interval)
