"""rlctl trajectories RUN_DIR --step N [--index I] [--format text|json]"""

from __future__ import annotations

from typing import Any

import click

from rlctl.commands.options import timeout_option


@click.command("trajectories")
@click.argument("run_dir")
@click.option("--step", type=click.IntRange(min=1), required=True, metavar="N", help="The training step to show.")
@click.option(
    "--index", type=click.IntRange(min=0), metavar="I", help="Only the I-th conversation of the step (from 0)."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text for people; json (a list of conversations) for scripts.",
)
@timeout_option
def trajectories(run_dir: str, step: int, index: int | None, fmt: str, timeout: float) -> None:
    """Show a multi-turn run's conversations of one step, turn by turn: which tokens were trained on (the
    model's own) and which not (the tools' answers, the template's), the tool calls with their
    arguments, outcomes and answers, the score, and whether an infrastructure failure masked it."""
    import orjson

    from rlctl.rundir.layout import CONFIG, not_a_run
    from rlctl.rundir.trajectories import read_step, recorded_steps
    from rlctl.storage import Storage

    run = Storage.for_reading(run_dir, timeout)
    if not run.exists(CONFIG):
        raise not_a_run(run.url)
    rows = read_step(run, step)
    if not rows:
        steps = recorded_steps(run)
        have = f"steps {steps[0]}-{steps[-1]} have" if steps else "no step has (a multi-turn run's steps do)"
        raise click.BadParameter(f"no conversations were recorded for step {step}; {have}", param_hint="'--step'")
    if index is not None:
        if index >= len(rows):
            raise click.BadParameter(
                f"step {step} has {len(rows)} conversations (0-{len(rows) - 1})", param_hint="'--index'"
            )
        rows = [rows[index]]
    if fmt == "json":
        click.echo(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    for i, row in enumerate(rows):
        click.echo(("\n" if i else "") + _text(row))


def _text(row: dict[str, Any]) -> str:
    """One conversation for a person in a terminal."""
    head = (
        f"== step {row.get('step')} · prompt {row.get('prompt_index')} · sample {row.get('sample_index')} · "
        f"rank {row.get('rank')} · score {row.get('score')} · {row.get('turns')} turn(s) =="
    )
    lines = [head, f"prompt: {row.get('prompt')}"]
    if row.get("masked"):
        lines.append("masked: an infrastructure failure (a timeout, an unavailable tool); nothing of it was trained")
    for seg in row["segments"]:
        kind = (
            "model, trained"
            if seg.get("trained")
            else ("model, not trained" if seg.get("by") == "model" else "tools and template, not trained")
        )
        lines.append(f"[{kind}, {seg.get('tokens')} tokens]")
        lines += ["  " + line for line in str(seg.get("text", "")).split("\n")]
    for call in row.get("calls") or []:
        args = _json(call.get("arguments"))
        reward = f" (reward {call['reward']})" if "reward" in call else ""  # an environment's step
        lines.append(
            f"call (turn {call.get('turn')}): {call.get('name')}({args}) -> {call.get('outcome')}: "
            f"{call.get('answer')}{reward}"
        )
    if row.get("drift_at") is not None:
        lines.append(f"template drift: the whole rendering differs from the ids at token {row['drift_at']}")
    return "\n".join(lines)


def _json(value: Any) -> str:
    import orjson

    return "" if value is None else orjson.dumps(value).decode()
