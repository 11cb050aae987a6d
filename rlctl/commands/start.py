"""rlctl start [CONFIG] [--run-dir DIR] [--set KEY=VALUE ...] [--wait-for-lease]"""

from __future__ import annotations

import time

import click

from rlctl.commands.options import set_option, wait_for_lease_option
from rlctl.ranks.stops import stops_from_the_start


@click.command("start")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--run-dir",
    metavar="DIR",
    help="Where the run lives: a path or any fsspec URL (default: runs/<name>-<timestamp>). "
    "Must not hold a run already.",
)
@click.option("--nproc", type=click.IntRange(min=1), metavar="N", help="DeepSpeed ranks to run (sets trainer.nproc).")
@click.option(
    "--ray-address",
    metavar="ADDR|local",
    help="Run the ranks as Ray actors on this cluster (sets cluster.backend=ray and cluster.address; "
    "'local' starts a Ray instance here).",
)
@set_option
@wait_for_lease_option
def start(
    config: str | None,
    run_dir: str | None,
    nproc: int | None,
    ray_address: str | None,
    overrides: tuple[str, ...],
    wait_for_lease: bool,
) -> None:
    """Start a new run from CONFIG (a YAML file holding what differs from the defaults), from the
    built-in task when CONFIG is omitted, or from the showcase with `rlctl start demo` (validation,
    snapshots, the default policy and a NaN it recovers from, in about a minute).

    Prints the run directory on stdout when the run completes; progress and the summary go to stderr.
    A SIGTERM or SIGUSR1 at any moment ends it with exit 75 (resume it); a start that failed before its
    first step can be run again into the same --run-dir.
    """
    with stops_from_the_start():
        _start(config, run_dir, nproc, ray_address, overrides, wait_for_lease)


def _start(
    config: str | None,
    run_dir: str | None,
    nproc: int | None,
    ray_address: str | None,
    overrides: tuple[str, ...],
    wait_for_lease: bool = False,
) -> None:
    from rlctl.commands.progress import StepProgress
    from rlctl.config import load_config
    from rlctl.run import start_run, start_snapshot_writer_early

    flags = [f"trainer.nproc={nproc}"] if nproc else []
    if ray_address:
        flags.append("cluster.backend=ray")
        if ray_address != "local":
            flags.append(f"cluster.address={ray_address}")
    cfg = load_config(config, flags + list(overrides))
    run_dir = run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    start_snapshot_writer_early(cfg, run_dir)  # it imports torch beside this process, which does so next
    from rlctl.preflight import check_config_names

    check_config_names(cfg)  # a missing file the config names is told as a mistake in it, before any progress line
    with StepProgress(run_dir) as progress:
        summary = start_run(cfg, run_dir, reporter=progress, wait_for_lease=wait_for_lease)
    progress.print_summary(summary)
    click.echo(run_dir)
