"""rlctl resume RUN_DIR [--from latest|last-good|best|step-N|N] [--set KEY=VALUE ...] [--force] [--wait-for-lease]"""

from __future__ import annotations

import click

from rlctl.commands.options import SNAPSHOT, set_option, step_spec, wait_for_lease_option
from rlctl.ranks.stops import stops_from_the_start


@click.command("resume")
@click.argument("run_dir")
@click.option(
    "--from",
    "from_",
    callback=step_spec,
    default="latest",
    show_default=True,
    metavar=SNAPSHOT,
    help="latest, last-good, best, step-N or N. latest falls back to an older snapshot when the newest is "
    "corrupt; an explicit step never does. best: the good snapshot with the best validation metric "
    "(checkpoint.keep_best's, else the highest val/score/mean).",
)
@set_option
@click.option("--force", is_flag=True, help="Take over a lease whose heartbeat is older than the timeout.")
@wait_for_lease_option
def resume(run_dir: str, from_: str, overrides: tuple[str, ...], force: bool, wait_for_lease: bool) -> None:
    """Restore a run from a snapshot and continue it to trainer.total_steps.

    Idempotent: a run that is already complete exits 0 without training, so a requeued Slurm job can
    always call `rlctl resume RUN --from latest`. Only safe keys may change with --set (total steps,
    lr, KL coefficient, ...); each change is recorded in events.jsonl. A run that never committed a
    snapshot starts over from step 0 (its rows move to metrics.abandoned.jsonl); one whose snapshots were
    committed but none is usable exits 11. A SIGTERM or SIGUSR1 at any moment ends it with exit 75.
    """
    with stops_from_the_start():
        _resume(run_dir, from_, overrides, force, wait_for_lease)


def _resume(run_dir: str, from_: str, overrides: tuple[str, ...], force: bool, wait_for_lease: bool) -> None:
    from rlctl.commands.progress import StepProgress
    from rlctl.run import resume_run, resume_snapshot_writer_early

    resume_snapshot_writer_early(run_dir, list(overrides))  # it imports torch beside this process
    with StepProgress(run_dir) as progress:
        summary = resume_run(
            run_dir, from_, list(overrides), force=force, wait_for_lease=wait_for_lease, reporter=progress
        )
    progress.print_summary(summary)
    click.echo(run_dir)
