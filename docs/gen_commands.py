"""Write the synopsis and every command's options into docs/commands.md from the click commands
themselves (rlctl/cli.py's group and the modules of rlctl/commands/), around the page's hand-written prose.

    .venv/bin/python docs/gen_commands.py           # rewrite the generated blocks of the page
    .venv/bin/python docs/gen_commands.py --check   # exit 1 if the page differs from the commands

The blocks between the page's markers are never edited by hand: change an option or its help in
rlctl/commands/ and run this again. Loading the commands imports no torch, as `rlctl --help` does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from _generated import cell, check_main, fill

from rlctl.cli import COMMANDS, cli

PAGE = Path(__file__).resolve().parent / "commands.md"
SCRIPT, SOURCE = "gen_commands.py", "rlctl/commands/"
WIDTH = 110  # the synopsis wraps before this column

Command = tuple[str, click.Command, click.Context]  # (the words after rlctl, the command, its context)


def commands() -> list[Command]:
    """Every command and subcommand, in the order of rlctl/cli.py's COMMANDS and of each group's own."""
    root = click.Context(cli, info_name="rlctl")
    out: list[Command] = []

    def walk(path: str, cmd: click.Command, parent: click.Context) -> None:
        ctx = click.Context(cmd, info_name=path.rpartition(" ")[2], parent=parent)
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(f"{path} {name}", sub, ctx)
        else:
            out.append((path, cmd, ctx))

    for name in COMMANDS:
        walk(name, cli.get_command(root, name), root)
    return out


def params(cmd: click.Command, ctx: click.Context) -> list[click.Parameter]:
    """The command's arguments and options, as --help lists them, less --help itself."""
    return [p for p in cmd.get_params(ctx) if p is not cmd.get_help_option(ctx)]


def takes(option: click.Option, ctx: click.Context) -> str:
    """What an option takes, as --help names it: its metavar, or its choices as ``a|b|c``."""
    if isinstance(option.type, click.Choice) and option.metavar is None:
        return "|".join(map(str, option.type.choices))
    return option.make_metavar(ctx)


def usage(param: click.Parameter, ctx: click.Context) -> str:
    """One parameter in a synopsis: ``RUN_DIR``, ``[CONFIG]``, ``[--verify]``, ``[--set KEY=VALUE ...]``,
    ``--step N``."""
    if not isinstance(param, click.Option):
        return param.make_metavar(ctx)
    word = param.opts[0] if param.is_flag else f"{param.opts[0]} {takes(param, ctx)}"
    word += " ..." if param.multiple else ""
    return word if param.required else f"[{word}]"


def synopsis(path: str, cmd: click.Command, ctx: click.Context, width: int | None = None) -> str:
    """``rlctl PATH ARGUMENTS [OPTIONS]``, on one line, or wrapped before ``width`` with its continued
    lines indented past the command's name."""
    head = f"rlctl {path}"
    lines, line = [], head
    for item in (usage(p, ctx) for p in params(cmd, ctx)):
        if width and len(line) + 1 + len(item) > width and line.strip() != head:
            lines.append(line)
            line = " " * len(head)
        line += f" {item}"
    return "\n".join([*lines, line])


def row(option: click.Option, ctx: click.Context) -> str:
    """A row of the options table: the option, what it takes, its default and its help."""
    extra = option.get_help_extra(ctx)
    kind = "a flag" if option.is_flag else f"`{takes(option, ctx)}`"
    if "range" in extra:
        kind += f", {extra['range']}"
    if option.multiple:
        kind += ", repeatable"
    if "default" in extra:
        default = f"`{extra['default']}`"
    else:
        default = "required" if option.required else "off" if option.is_flag else ""
    for name in extra.get("envvars", ()):
        default += f", or `${name}` when set"
    names = ", ".join(f"`{name}`" for name in option.opts + option.secondary_opts)
    return f"| {names} | {cell(kind)} | {cell(default)} | {cell(option.help or '')} |"


def options(path: str, cmd: click.Command, ctx: click.Context) -> str:
    """A command's block, between blank lines (so that the markers around it end no table): its
    synopsis, then a table with one row per option."""
    rows = [row(p, ctx) for p in params(cmd, ctx) if isinstance(p, click.Option)]
    table = ["", "| option | takes | default | what it does |", "|---|---|---|---|", *rows] if rows else []
    return "\n".join(["", f"`{synopsis(path, cmd, ctx)}`", *table, ""]) + "\n"


def render(page: str) -> str:
    """``page`` with its synopsis and each command's options written from the commands."""
    found = commands()
    top = "\n".join(synopsis(path, cmd, ctx, WIDTH) for path, cmd, ctx in found)
    blocks = {"the synopsis": f"```\n{top}\n```\n"}
    blocks |= {f"the options of rlctl {path}": options(path, cmd, ctx) for path, cmd, ctx in found}
    return fill(page, blocks, SCRIPT, SOURCE, PAGE.name)


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, __doc__, PAGE, render, "the commands", SCRIPT)


if __name__ == "__main__":
    sys.exit(main())
