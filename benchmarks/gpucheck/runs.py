"""The rlctl runs of the GPU check: real `python -m rlctl start/resume` processes, watched while they run
(their process trees, the snapshot writer among them, GPU and shared memory) and read back from their run
directories (metrics.jsonl, events.jsonl), also after a kill: a line cut short is skipped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpucheck.report import Fail, log


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file ([] when missing); a line cut short by a kill is skipped."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


@dataclass
class Run:
    """One `python -m rlctl ...` process and what was seen of it while it ran."""

    name: str
    argv: list[str]  # after `python -m rlctl`
    run_dir: Path
    env: dict
    cwd: Path
    steps: int
    kill_after: int | None = None  # SIGKILL once this step's row is written and earlier snapshots committed
    # the dry run's T: it rests (a sleep drill) after this step and is stopped as at its budget once it has
    # written that step and the phase's other runs have ended (on a loaded machine they may end first)
    rests_after: int | None = None
    proc: subprocess.Popen | None = None
    wall_s: float | None = None
    rc: int | None = None
    killed_after: int | None = None
    timed_out: bool = False  # stopped at its phase's budget (SIGKILL); its rows so far are still read
    pids: set = field(default_factory=set)
    writer_pids: set = field(default_factory=set)
    gpu_peak_mib: float | None = None
    gpu_source: str | None = None  # "process" (nvidia-smi per process) or "device" (the whole GPU's use)
    shm_peak: int = 0  # bytes of /dev/shm in use above what was used before the phase
    writer_hwm_kib: int = 0  # the writer process's peak resident memory
    error: str | None = None  # why it could not be started or watched
    _t: float = 0.0

    @property
    def log(self) -> Path:
        return self.run_dir.parent / f"{self.name.replace('+', '-resume')}.log"

    def start(self) -> None:
        self._t = time.monotonic()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlctl", *self.argv],
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pids.add(self.proc.pid)

    def done(self) -> bool:
        if self.proc is None or self.rc is not None:
            return True
        if self.proc.poll() is None:
            return False
        self.rc, self.wall_s = self.proc.returncode, round(time.monotonic() - self._t, 1)
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)  # its writer dies with it (PR_SET_PDEATHSIG)
            self.proc.wait()

    def rows(self) -> list[dict]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def events(self, kind: str | None = None) -> list[dict]:
        events = read_jsonl(self.run_dir / "events.jsonl")
        return [e for e in events if kind is None or e.get("event") == kind]

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = 6) -> str:
        lines = [line for line in self.output().splitlines() if line.strip()]
        return " | ".join(lines[-n:])

    def last_step(self) -> int:
        return max((r.get("step", 0) for r in self.rows()), default=0)

    def due_for_kill(self) -> bool:
        """Its row of ``kill_after`` is written and every snapshot of an earlier step is committed: the
        run sleeps in its drill (sleep@N), a window in which SIGKILL lands at a known point."""
        if self.kill_after is None or self.killed_after is not None or self.last_step() < self.kill_after:
            return False
        found = (self.run_dir / "checkpoints").glob("step-*")
        return all(
            (d / "manifest.json").exists() for d in found if d.name[5:].isdigit() and int(d.name[5:]) < self.kill_after
        )

    def ok(self) -> None:
        """Fail unless the run ended with exit 0 after all its steps."""
        if self.error is not None:
            raise Fail(f"run {self.name}: {self.error}")
        if self.timed_out:
            raise Fail(f"run {self.name} ran past its phase's budget and was killed (last step {self.last_step()})")
        if self.rc != 0:
            raise Fail(f"run {self.name} exited {self.rc}: {self.tail()}")
        steps = [r.get("step") for r in self.rows()]
        if steps != list(range(1, self.steps + 1)):
            raise Fail(f"run {self.name} wrote the rows of steps {steps}, not 1..{self.steps}")

    def facts(self) -> dict:
        return {
            "rc": self.rc,
            "wall_s": self.wall_s,
            "steps": self.last_step(),
            "stopped_at_budget": self.timed_out,
            "log": str(self.log),
            "gpu_peak_gib": None if self.gpu_peak_mib is None else round(self.gpu_peak_mib / 1024, 2),
        }


class Watcher:
    """Readings of the live runs: their process trees (the writer among them), GPU memory per process
    (nvidia-smi; the whole GPU where it lists no processes), shared memory and the writer's peak RSS."""

    def __init__(self, cuda: bool):
        self.cuda = cuda and shutil.which("nvidia-smi") is not None
        self.shm_base, self.gpu_base = 0, 0.0

    def phase_starts(self) -> None:
        """What is in use before a phase's runs start (this process's own CUDA context among it)."""
        self.shm_base = shm_used()
        self.gpu_base = (device_used_mib() or 0.0) if self.cuda else 0.0

    def tick(self, runs: list[Run]) -> None:
        parents, writers = process_table()
        for run in runs:
            run.pids |= descendants(run.proc.pid, parents)
            run.writer_pids |= run.pids & writers
            run.shm_peak = max(run.shm_peak, shm_used() - self.shm_base)
            for pid in run.writer_pids:
                run.writer_hwm_kib = max(run.writer_hwm_kib, vm_hwm_kib(pid))
        if self.cuda:
            self._gpu(runs)

    def _gpu(self, runs: list[Run]) -> None:
        """Each run's GPU memory: the sum over its processes where nvidia-smi lists them by this system's
        process ids; else the whole GPU's use above what it was before the phase (a container that sees
        other process ids), which is one run's only when it runs alone."""
        listed = nvidia_smi(["--query-compute-apps=pid,used_memory"])
        used = {int(p): float(m) for p, m in listed if p.strip().isdigit() and _number(m)}
        matched = False
        for run in runs:
            mine = [used[p] for p in run.pids if p in used]
            if mine:
                matched = True
                run.gpu_peak_mib, run.gpu_source = max(run.gpu_peak_mib or 0.0, sum(mine)), "process"
        device = None if matched else device_used_mib()
        if device is None:
            return
        for run in runs:
            if run.gpu_source != "process":
                run.gpu_peak_mib = max(run.gpu_peak_mib or 0.0, device - self.gpu_base)
                run.gpu_source = "device" if len(runs) == 1 else f"device, {len(runs)} runs side by side"


