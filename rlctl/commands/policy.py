"""rlctl policy check FILE [FILE...] [--format table|json]"""

from __future__ import annotations

import click

from rlctl.commands.options import format_option


@click.group("policy")
def policy() -> None:
    """Rollback policies: check and explain policy files."""


@policy.command("check")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "--together",
    is_flag=True,
    help="Also check that the FILEs can be used together in one run (rule names unique across them).",
)
@format_option
def check(files: tuple[str, ...], together: bool, fmt: str) -> None:
    """Validate each policy FILE and explain its rules in plain words, one block per rule.

    A mistake is reported with the file, line and key (exit code 3).
    """
    import orjson

    from rlctl.policies.loader import load_policies, load_policy_file

    loaded = [(path, load_policy_file(path)) for path in files]
    if together:
        load_policies(files)
    if fmt == "json":
        docs = [
            {"file": path, **p.model_dump(mode="json", exclude={"rules": {"__all__": {"when"}}})} for path, p in loaded
        ]
        click.echo(orjson.dumps(docs, option=orjson.OPT_INDENT_2).decode())
        return
    for n, (path, p) in enumerate(loaded):
        if n:
            click.echo()
        count = f"{len(p.rules)} rule{'s' if len(p.rules) > 1 else ''}"
        click.echo(f"{path}: valid, {count}. {_words(p.description)}".rstrip())
        for rule in p.rules:
            click.echo(f"  {rule.describe()}")
            if rule.description:
                click.echo(f"    {_words(rule.description)}")


def _words(text: str) -> str:
    """Text on one line, runs of whitespace (YAML line breaks) made single spaces."""
    return " ".join(text.split())
