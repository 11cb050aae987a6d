"""rlctl runs [ROOT] [--format table|json|jsonl|csv]"""

from __future__ import annotations

import time

import click

from rlctl.commands.options import format_option, timeout_option
from rlctl.commands.render import emit

COLUMNS = ["run", "status", "step", "total_steps", "updated"]


@click.command("runs")
@click.argument("root", default="runs")
@format_option
@timeout_option
def runs(root: str, fmt: str, timeout: float) -> None:
    """List the runs under ROOT (a path or fsspec URL; default: runs) with their status."""
    from rlctl.inspect import list_runs

    rows = list_runs(root, warn=lambda text: click.echo(text, err=True), timeout=timeout)
    if fmt != "table":
        emit(COLUMNS, rows, fmt)
        return
    for r in rows:
        r["step"] = f"{r['step']}/{r.pop('total_steps')}"
        r["updated"] = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["updated"])) if r["updated"] else ""
    emit(["run", "status", "step", "updated"], rows, "table")
