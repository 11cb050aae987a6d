"""rlctl policy check FILE [FILE...] [--run RUN] [--strict] [--format table|json]
rlctl policy replay RUN [--policy FILE ...] [--format table|json|jsonl|csv]
rlctl policy calibrate RUN [--quantile Q] [--margin M] [--until STEP] > mine.yaml"""

from __future__ import annotations

import click

from rlctl.commands.options import format_choice, format_option, timeout_option
from rlctl.errors import ConfigError


@click.group("policy")
def policy() -> None:
    """Rollback policies: check and explain policy files, try them on a recorded run, and propose
    thresholds from a healthy one."""


@policy.command("check")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "--together",
    is_flag=True,
    help="Also check that the FILEs can be used together in one run (rule names unique across them).",
)
@click.option(
    "--run",
    "run_url",
    metavar="RUN",
    help="Check the metric names the rules read against this run's own keys instead of rlctl's catalogue.",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Metric names no run writes (or RUN never wrote) are an error (exit code 3), not a warning.",
)
@format_choice("table", "json")
def check(files: tuple[str, ...], together: bool, run_url: str | None, strict: bool, fmt: str) -> None:
    """Validate each policy FILE and explain its rules in plain words, one block per rule.

    A mistake is reported with the file, line and key (exit code 3). A rule that reads a metric no
    rlctl run writes (or, with --run, that RUN never wrote) is a warning on stderr with a "did you
    mean"; the exit code stays 0 unless --strict (then 3).
    """
    import orjson

    from rlctl.policies.loader import load_policies, load_policy_file

    loaded = [(path, load_policy_file(path)) for path in files]
    if together:
        load_policies(files)
    unknown = _warn_unknown_metrics(loaded, run_url)
    if fmt == "json":
        docs = [
            {"file": path, **p.model_dump(mode="json", exclude={"rules": {"__all__": {"when"}}})} for path, p in loaded
        ]
        click.echo(orjson.dumps(docs, option=orjson.OPT_INDENT_2).decode())
    else:
        _explain(loaded)
    if strict and unknown:
        where = f"run {run_url} never wrote" if run_url else "no rlctl run writes"
        names = f"{unknown} metric name{'s' if unknown > 1 else ''}"
        raise ConfigError(f"--strict: the rules read {names} that {where} (see the warnings above)")


def _explain(loaded) -> None:
    for n, (path, p) in enumerate(loaded):
        if n:
            click.echo()
        count = f"{len(p.rules)} rule{'s' if len(p.rules) > 1 else ''}"
        click.echo(f"{path}: valid, {count}. {_words(p.description)}".rstrip())
        for rule in p.rules:
            click.echo(f"  {rule.describe()}")
            if rule.description:
                click.echo(f"    {_words(rule.description)}")


def _warn_unknown_metrics(loaded, run_url: str | None) -> int:
    """Warn (stderr) about each metric name a rule reads that no run writes, or RUN never wrote; how many."""
    from rlctl.policies.catalogue import meaning, unknown_metrics

    keys = None
    if run_url is not None:
        from rlctl.rundir.replay import metric_keys, read_history

        keys = metric_keys(read_history(run_url, warn=lambda text: click.echo(text, err=True)))
    count = 0
    for path, p in loaded:
        for item in unknown_metrics(p.rules, keys):
            count += 1
            where = f"run {run_url} never wrote" if run_url else "no rlctl run writes"
            hint = f" (did you mean '{item.suggestion}'?)" if item.suggestion else ""
            if item.catalogued:
                hint = f" (rlctl writes it where the run's config asks for it: {meaning(item.metric)})"
            click.echo(f"warning: {path}: rule {item.rule} reads '{item.metric}', which {where}{hint}", err=True)
    return count


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _words(text: str) -> str:
    """Text on one line, runs of whitespace (YAML line breaks) made single spaces."""
    return " ".join(text.split())


