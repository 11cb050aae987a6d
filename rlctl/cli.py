"""The ``rlctl`` command group.

Commands are loaded lazily: ``rlctl --help`` imports neither torch, DeepSpeed nor transformers, and a
command module is imported only when that command runs (or its own ``--help`` is asked for; the command
modules themselves import nothing heavy at module level).
"""

from __future__ import annotations

import importlib
import sys

import click

from rlctl import __version__
from rlctl.errors import ExitCode, RlctlError
from rlctl.ranks.stops import STOPS, Stopped

# name -> (module, attribute, one-line help shown by `rlctl --help` without importing the module)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "start": ("rlctl.commands.start", "start", "Start a new run from a YAML config (or the built-in demo)."),
    "resume": ("rlctl.commands.resume", "resume", "Continue a run from a snapshot (latest, last-good, best, step-N)."),
    "checkpoints": ("rlctl.commands.checkpoints", "checkpoints", "List a run's snapshots and whether each is usable."),
    "export": ("rlctl.commands.export", "export", "Write a snapshot as a Hugging Face model directory."),
    "policy": ("rlctl.commands.policy", "policy", "Check, replay and calibrate rollback policies."),
    "inspect": ("rlctl.commands.inspect", "inspect", "Show a run: summary, metric dumps, events, plots, --check."),
    "runs": ("rlctl.commands.runs", "runs", "List the runs under a directory with their status."),
    "trajectories": (
        "rlctl.commands.trajectories",
        "trajectories",
        "Show a multi-turn run's conversations of a step: turns, tool calls, trained tokens.",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rlctl")
def cli() -> None:
    """Resumable GRPO/PPO fine-tuning of language models on DeepSpeed ZeRO.

    Data goes to stdout, logs and progress to stderr. Exit codes are listed in the README.
    """


def main(argv: list[str] | None = None) -> None:
    """Run a command: a domain error is one sentence on stderr and its exit code (README), never a
    traceback; a stop signal before a run began is exit 75, Ctrl-C 130."""
    try:
        cli.main(args=argv, prog_name="rlctl", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):  # click turns Ctrl-C into Abort
        click.echo("Interrupted.", err=True)
        sys.exit(int(ExitCode.INTERRUPTED))
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except RlctlError as exc:
        click.echo(f"Error: {exc.message}", err=True)
        sys.exit(int(exc.exit_code))
    except Stopped as exc:  # before a run directory was taken: nothing to record
        _stopped(exc.signal_name)
    except Exception as exc:
        if STOPS.early is not None:  # a stop raised inside third-party start-up code, as its own error
            _stopped(STOPS.early)
        if not isinstance(exc, OSError):
            raise  # a bug in rlctl: the traceback is printed (exit 1)
        # storage that cannot be reached, read or written: the environment, not a bug in rlctl
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        click.echo(f"Error: storage error{where}: {exc.strerror or exc}", err=True)
        sys.exit(int(ExitCode.STORAGE))
    sys.exit(int(ExitCode.OK))


def _stopped(signal_name: str) -> None:
    click.echo(f"Error: stopped by {signal_name} before the run began; run the same command again", err=True)
    sys.exit(int(ExitCode.PREEMPTED))
