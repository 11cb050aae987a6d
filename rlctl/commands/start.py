"""rlctl start [CONFIG] [--run-dir DIR] [--set KEY=VALUE ...]"""

from __future__ import annotations

import time
from pathlib import Path

import click

from rlctl.commands.progress import StepProgress


@click.command("start")
@click.argument("config", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the run lives (default: runs/<name>-<timestamp>). Must not hold a run already.",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config key; the value is read as YAML (--set actor.lr=5e-5). Repeatable.",
)
def start(config: Path | None, run_dir: Path | None, overrides: tuple[str, ...]) -> None:
    """Start a new run from CONFIG (a YAML file holding what differs from the defaults), or from the
    built-in demo when CONFIG is omitted.

    Prints the run directory on stdout when the run completes; progress and the summary go to stderr.
    """
    from rlctl.config import load_config
    from rlctl.run import create_run_dir, run_summary

    cfg = load_config(config, list(overrides))
    if run_dir is None:
        run_dir = Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    create_run_dir(run_dir, cfg)

    from rlctl.engine.trainer import Trainer  # heavy: torch, DeepSpeed, transformers

    with StepProgress(cfg.trainer.total_steps, run_dir) as progress:
        trainer = Trainer(cfg, run_dir, on_step=progress.update)
        progress.begin()
        trainer.train()
    progress.print_summary(run_summary(run_dir))
    click.echo(str(run_dir))
