"""The GPU check's report: the checks in the order they ran, rewritten to report.json and summary.txt when
a check starts, after each phase of runs and after each check, so a check killed from outside (the lent
machine's call ends) leaves what was measured before it."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

T0 = time.monotonic()
GIB = 1 << 30
MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[gpu-check {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Skip(Exception):
    """The check cannot run here; its message says why."""


class Fail(Exception):
    """The check ran and found a fault; its message says which."""


class Clock:
    """A budget in seconds from the moment it is made: what is left, and whether a piece of work of a
    given length still fits."""

    def __init__(self, seconds: float):
        self.seconds, self.t0 = seconds, time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.used()

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()


@dataclass
class Check:
    number: str
    name: str
    title: str
    budget_s: float
    status: str = "not run"  # running (while it runs, or when the process was killed during it), pass, fail, skipped
    reason: str | None = None
    wall_s: float = 0.0
    figures: dict = field(default_factory=dict)


class Report:
    """The checks in the order they ran; ``total`` seconds for them all, from the script's start."""

    def __init__(self, out: Path, meta: dict, total: float):
        self.out, self.meta, self.checks, self.total = out, meta, [], total
        self.deadline = T0 + total
        self.wall_s = 0.0  # at the last write: report.json, summary.txt and the printed summary agree
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, number: str, name: str, title: str, budget: float, fn: Callable[[dict, Clock], None]) -> Check:
        """Run one check: ``fn(figures, clock)`` fills the figures first and judges last; pass when it
        returns, skipped on Skip, failed on Fail or any other exception (its error and traceback go into
        the report, never past it), or when it took more than its budget (the figures stay)."""
        budget = min(budget, max(self.left(), 0.0))
        check = Check(number, name, title, round(budget, 1))
        self.checks.append(check)
        if budget < 5:
            check.status, check.reason = "skipped", f"no time left of the {self.total:.0f} s budget"
            self.write()
            return check
        log(f"check {number} {name}: {title} (budget {budget:.0f} s)")
        check.status = "running"
        self.write()
        t = time.monotonic()
        try:
            fn(check.figures, Clock(budget))
            check.status = "pass"
        except Skip as exc:
            check.status, check.reason = "skipped", str(exc)
        except Fail as exc:
            check.status, check.reason = "fail", str(exc)
        except Exception as exc:  # a crash is a failure with its error, and the report goes on
            check.status, check.reason = "fail", f"{type(exc).__name__}: {exc}"
            check.figures["traceback"] = traceback.format_exc().splitlines()[-12:]
        check.wall_s = round(time.monotonic() - t, 1)
        check.reason = " ".join(check.reason.split()) if check.reason else None  # one line in the summary
        if check.status == "pass" and check.wall_s > budget + 5:
            check.status, check.reason = "fail", f"took {check.wall_s:.0f} s, over its budget of {budget:.0f} s"
        log(f"check {number} {name}: {check.status.upper()}" + (f" ({check.reason})" if check.reason else ""))
        self.write()
        return check

    def failed(self) -> bool:
        return any(c.status in ("fail", "running") for c in self.checks)

    def write(self) -> None:
        self.wall_s = round(time.monotonic() - T0, 1)
        data = {
            **self.meta,
            "wall_s": self.wall_s,
            "passed": not self.failed() and not self.meta.get("interrupted") and self.meta.get("finished", False),
            "checks": [c.__dict__ for c in self.checks],
        }
        tmp = self.out / ".report.json.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "report.json")
        tmp = self.out / ".summary.txt.tmp"
        tmp.write_text(self.summary())
        os.replace(tmp, self.out / "summary.txt")

    def summary(self) -> str:
        m = self.meta
        if m.get("interrupted"):
            verdict = "INTERRUPTED"
        elif not m.get("finished"):
            verdict = "UNFINISHED (the report so far)"
        else:
            verdict = "FAILED" if self.failed() else "PASSED"
        lines = [
            f"rlctl GPU check ({m['mode']}, device {m['device']}) on {m.get('gpu') or m.get('machine')}: "
            f"{verdict} in {self.wall_s:.0f} s",
        ]
        for c in self.checks:
            head = f"{c.number:>2} {c.name:<10} {c.status:<7} {c.wall_s:6.1f} s"
            text = c.figures.get("summary") or ""
            if c.reason:
                text = f"{c.reason}" + (f"; {text}" if text else "")
            lines.append(f"{head}  {text}")
        return "\n".join(lines) + "\n"
