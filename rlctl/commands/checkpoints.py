"""rlctl checkpoints RUN_DIR [--format table|json|jsonl|csv] [--verify]"""

from __future__ import annotations

import click

from rlctl.commands.options import format_option, timeout_option
from rlctl.commands.render import emit

COLUMNS = ["step", "name", "time", "bytes", "committed", "good", "usable", "problem"]


@click.command("checkpoints")
@click.argument("run_dir")
@format_option
@click.option("--verify", is_flag=True, help="Also check every file's sha256 (reads every byte).")
@timeout_option
def checkpoints(run_dir: str, fmt: str, verify: bool, timeout: float) -> None:
    """List a run's snapshots: step, time, size, committed, good, the validation metric they record
    (checkpoint.keep_best's, else val/score/mean when a snapshot records it), and why one is not usable."""
    from rlctl.rundir.directory import load_run_config
    from rlctl.rundir.snapshots import snapshot_catalog
    from rlctl.storage import Storage

    run = Storage.for_reading(run_dir, timeout)
    catalog = snapshot_catalog(run, load_run_config(run))
    infos = catalog.scan(deep=verify)
    metric = catalog.best_rule.metric
    if catalog.keep_best is None and all(i.val_metric(metric) is None for i in infos):
        metric = None  # no column for a metric nobody asked for and no snapshot records
    rows = [i.as_row(metric) for i in infos]
    if fmt != "table":
        emit(COLUMNS + ([metric, "val_step"] if metric else []), rows, fmt)
        return
    for r in rows:
        r["size"] = f"{r['bytes'] / 2**20:.1f} MiB" if r["bytes"] is not None else "-"
        r["time"] = r["time"] or "-"
        r["committed"], r["good"] = ("yes" if r["committed"] else "no"), ("yes" if r["good"] else "no")
        if metric:
            r[metric] = "-" if r[metric] is None else r[metric]
    emit(["step", "time", "size", "committed", "good", *([metric] if metric else []), "problem"], rows, "table")
