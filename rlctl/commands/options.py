"""Options shared by several commands, defined once."""

from __future__ import annotations

import click

from rlctl.commands.render import FORMATS

set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config key; the value is read as YAML (--set actor.lr=5e-5). Repeatable.",
)

wait_for_lease_option = click.option(
    "--wait-for-lease",
    is_flag=True,
    help="When another host holds the run's lease with a recent heartbeat, wait for it to go stale (at most "
    "trainer.lease_timeout) and take it over, rather than exit 10 at once. For schedulers that restart a "
    "run elsewhere (a lease of an earlier run of the same Slurm job is taken over without it).",
)


def format_choice(*formats: str):
    """The --format option of a command that prints ``formats`` (table first: the default)."""
    scripts = [f for f in formats if f != "table"]
    for_scripts = f"{', '.join(scripts[:-1])} or {scripts[-1]}" if len(scripts) > 1 else scripts[0]
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(formats),
        default="table",
        show_default=True,
        help=f"table for people; {for_scripts} for scripts.",
    )


format_option = format_choice(*FORMATS)


SNAPSHOT = "latest|last-good|best|step-N|N"  # what a snapshot option (--from, export's --step) takes


def step_spec(_ctx, _param, value: str) -> str:
    """A snapshot option (--from, export's --step): a usage error (exit 2) unless latest, last-good,
    best, step-N or N."""
    from rlctl.checkpoint.catalog import SPEC_WORDS, parse_step_spec
    from rlctl.errors import SnapshotError

    try:
        parse_step_spec(value)
    except SnapshotError:
        raise click.BadParameter(f"expected {SPEC_WORDS}; got {value!r}") from None
    return value


READ_TIMEOUT = 10.0  # seconds: a read-only command's default --timeout

timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=READ_TIMEOUT,
    show_default=True,
    envvar="RLCTL_RETRY_TIMEOUT",  # (rlctl.storage.RETRY_TIMEOUT_ENV, not imported: --help stays light)
    show_envvar=True,
    metavar="SECONDS",
    help="Give up on storage that does not answer after about this long (exit 12): the retries of a failing "
    "read, and each object-store request's connect and read. Training keeps checkpoint.retry_timeout.",
)
