"""rlctl checkpoints RUN_DIR [--format table|json] [--verify]"""

from __future__ import annotations

import click
import orjson

from rlctl.commands.options import format_option


@click.command("checkpoints")
@click.argument("run_dir")
@format_option
@click.option("--verify", is_flag=True, help="Also check every file's sha256 (reads every byte).")
def checkpoints(run_dir: str, fmt: str, verify: bool) -> None:
    """List a run's snapshots: step, time, size, committed, good, and why one is not usable."""
    from rlctl.storage import Storage
    from rlctl.run import load_run_config, snapshot_manager

    run = Storage(run_dir)
    infos = snapshot_manager(run, load_run_config(run)).scan(deep=verify)
    rows = [i.as_row() for i in infos]
    if fmt == "json":
        click.echo(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("step", "time", "size", "committed", "good", "problem", box=None)
    for r in rows:
        size = f"{r['bytes'] / 2**20:.1f} MiB" if r["bytes"] is not None else "-"
        table.add_row(str(r["step"]), r["time"] or "-", size, "yes" if r["committed"] else "no",
                      "yes" if r["good"] else "no", r["problem"] or "")  # fmt: skip
    Console(soft_wrap=True).print(table)
