"""rlctl start [CONFIG] [--run-dir DIR] [--set KEY=VALUE ...]"""

from __future__ import annotations

import time

import click

from rlctl.commands.options import set_option
from rlctl.commands.progress import StepProgress


@click.command("start")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--run-dir",
    help="Where the run lives: a path or any fsspec URL (default: runs/<name>-<timestamp>). "
    "Must not hold a run already.",
)
@set_option
def start(config: str | None, run_dir: str | None, overrides: tuple[str, ...]) -> None:
    """Start a new run from CONFIG (a YAML file holding what differs from the defaults), or from the
    built-in demo when CONFIG is omitted.

    Prints the run directory on stdout when the run completes; progress and the summary go to stderr.
    """
    from rlctl.config import load_config
    from rlctl.run import start_run

    cfg = load_config(config, list(overrides))
    run_dir = run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    with StepProgress(run_dir) as progress:
        summary = start_run(cfg, run_dir, reporter=progress)
    progress.print_summary(summary)
    click.echo(run_dir)