def device_used_mib() -> float | None:
    device = nvidia_smi(["--query-gpu=memory.used"])
    return float(device[0][0]) if device and _number(device[0][0]) else None


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def nvidia_smi(query: list[str]) -> list[list[str]]:
    try:
        out = subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def process_table() -> tuple[dict[int, int], set[int]]:
    """{pid: parent pid} of every process, and the snapshot writers' pids: named rlctl-writer, forked
    from their training process or exec'd (one exec'd is known by its command line before it names itself)."""
    parents, writers = {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if "(rlctl-writer)" in stat or b"rlctl.checkpoint.writer" in fh.read():
                    writers.add(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return parents, writers


def descendants(root: int, parents: dict[int, int]) -> set[int]:
    out, frontier = {root}, {root}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier and p not in out}
        out |= frontier
    return out


def vm_hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def shm_used() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def run_phase(runs: list[Run], budget: float, watcher: Watcher, progress: Callable[[], None]) -> None:
    """Start the runs side by side and wait for them (reading them every half second), SIGKILLing a run
    when it is due (``kill_after``), every run still alive past ``budget`` seconds, and the open-ended
    ones once the others have ended; ``progress()`` (the report's write) every 10 s and at the end."""
    watcher.phase_starts()
    for run in runs:
        run.start()
    log(f"  runs {', '.join(r.name for r in runs)} started (budget {budget:.0f} s)")
    t0, shown = time.monotonic(), time.monotonic()
    while True:
        live = [r for r in runs if not r.done()]
        if not live:
            break
        watcher.tick(live)
        for run in live:
            if run.due_for_kill():
                run.killed_after = run.last_step()
                run.kill()
                log(f"  run {run.name}: SIGKILL after step {run.killed_after}")
        closed = all(r.rests_after is not None and r.last_step() >= r.rests_after for r in live) and any(
            r.rests_after is None for r in runs
        )
        if time.monotonic() - t0 > budget or closed:
            for run in live:
                run.timed_out = True
                run.kill()
                why = "its phase's other runs ended" if closed else f"the phase's budget of {budget:.0f} s"
                log(f"  run {run.name}: stopped at step {run.last_step()} ({why})")
        if time.monotonic() - shown > 10:
            shown = time.monotonic()
            log("  " + ", ".join(f"{r.name} at step {r.last_step()}/{r.steps}" for r in live))
            progress()
        time.sleep(0.5)
    for run in runs:
        run.done()
        log(f"  run {run.name}: exit {run.rc}, {run.last_step()} steps, {run.wall_s} s")
    progress()
