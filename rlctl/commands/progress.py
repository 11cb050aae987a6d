"""Progress, notes and the end-of-run summary on stderr (rich). stdout stays clean for data.

On a terminal a live bar shows step, reward and KL; in a log file (Slurm, cron, CI) the same facts are
written as plain lines, about twenty per run, instead of bar redraws.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class StepProgress:
    """A ``rlctl.ranks.report.Reporter`` that draws on stderr."""

    def __init__(self, run_dir: str):
        self.console = Console(stderr=True)
        self.run_dir = run_dir
        self.live = self.console.is_terminal
        self.total = 0
        self.every = 1
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.live,
        )
        self.task = None

    def __enter__(self) -> StepProgress:
        self.console.print(f"[dim]run directory: {self.run_dir}[/dim]")
        self.console.print("[dim]loading model, data and DeepSpeed engine...[/dim]")
        return self

    def ready(self, step: int, total: int) -> None:
        self.total, self.every = total, max(1, total // 20)
        if step:
            self.console.print(f"[dim]continuing from step {step} of {total}[/dim]")
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=step, info="")

    def step(self, row: dict[str, Any]) -> None:
        info = (
            f"reward {_num(row.get('critic/score/mean'), '.3f')}  "
            f"kl {_num(row.get('actor/ppo_kl'), '+.2e')}  "  # absent while a critic warms up
            f"{_num(row.get('timing_s/step'), '.2f')}s/step"
        )
        if self.task is not None:
            self.progress.update(self.task, completed=row["step"], info=info)
        if not self.live and (row["step"] % self.every == 0 or row["step"] == self.total):
            self.console.print(f"step {row['step']}/{self.total}  {info}", highlight=False)

    def note(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)  # one line in a log: greppable

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def print_summary(self, summary: dict[str, Any]) -> None:
        def fmt(x: float) -> str:
            return "n/a" if math.isnan(x) else f"{x:.3f}"

        w = summary["window"]
        self.console.print(
            f"[bold green]done[/bold green]: {summary['steps']} steps in {summary['seconds']:.0f}s of training; "
            f"reward {fmt(summary['reward_start'])} (mean of first {w}) -> {fmt(summary['reward_end'])} "
            f"(mean of last {w})\nrun: {summary['run_dir']}",
            highlight=False,
        )


def _num(value: Any, spec: str) -> str:
    """A metric for the progress line; '-' when the row lacks it (or it is not a number)."""
    return format(value, spec) if isinstance(value, (int, float)) else "-"
