"""Fault drills: deliberate faults, switched on by the RLCTL_FAULTS environment variable or a run
config's ``faults`` key (the demo's config names one).

Used by the test suite and by anyone who wants to see what a bad night looks like before having one.
A comma-separated list of ``name[@step][=value]``:

- ``sleep@7=30``        sleep 30 s after step 7 (a window to kill or signal the run), once the snapshots
                        of earlier steps are committed
- ``commit_delay@6=30`` wait 30 s in the background before writing the manifest of the step-6
                        snapshot (of every snapshot without @step): a window to kill the run mid-commit
- ``nan_log_prob@5``    make one log-prob of step 5 NaN, as a broken kernel or a degenerate sample
                        would (once per process: a step replayed after a rollback is clean);
                        ``nan_log_prob@5=1``: in rank 1's share of the batch only
- ``degenerate@4``      the rollout of step 4 emits one token over and over: every response becomes "!"
                        repeated up to rollout.max_new_tokens, as a collapsed policy writes ``!!!!!!!!``
                        (once per process); ``degenerate@4=a``: the token "a" (one token of the tokenizer)
- ``metric@7=actor/ppo_kl:5.0``  report actor/ppo_kl as 5.0 at step 7 (once per process): a KL spike;
                        validation metrics too (``metric@6=val/score/mean:0.0``: a validation drop)
- ``build_delay=30``   hold the trainer's build 30 s, after the run directory is set up and before the
                        models load: a window to stop a run while it is built
- ``write_delay=2``     hold a snapshot's background file writes for 2 s (training must wait at the
                        next optimizer step, never change the state being written)
- ``stale_rollout``     never push the actor's weights into the rollout engine after an update (vllm): a
                        broken weight sync, which rollout/logprob_diff shows
- ``crash@3=1``         rank 1 dies with an exception after step 3 (rank 0 without a value): a lost rank
- ``enospc@4``          every file write of the snapshots of step 4 and later fails with ENOSPC ("No
                        space left on device"), where the disk would say so (``enospc``: of every
                        snapshot): a full disk
- ``tool_outage@3=2``   the tools go down when step 3 first runs, for 2 step runs (1 without a value):
                        every tool call answers ``unavailable`` without calling the tool, as a tool
                        whose service is down (multi-turn rollouts). The outage lasts in time, not in
                        step numbers: a step run again after a rollback counts, and a validation while
                        it lasts sees it too; ``tool_outage``: every call of every step, down for good

Unknown names are an error, so a typo cannot silently disarm a drill.

A drill at a step (``sleep``, ``crash``, ``nan_log_prob``, ``degenerate``, ``metric``, ``tool_outage``)
fires once, the first time its step runs (``tool_outage@N=K``: when step N first runs), whatever the
policies make of that step; a rollback that replays the step does not fire it again. Each firing is
recorded in events.jsonl (``drill_fired``, with the drill and its step) before it acts. A run config's
drills belong to the run: a resume reads the record back (``fired_in``) and does not arm the drills
that fired, so that a drill killed or crashed in is not met again.
RLCTL_FAULTS belongs to the process it is set for: its drills fire once in that process.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rlctl import events
from rlctl.errors import ConfigError

KNOWN = {
    "sleep",
    "commit_delay",
    "write_delay",
    "build_delay",
    "nan_log_prob",
    "degenerate",
    "metric",
    "crash",
    "stale_rollout",
    "enospc",
    "tool_outage",
}
_ITEM = re.compile(r"^(?P<name>[a-z_]+)(?:@(?P<step>\d+))?(?:=(?P<value>[^,]+))?$")
CONFIG, ENVIRONMENT = "faults", "RLCTL_FAULTS"  # where a drill was armed (a drill_fired event's ``source``)


@dataclass(frozen=True)
class Fault:
    name: str
    step: int | None
    value: str | None

    def __str__(self) -> str:
        """The drill as it is written: ``name[@step][=value]``."""
        at = f"@{self.step}" if self.step is not None else ""
        return f"{self.name}{at}" + (f"={self.value}" if self.value is not None else "")


def parse(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = _ITEM.match(item)
        if not m or m["name"] not in KNOWN:
            raise ConfigError(f"fault drills: cannot read {item!r}; known faults: {', '.join(sorted(KNOWN))}")
        if m["name"] == "tool_outage" and m["value"] is not None and not (m["value"].isdigit() and int(m["value"])):
            raise ConfigError(f"fault drills: {item!r}: tool_outage@STEP=K takes a number of steps K >= 1")
        faults.append(Fault(m["name"], int(m["step"]) if m["step"] else None, m["value"]))
    return faults


Emit = Callable[[dict[str, Any]], None]
_configured: list[Fault] = []  # the run config's drills (``configure``) that have not fired in the run
_fired: set[Fault] = set()  # the drills fired in this process since ``configure``
_emit: Emit | None = None  # where a firing is recorded (the run's events.jsonl)
_outage_left: dict[Fault, int] = {}  # the step runs each tool_outage drill that fired still takes down


def configure(spec: str | None, fired: Iterable[Fault] = (), emit: Emit | None = None) -> None:
    """Arm the drills a run config names (its ``faults`` key), besides those of RLCTL_FAULTS, but for
    those ``fired`` in the run already (``fired_in`` its events); ``emit`` records each firing."""
    global _configured, _emit
    done = set(fired)
    _configured = [f for f in parse(spec or "") if f not in done]  # an unknown name is an error now
    _fired.clear()
    _outage_left.clear()
    _emit = emit


def fired_in(rows: Iterable[Any]) -> set[Fault]:
    """The drills that ``drill_fired`` events (the rows of events.jsonl) say fired; an event that names
    no drill that can be read is skipped (a damaged log disarms nothing it does not name)."""
    found: set[Fault] = set()
    for row in rows:
        if not isinstance(row, dict) or row.get("event") != events.DRILL_FIRED or not isinstance(row.get("drill"), str):
            continue
        try:
            drills = parse(row["drill"])
        except ConfigError:
            continue
        if len(drills) == 1:
            found |= set(drills)
    return found


def active() -> list[Fault]:
    return [*_configured, *parse(os.environ.get("RLCTL_FAULTS", ""))]


def value(name: str, step: int | None = None) -> str | None:
    """The value of fault ``name`` armed for ``step`` (or for every step), else None."""
    for f in active():
        if f.name == name and (f.step is None or f.step == step):
            return f.value if f.value is not None else ""
    return None


def disk_full(step: int) -> bool:
    """Whether the ``enospc`` drill fails the file writes of the snapshot of ``step``."""
    return any(f.name == "enospc" and (f.step is None or step >= f.step) for f in active())


def once(name: str, step: int) -> str | None:
    """The value of a drill ``name`` armed for ``step`` that has not fired (recorded as fired now), else
    None: a transient fault, which a rollback and replay should get past."""
    drill = _armed(name, step)
    if drill is None:
        return None
    _fire(drill)
    return drill.value if drill.value is not None else ""


def tool_outage(step: int) -> bool:
    """Whether the ``tool_outage`` drill takes the tools down for this run of ``step`` (ask once per run
    of a step): ``tool_outage`` for every step; ``tool_outage@N=K`` for K step runs from the first run of
    step N (recorded as fired then: a resume does not arm it again, the outage is over), whatever steps
    they are. A validation (step below 1) sees an outage going on and takes no run from it."""
    down = False
    for f in active():
        if f.name != "tool_outage":
            continue
        if f.step is None:
            down = True
            continue
        if step >= 1 and f.step == step and f not in _fired:
            _fire(f)
            _outage_left[f] = int(f.value or 1)
        if _outage_left.get(f, 0) > 0:
            down = True
            if step >= 1:
                _outage_left[f] -= 1
    return down


def _armed(name: str, step: int) -> Fault | None:
    """The first drill ``name`` armed for ``step`` that has not fired."""
    return next((f for f in active() if f.name == name and f.step == step and f not in _fired), None)


def _due(name: str, step: int) -> Fault | None:
    """A drill ``name`` to act after ``step``: one armed for it that has not fired, else one of every step."""
    return _armed(name, step) or next((f for f in active() if f.name == name and f.step is None), None)


def _fire(drill: Fault) -> None:
    """Mark a drill at a step fired and record it (before it acts: a kill in its effect must not re-arm
    it); a drill of every step (no @step) is a condition, never recorded."""
    if drill.step is None:
        return
    _fired.add(drill)
    if _emit is not None:
        source = CONFIG if drill in _configured else ENVIRONMENT
        _emit({"event": events.DRILL_FIRED, "drill": str(drill), "step": drill.step, "source": source})


def while_building() -> None:
    """The ``build_delay=S`` drill: sleep S seconds (1 by default) while the trainer is built (a stop
    signal then ends the run at once, as it does in any part of the build)."""
    if (pause := value("build_delay")) is not None:
        time.sleep(float(pause or 1))


def after_step(step: int, rank: int, stopped: Callable[[], bool], settle: Callable[[int], None] | None = None) -> None:
    """The drills that act after step ``step`` ran, whatever its verdict (once each; without @N after
    every step): ``sleep@N=S`` pauses S seconds (1 by default), cut short when ``stopped()`` (signal
    handlers do not end time.sleep), once ``settle(N)`` has returned (the snapshots of earlier steps are
    committed); ``crash@N=R`` raises on rank R (0)."""
    if (pause := _due("sleep", step)) is not None:
        _fire(pause)
        if settle is not None:
            settle(step)
        deadline = time.monotonic() + float(pause.value or 1)
        while not stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
    if (crash := _due("crash", step)) is not None:
        _fire(crash)
        if int(crash.value or 0) == rank:
            raise RuntimeError(f"fault drill: rank {rank} crashed after step {step}")
