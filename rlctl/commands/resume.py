"""rlctl resume RUN_DIR [--from latest|last-good|step-N|N] [--set KEY=VALUE ...] [--force]"""

from __future__ import annotations

import click

from rlctl.commands.options import set_option
from rlctl.commands.progress import StepProgress


@click.command("resume")
@click.argument("run_dir")
@click.option(
    "--from",
    "from_",
    default="latest",
    show_default=True,
    help="latest, last-good, step-N or N. latest falls back to an older snapshot when the newest is "
    "corrupt; an explicit step never does.",
)
@set_option
@click.option("--force", is_flag=True, help="Take over a lease whose heartbeat is older than the timeout.")
def resume(run_dir: str, from_: str, overrides: tuple[str, ...], force: bool) -> None:
    """Restore a run from a snapshot and continue it to trainer.total_steps.

    Idempotent: a run that is already complete exits 0 without training, so a requeued Slurm job can
    always call `rlctl resume RUN --from latest`. Only safe keys may change with --set (total steps,
    lr, KL coefficient, ...); each change is recorded in events.jsonl.
    """
    from rlctl.run import resume_run

    with StepProgress(run_dir) as progress:
        summary = resume_run(run_dir, from_, list(overrides), force=force, reporter=progress)
    progress.print_summary(summary)
    click.echo(run_dir)