@policy.command("replay")
@click.argument("run_url", metavar="RUN")
@click.option(
    "--policy",
    "files",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="A policy file (or ready-made name) to replay; repeatable. Default: the policies RUN ran under.",
)
@format_option
@timeout_option
def replay(run_url: str, files: tuple[str, ...], fmt: str, timeout: float) -> None:
    """Replay RUN's whole metric history (abandoned rows included, in the order they were written)
    through the policies, acting on nothing, and list where each rule would have fired and what it
    would have done. Replaying a run with the policy it ran under lists the firings of its events."""
    from rlctl.commands.render import emit
    from rlctl.rundir import replay as lib

    rules = lib.policy_rules(run_url, files, timeout)
    history = lib.read_history(run_url, warn=lambda text: click.echo(text, err=True), timeout=timeout)
    replayed = lib.replay(history, rules)
    turned = sum(1 for h in history if h.turned is not None)
    click.echo(
        f"replayed {len(history)} rows of {run_url} ({turned} abandoned) through {_count(len(rules), 'rule')}: "
        f"{_count(len(replayed), 'firing')}",
        err=True,
    )
    if fmt in ("json", "jsonl"):
        emit([], [r.record() for r in replayed], fmt)
        return
    columns = ["step", "rule", "trigger", "metric", "value", "limit", "actions", "count", "turned_away"]
    rows = [{**r.record(), "actions": _actions(r.firing)} for r in replayed]
    emit(columns, rows, fmt)
    if fmt == "table":
        click.echo()
        for line in _footer(lib.firing_counts(replayed, rules)):
            click.echo(line)


def _actions(firing) -> str:
    """What a firing would have done, short: ``rollback+adjust`` or ``halt (escalated)``."""
    text = "+".join(a.type for a in firing.actions)
    return f"{text} (escalated)" if firing.escalated else text


def _footer(steps: dict[str, list[int]]) -> list[str]:
    """Lines under the table: how often each rule fired and where, then the rules that never did."""
    lines = [
        f"{name}: fired {len(at)} time{'s' if len(at) > 1 else ''}, at step{'s' if len(at) > 1 else ''} "
        + ", ".join(map(str, at))
        for name, at in steps.items()
        if at
    ]
    never = [name for name, at in steps.items() if not at]
    if never:
        lines.append(f"never fired: {', '.join(never)}")
    return lines


@policy.command("calibrate")
@click.argument("run_url", metavar="RUN")
@click.option(
    "--quantile",
    type=click.FloatRange(0.5, 1.0),
    default=0.99,
    show_default=True,
    metavar="Q",
    help="The quantile of each metric an upper limit starts from (a floor: 1 - Q).",
)
@click.option(
    "--margin",
    type=click.FloatRange(min=0.0),
    default=0.5,
    show_default=True,
    metavar="M",
    help="How far past the quantile the limit goes, as a share of it (0.5: 1.5 x the quantile).",
)
@click.option(
    "--until",
    type=click.IntRange(min=0),
    metavar="STEP",
    help="Calibrate on the run's healthy prefix: steps up to STEP.",
)
@timeout_option
def calibrate(run_url: str, quantile: float, margin: float, until: int | None, timeout: float) -> None:
    """Propose a policy from a healthy RUN: limits for KL, a grad-norm spike, an entropy floor,
    repetition and the importance ratio, each commented with its evidence (quantile, max or min seen,
    over how many steps, how often it fires on RUN: never). The policy goes to stdout, a summary to
    stderr: rlctl policy calibrate RUN > mine.yaml"""
    from rlctl import calibrate as lib

    rows = lib.run_rows(run_url, until, warn=lambda text: click.echo(text, err=True), timeout=timeout)
    cal = lib.calibrate(rows, quantile, margin, run_url)
    click.echo(lib.render(cal), nl=False)
    for line in lib.summary_lines(cal):
        click.echo(line, err=True)
