"""Progress, notes and the end-of-run summary on stderr (rich). stdout stays clean for data.

On a terminal a live bar shows step, reward and KL; in a log file (Slurm, cron, CI) the same facts are
written as plain lines, about twenty per run, instead of bar redraws.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlctl.numbers import is_number


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
        if "val/score/mean" in row:
            info += f"  val {_num(row['val/score/mean'], '.3f')}"
        if self.task is not None:
            self.progress.update(self.task, completed=row["step"], info=info)
        if not self.live and (row["step"] % self.every == 0 or row["step"] == self.total):
            self.console.print(f"step {row['step']}/{self.total}  {info}", highlight=False)

    def note(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)  # one line in a log: greppable

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def print_summary(self, summary: dict[str, Any]) -> None:
        """The end of a run in words a newcomer understands, then the commands to look closer."""
        self.console.print("\n".join(summary_lines(summary)), highlight=False, markup=False)


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The summary of a finished run (``rlctl.rundir.summary.run_summary``) as lines of text."""

    def fmt(x: float | None) -> str:
        return "n/a" if x is None or math.isnan(x) else f"{x:.3f}"

    w, run = s["window"], s["run_dir"]
    lines = [
        f"done: {s['steps']} steps in {s['seconds']:.0f}s of training",
        f"  reward      {fmt(s['reward_start'])} (mean of first {w}) -> {fmt(s['reward_end'])} (mean of last {w})",
    ]
    if s.get("val_start") is not None:
        lines.append(f"  validation  {fmt(s['val_start'])} -> {fmt(s['val_end'])} (val/score/mean, first -> last)")
    if s.get("snapshots"):
        best = s.get("best")
        tail = f"; best: step {best['step']} ({best['metric']} {fmt(best['value'])})" if best else ""
        lines.append(f"  snapshots   {s['snapshots']} committed{tail}")
    rollbacks = s.get("rollbacks") or []
    lines.append(f"  rollbacks   {len(rollbacks)}" + (":" if rollbacks else ""))
    lines += [f"    step {r['from_step']}: rule {r['rule']} -> back to step {r['to_step']}" for r in rollbacks]
    lines += [f"run: {run}", f"next: rlctl inspect {run} --plot run.png", f"      rlctl checkpoints {run}"]
    if "tensorboard" in (s.get("loggers") or []):
        lines.append(f"      tensorboard --logdir {run}/tensorboard")
    return lines


def _num(value: Any, spec: str) -> str:
    """A metric for the progress line; '-' when the row lacks it (or it is not a number)."""
    return format(value, spec) if is_number(value) else "-"
