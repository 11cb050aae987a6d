"""rlctl on a GPU in one command, within 10 minutes of wall time: the first run on a lent machine, or on any.

    python3 benchmarks/gpu_check.py --out DIR                 # on a CUDA machine (make gpu-check OUT=DIR)
    python3 benchmarks/gpu_check.py --out DIR --device cpu --tiny   # the dry run the test suite runs

Run from the repository root, with rlctl's dependencies importable (docs/gpu-check.md: `make gpu-wheels`
builds the ones a bare image lacks). Every run is a real `python -m rlctl start/resume` subprocess with a
config this script writes, read back through its metrics.jsonl and events.jsonl. The checks:

1. environment: torch, CUDA, the GPU, bf16, DeepSpeed (built without ops), rlctl's imports, and every
   installed dependency against rlctl's bounds in pyproject.toml; a bf16 matrix product's rate;
2. a Qwen2-shaped model of Qwen2.5-0.5B-Instruct's sizes with random weights, and a byte-level BPE
   tokenizer trained here with ChatML tokens and a chat template, in a temporary directory;
3. GRPO, ZeRO-2, bf16, HF rollout for a few steps: tokens/s, the update's TFLOP/s and its share of the
   GPU's bf16 peak, peak GPU memory, each phase's time;
4. a run SIGKILLed after step 3 (last snapshot: step 2) and resumed against an uninterrupted run, both
   with trainer.deterministic: the completed weights' sha256 and every metric row;
5. LoRA (its snapshot against the full one), fp16 (the loss scale moves), gradient checkpointing (peak
   GPU memory with and without);
6. the snapshot writer process on device tensors: the asynchronous stall against a synchronous save, and
   the host staging (shared memory, the writer's own copy) it takes;
7. the tests marked `gpu`;
8. report.json and summary.txt in DIR; exit 1 when a check failed.

Each check has a time budget; a check that crashes is a failure with its error, never a lost report (the
report is rewritten after every check). Progress goes to stderr. `--tiny` shrinks everything to the
built-in model's size so that the same code runs on a CPU in about half a minute; what a CPU cannot
measure (GPU memory, fp16 under DeepSpeed, the gpu tests) is reported skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
T0 = time.monotonic()
GIB = 1 << 30
MIB = 1 << 20

# Qwen2.5-0.5B-Instruct's shapes (its config.json): 494M parameters, 136M of them the tied embedding
QWEN_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY_MODEL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's datasheets, by a name's substring;
# the first that matches counts (more specific names first)
BF16_PEAK = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
]
NONDETERMINISTIC = re.compile(r"(\w[\w:.]*) does not have a deterministic implementation")  # torch's warning
DETERMINISM = [
    "trainer.deterministic: true (rlctl.engine.runtime.deterministic_kernels)",
    "torch.use_deterministic_algorithms(True, warn_only=True)",
    "CUBLAS_WORKSPACE_CONFIG=:4096:8",
    "torch.backends.cudnn.deterministic = True",
    "torch.backends.cudnn.benchmark = False",
    "CUDA attention: the math kernel (flash, memory-efficient and cuDNN kernels off)",
]
REWARDS = '''"""Rewards of the GPU check (benchmarks/gpu_check.py)."""


def varied(prompts, completions, **_):
    """A score that differs between the completions of one prompt, so every group has advantages."""
    return [(len(c) % 13) / 13.0 for c in completions]


def huge(prompts, completions, **_):
    """Rewards of 1e5 (RLOO does not normalise them away): fp16 gradients overflow and the loss scale moves."""
    return [1e5 * (len(c) % 3) for c in completions]
'''
CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def log(msg: str) -> None:
    print(f"[gpu-check {time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# -- sizes ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    """What the checks build and run: the model, the tokenizer, the runs' shapes, and the phases the runs
    go in (runs of a phase run side by side; a phase's runs are killed past its budget, in seconds)."""

    model: dict
    vocab: int  # the trained tokenizer's vocabulary (the model's is larger, as Qwen's)
    words: int  # distinct words of the synthetic corpus the tokenizer is trained on
    perf: dict  # the throughput run's shape (check 3), and its gradient-checkpointing twin's (check 5)
    small: dict  # the shape of the resume (check 4), LoRA and fp16 runs (check 5)
    lora_rank: int
    matmul: int  # the side of the square matrix product timed in check 1
    phases: tuple  # ((runs, budget), ...) in the order they run
    budgets: dict  # seconds of the checks that run in this process
    disk_gib: float  # free disk the runs need in the work folder


FULL = Size(
    model=QWEN_05B,
    vocab=151643,
    words=150000,
    # the HF rollout draws its Gumbel noise on the CPU (a vocabulary's worth per token and sequence): the
    # update gets its work from 4 PPO epochs over the batch rather than from longer generations
    perf=dict(prompts=16, group=4, new_tokens=64, epochs=4),
    small=dict(prompts=8, group=4, new_tokens=48, epochs=1),
    lora_rank=16,
    matmul=8192,
    # the timed runs alone: throughput (P) and the synchronous save with gradient checkpointing (S). On
    # the first H100 (2026-11-27) a run's first step ended about 50 s after its start (imports, the model,
    # DeepSpeed, the first generation) and P's later steps took about 10 s: P was at step 4 after 92 s and
    # was killed, still ending, at the 95 s it then had. In all they fit one call of the lent machine's
    # (600 s), with the wheels' install and Python's start
    phases=((("P",), 135), (("R", "K"), 120), (("K+", "L", "F"), 110), (("S",), 85)),
    budgets={"env": 25, "build": 30, "gpu_tests": 60},  # 565 s in all, with the phases'
    disk_gib=25,  # snapshots on disk at once, at most: R's two and K's one (about 7 GB each)
)
TINY = Size(
    model=TINY_MODEL,
    vocab=500,
    words=2000,
    perf=dict(prompts=4, group=4, new_tokens=8, epochs=1),
    small=dict(prompts=4, group=4, new_tokens=8, epochs=1),
    lora_rank=4,
    matmul=256,
    # fewest process starts: the reference run (R) stands in for the throughput run (P)
    phases=((("R", "K"), 150), (("K+", "L", "S"), 150)),
    budgets={"env": 60, "build": 60, "gpu_tests": 60},
    disk_gib=0.1,
)
TOTAL_BUDGET = 565  # seconds: one call of the lent machine's (600 s), less the install, Python's start and the report


# -- the report ----------------------------------------------------------------------------------------
class Skip(Exception):
    """The check cannot run here; its message says why."""


class Fail(Exception):
    """The check ran and found a fault; its message says which."""


@dataclass
class Check:
    number: str
    name: str
    title: str
    budget_s: float
    status: str = "not run"
    reason: str | None = None
    wall_s: float = 0.0
    figures: dict = field(default_factory=dict)


class Report:
    """The checks in the order they ran, rewritten to DIR/report.json and DIR/summary.txt after each."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.meta, self.checks = out, meta, []
        self.deadline = T0 + TOTAL_BUDGET
        self.wall_s = 0.0  # at the last write: report.json, summary.txt and the printed summary agree
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, number: str, name: str, title: str, budget: float, fn: Callable[[dict], None]) -> Check:
        """Run one check: pass when ``fn(figures)`` returns, skipped on Skip, failed on Fail or any other
        exception (its error and traceback go into the report, never past it), or when it took more
        than its budget."""
        check = Check(number, name, title, round(budget, 1))
        self.checks.append(check)
        if self.left() < 10:
            check.status, check.reason = "skipped", f"no time left of the {TOTAL_BUDGET} s budget"
            self.write()
            return check
        log(f"check {number} {name}: {title} (budget {budget:.0f} s)")
        t = time.monotonic()
        try:
            fn(check.figures)
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
        return any(c.status == "fail" for c in self.checks)

    def write(self) -> None:
        self.wall_s = round(time.monotonic() - T0, 1)
        data = {
            **self.meta,
            "wall_s": self.wall_s,
            "passed": not self.failed() and not self.meta.get("interrupted"),
            "checks": [c.__dict__ for c in self.checks],
        }
        tmp = self.out / ".report.json.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "report.json")
        (self.out / "summary.txt").write_text(self.summary())

    def summary(self) -> str:
        m = self.meta
        verdict = "INTERRUPTED" if m.get("interrupted") else "FAILED" if self.failed() else "PASSED"
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


# -- rlctl runs: real subprocesses, read back from their run directories -------------------------------
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
    proc: subprocess.Popen | None = None
    wall_s: float | None = None
    rc: int | None = None
    killed_after: int | None = None
    timed_out: bool = False
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
            "log": str(self.log),
            "gpu_peak_gib": None if self.gpu_peak_mib is None else round(self.gpu_peak_mib / 1024, 2),
        }


class Sampler:
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


def run_phase(runs: list[Run], budget: float, sampler: Sampler) -> None:
    """Start the runs side by side and wait for them (reading them every half second), SIGKILLing a run
    when it is due (``kill_after``) and every run still alive past ``budget`` seconds."""
    sampler.phase_starts()
    for run in runs:
        run.start()
    log(f"  runs {', '.join(r.name for r in runs)} started (budget {budget:.0f} s)")
    t0, shown = time.monotonic(), time.monotonic()
    while True:
        live = [r for r in runs if not r.done()]
        if not live:
            break
        sampler.tick(live)
        for run in live:
            if run.due_for_kill():
                run.killed_after = run.last_step()
                run.kill()
                log(f"  run {run.name}: SIGKILL after step {run.killed_after}")
        if time.monotonic() - t0 > budget:
            for run in live:
                run.timed_out = True
                run.kill()
                log(f"  run {run.name}: killed past the phase's budget of {budget:.0f} s")
        if time.monotonic() - shown > 10:
            shown = time.monotonic()
            log("  " + ", ".join(f"{r.name} at step {r.last_step()}/{r.steps}" for r in live))
        time.sleep(0.5)
    for run in runs:
        log(f"  run {run.name}: exit {run.rc}, {run.last_step()} steps, {run.wall_s} s")


# -- the plan: which runs, with which configs, in which phases -----------------------------------------
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RLCTL_FAULTS")


class Plan:
    """The rlctl runs of the checks, made when a check first asks for one: the phase holding it runs then
    (with every earlier phase first), its runs side by side."""

    def __init__(self, ctx: Ctx):
        self.ctx, self.size = ctx, ctx.size
        self.sampler = Sampler(ctx.device == "cuda")
        self.phases = [[n for n in names if n != "F" or ctx.fp16] for names, _ in ctx.size.phases]
        self.budgets = [budget for _, budget in ctx.size.phases]
        self.alias = {} if any("P" in names for names in self.phases) else {"P": "R"}
        self.runs: dict[str, Run] = {}
        self.next_phase = 0
        self.broken: dict[int, str] = {}  # a phase that could not run: why

    def has(self, name: str) -> bool:
        name = self.alias.get(name, name)
        return any(name in names for names in self.phases)

    def budget_until(self, *names: str) -> float:
        """Seconds of the phases not run yet up to the one holding the last of ``names``."""
        last = max(self._phase_of(n) for n in names)
        return sum(self.budgets[self.next_phase : last + 1])

    def _phase_of(self, name: str) -> int:
        name = self.alias.get(name, name)
        return next(i for i, names in enumerate(self.phases) if name in names)

    def get(self, name: str) -> Run:
        """The finished run ``name`` (its phase, and every earlier one, run first)."""
        if self.ctx.model_dir is None:
            raise Skip("no model to train: check 2 did not build one")
        phase = self._phase_of(name)
        while self.next_phase <= phase:
            self._run_phase(self.next_phase)
            self.next_phase += 1
        run = self.runs.get(self.alias.get(name, name))
        if run is None:
            raise Fail(f"run {name} was not started: {self.broken.get(phase)}")
        return run

    def _run_phase(self, index: int) -> None:
        names, budget, runs = self.phases[index], self.budgets[index], []
        try:
            runs = [self._make(n) for n in names]
            self.runs.update({r.name: r for r in runs})
            run_phase(runs, min(budget, max(self.ctx.report.left(), 1.0)), self.sampler)
        except Exception as exc:  # the runs' checks fail with it; the phases after still run
            self.broken[index] = f"{type(exc).__name__}: {exc}"
            for run in runs:
                run.kill()
                run.error = f"its phase broke off: {self.broken[index]}"
            log(f"  phase {', '.join(names)} broke off: {self.broken[index]}")
        self.free_disk(runs)

    def _make(self, name: str) -> Run:
        ctx = self.ctx
        if name == "K+":  # the killed run, resumed from its latest snapshot (no drill this time)
            killed = self.runs["K"]
            argv = ["resume", str(killed.run_dir), "--from", "latest"]
            return Run("K+", argv, killed.run_dir, run_env(ctx), ctx.work, killed.steps)
        cfg, faults, kill_after = run_config(ctx, name)
        path = ctx.work / "configs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg, indent=1))  # (JSON is YAML)
        run_dir = ctx.work / "runs" / name
        env = run_env(ctx, RLCTL_FAULTS=faults) if faults else run_env(ctx)
        steps = cfg["trainer"]["total_steps"]
        return Run(name, ["start", str(path), "--run-dir", str(run_dir)], run_dir, env, ctx.work, steps, kill_after)

    @staticmethod
    def free_disk(runs: list[Run]) -> None:
        """Remove the finished runs' snapshots (their events hold what the checks read): one of the full
        model is about 7 GB (bf16 weights, fp32 master weights and Adam's moments). The killed run's stay
        until its resume has run."""
        for run in runs:
            if run.name != "K":
                shutil.rmtree(run.run_dir / "checkpoints", ignore_errors=True)


def run_env(ctx: Ctx, **extra: str) -> dict:
    """This environment for a run: rlctl importable from the repository (before what PYTHONPATH holds,
    the carried wheels' folder say), JIT builds into the work folder (check 3 says if any happened), no
    distributed variables or drills of this process's."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["TORCH_EXTENSIONS_DIR"] = str(ctx.work / "torch_extensions")
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["DS_ACCELERATOR"] = ctx.device
    if ctx.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def run_config(ctx: Ctx, name: str) -> tuple[dict, str, int | None]:
    """(the config of run ``name``, its RLCTL_FAULTS, the step after which it is SIGKILLed)."""
    size = ctx.size
    if name == "P":  # check 3: throughput; its snapshots (asynchronous, the writer process) feed check 6
        return base_config(ctx, size.perf, steps=4, every=2), "", None
    if name in ("R", "K"):  # check 4: the reference and the run killed after step 3 (last snapshot: 2)
        cfg = base_config(ctx, size.small, steps=4, every=2)
        cfg["trainer"]["deterministic"] = True
        if name == "K" and ctx.tiny:  # (the dry run: a writer process's start less; P is R, whose is measured)
            cfg["checkpoint"]["writer"] = "thread"
        return cfg, ("sleep@3=600" if name == "K" else ""), (3 if name == "K" else None)
    if name == "L":  # check 5: LoRA, one snapshot
        cfg = base_config(ctx, size.small, steps=2, every=2)
        cfg["actor"]["lora"] = {"rank": size.lora_rank, "alpha": 2.0 * size.lora_rank}
        if ctx.tiny:
            cfg["checkpoint"]["writer"] = "thread"
        return cfg, "", None
    if name == "F":  # check 5: fp16, rewards of 1e5, four optimizer steps a step: the loss scale moves
        cfg = base_config(ctx, size.small, steps=3, every=0)
        cfg["model"]["dtype"] = "fp16"
        cfg["reward"]["function"] = "gpu_check_reward:huge"
        cfg["algorithm"]["adv_estimator"] = "rloo"
        cfg["actor"]["mini_batch_size"] = size.small["prompts"] * size.small["group"] // 4
        return cfg, "", None
    if name == "S":  # checks 5 and 6: gradient checkpointing, one synchronous snapshot; P's shape
        cfg = base_config(ctx, size.perf, steps=1, every=1)
        cfg["actor"]["gradient_checkpointing"] = True
        cfg["checkpoint"]["asynchronous"] = False
        return cfg, "", None
    raise ValueError(f"no run {name!r}")


def base_config(ctx: Ctx, shape: dict, *, steps: int, every: int) -> dict:
    """GRPO, ZeRO-2, bf16, the HF rollout, the built-in echo prompts through the chat template."""
    return {
        "name": "gpu-check",
        "seed": 0,
        "device": ctx.device,
        "model": {"path": str(ctx.model_dir), "dtype": "bf16"},
        "data": {"apply_chat_template": True},
        "reward": {"function": "gpu_check_reward:varied"},
        "algorithm": {"name": "grpo", "group_size": shape["group"], "ppo_epochs": shape["epochs"]},
        "actor": {"zero_stage": 2, "lr": 1.0e-5},
        "rollout": {"backend": "hf", "max_new_tokens": shape["new_tokens"]},
        "trainer": {"total_steps": steps, "prompts_per_step": shape["prompts"]},
        "checkpoint": {"every": every, "keep_last": 1},
    }


@dataclass
class Ctx:
    """What the checks share."""

    device: str  # cuda or cpu
    size: Size
    tiny: bool
    work: Path  # the temporary folder: the model, the configs, the runs
    report: Report
    fp16: bool = False  # whether DeepSpeed trains in fp16 here (CUDA; a CPU with oneDNN fp16)
    model_dir: Path | None = None
    matmul_params: int = 0  # weights of the model's matrix products, the tied LM head included
    head_params: int = 0  # the LM head's (computed over the response's positions only)
    gpu_name: str | None = None
    matmul_tflops: float | None = None  # the bf16 (CPU: fp32) matrix product's rate measured in check 1
    plan: Plan | None = None


# -- 1: the environment --------------------------------------------------------------------------------
PACKAGES = ("torch", "transformers", "tokenizers", "deepspeed", "pydantic", "pydantic-core", "orjson", "hjson")
PACKAGES += ("peft", "accelerate", "safetensors", "numpy", "pyarrow", "fsspec", "packaging")


def check_env(ctx: Ctx, fig: dict) -> None:
    import torch

    fig.update(python=platform.python_version(), machine=platform.machine(), cpus=os.cpu_count())
    fig.update(torch=torch.__version__, torch_cuda=torch.version.cuda, host=host_facts(ctx.work))
    if ctx.device == "cuda":
        if not torch.cuda.is_available():
            raise Fail("torch sees no CUDA device (use --device cpu --tiny for the dry run)")
        props = torch.cuda.get_device_properties(0)
        ctx.gpu_name = props.name
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        driver = nvidia_smi(["--query-gpu=driver_version"])
        fig.update(gpu=props.name, capability=f"{props.major}.{props.minor}", bf16=bf16)
        fig.update(gpu_memory_gib=round(props.total_memory / GIB, 1), multiprocessors=props.multi_processor_count)
        fig.update(driver=driver[0][0] if driver else None, bf16_peak_tflops=bf16_peak(props.name))
    versions = installed_versions()
    fig["packages"] = {name: versions.get(name) for name in PACKAGES}
    fig["outside_rlctl_bounds"] = bound_problems(versions)
    fig["rlctl_import_s"], fig["deepspeed_prebuilt_ops"] = import_rlctl()
    ctx.matmul_tflops = fig["matmul_tflops"] = matmul_rate(ctx)
    fig["summary"] = (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), {fig.get('gpu', 'CPU')}, bf16 "
        f"{fig.get('bf16', 'n/a')}, DeepSpeed {versions.get('deepspeed')} "
        f"({len(fig['deepspeed_prebuilt_ops'])} prebuilt ops), rlctl imports in {fig['rlctl_import_s']} s, "
        f"{fig['matmul_tflops']} TFLOP/s on a {ctx.size.matmul}-square matrix product"
    )
    if fig["outside_rlctl_bounds"]:
        raise Fail("installed outside rlctl's bounds: " + "; ".join(fig["outside_rlctl_bounds"]))
    if fig["host"]["work_disk_free_gib"] < ctx.size.disk_gib:
        raise Fail(
            f"{fig['host']['work_disk_free_gib']} GiB free in {ctx.work}; the runs' snapshots need {ctx.size.disk_gib}"
        )
    if ctx.device == "cuda" and not fig["bf16"]:
        raise Fail(f"{fig['gpu']} computes no bf16 natively; the GRPO check trains in bf16")


def host_facts(work: Path) -> dict:
    facts: dict[str, Any] = {"work_disk_free_gib": round(shutil.disk_usage(work).free / GIB, 1)}
    try:
        st = os.statvfs("/dev/shm")
        facts["dev_shm_gib"] = round(st.f_blocks * st.f_frsize / GIB, 1)
    except OSError:
        facts["dev_shm_gib"] = None
    try:
        with open("/proc/meminfo") as fh:
            facts["memory_gib"] = round(int(fh.readline().split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return facts


def bf16_peak(name: str) -> float | None:
    return next((peak for key, peak in BF16_PEAK if key in name), None)


def installed_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        out.setdefault(name, dist.version)  # (the first on sys.path wins, as for an import)
    return out


def bound_problems(versions: dict[str, str]) -> list[str]:
    """Each of rlctl's dependencies (and the lora extra) that is missing or outside its bounds."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return []
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    problems = []
    for text in [*project["dependencies"], *project["optional-dependencies"]["lora"]]:
        req = Requirement(text)
        have = versions.get(req.name.lower().replace("_", "-"))
        if have is None:
            problems.append(f"{req.name} is not installed (rlctl needs {req.name}{req.specifier})")
        elif not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name} {have} is outside rlctl's {req.name}{req.specifier}")
    return problems


def import_rlctl() -> tuple[float, list[str]]:
    """Seconds to import rlctl's trainer, actor and snapshot writer with this torch, DeepSpeed as rlctl
    imports it; and the ops DeepSpeed was built with (none: rlctl uses none, so none is JIT-compiled)."""
    t = time.monotonic()
    from rlctl.engine.runtime import import_deepspeed

    import_deepspeed()
    import deepspeed.git_version_info as ds_info

    import rlctl.checkpoint.writer  # noqa: F401
    import rlctl.engine.actor  # noqa: F401
    import rlctl.engine.trainer  # noqa: F401

    return round(time.monotonic() - t, 1), sorted(op for op, built in ds_info.installed_ops.items() if built)


def matmul_rate(ctx: Ctx) -> float:
    """TFLOP/s of a square matrix product: bf16 on the GPU (its practical peak), fp32 on the CPU."""
    import torch

    n, cuda = ctx.size.matmul, ctx.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    sync()
    rate = 2 * n**3 * reps / (time.perf_counter() - t) / 1e12
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return round(rate, 3 if not cuda else 1)


# -- 2: a Qwen2-shaped model with random weights and a tokenizer trained here ---------------------------
def check_build(ctx: Ctx, fig: dict) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = ctx.work / "qwen2-random"
    t = time.monotonic()
    tok = train_tokenizer(ctx.size)
    fig["tokenizer_s"], fig["tokenizer_vocab"] = round(time.monotonic() - t, 1), len(tok)
    t = time.monotonic()
    model = build_model(ctx, tok)
    fig["model_init_s"] = round(time.monotonic() - t, 1)
    fig["params"] = sum(p.numel() for p in model.parameters())
    ctx.matmul_params = fig["matmul_params"] = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    ctx.head_params = model.get_output_embeddings().weight.numel()
    fig["logits_ok"] = first_forward(ctx, model, tok)
    t = time.monotonic()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    fig["save_s"] = round(time.monotonic() - t, 1)
    fig["bytes"] = sum(f.stat().st_size for f in out.iterdir())
    fig["config"] = {k: v for k, v in ctx.size.model.items()}
    del model
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    (ctx.work / "gpu_check_reward.py").write_text(REWARDS)
    ctx.model_dir = out
    fig["summary"] = (
        f"{fig['params'] / 1e6:.1f}M parameters ({ctx.matmul_params / 1e6:.1f}M in matrix products), "
        f"{ctx.size.model['num_hidden_layers']} layers, vocabulary {ctx.size.model['vocab_size']} "
        f"(tokenizer {len(tok)}, trained in {fig['tokenizer_s']} s), {fig['bytes'] / MIB:.0f} MiB on disk"
    )
    if not fig["logits_ok"]:
        raise Fail("the model's first forward pass gave logits that are not finite, or of the wrong shape")


def train_tokenizer(size: Size):
    """A byte-level BPE tokenizer with ChatML's special tokens and a chat template, trained on a corpus of
    random words (seeded) up to ``size.vocab`` tokens."""
    import random
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 10))) for _ in range(size.words)]
    corpus = [" ".join(words[i : i + 100]) for i in range(0, len(words), 100)]
    corpus += [f"{w}={w}" for w in words[:200]]  # the built-in task's echo prompts and answers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size.vocab,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        model_max_length=size.model["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(ctx: Ctx, tok):
    """Qwen2ForCausalLM of ``ctx.size.model``'s shapes, seeded random weights, bf16, built on the device."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        **ctx.size.model,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        use_sliding_window=False,
    )
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def first_forward(ctx: Ctx, model, tok) -> bool:
    """Whether a chat-templated prompt gives finite logits of shape (1, length, vocabulary)."""
    import torch

    text = tok.apply_chat_template([{"role": "user", "content": "abc="}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids.to(ctx.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits.shape == (1, ids.shape[1], ctx.size.model["vocab_size"]) and bool(torch.isfinite(logits).all())


# -- 3: GRPO, ZeRO-2, bf16, HF rollout: throughput, the update's FLOP rate, memory, phases ----------------
PHASES = ("gen", "old_log_prob", "ref", "update_actor", "step")


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def update_flops(row: dict, sequences: int, epochs: int, ctx: Ctx, recompute: bool = False) -> float:
    """The model FLOPs of one step's actor update: 6 per weight per position (forward and backward; 8 with
    gradient checkpointing's second forward) over the positions it computed, padding included (a row's
    real tokens over 1 - perf/update_padding_frac), the LM head over the response's columns only (as
    rlctl asks of the model); attention's score and value products left out (about 2% here)."""
    real = sequences * (row["prompt_length/mean"] + row["response_length/mean"])
    positions = real / max(1e-9, 1.0 - row.get("perf/update_padding_frac", 0.0))
    head_positions = sequences * (row["response_length/max"] + 1)
    per_pass = (ctx.matmul_params - ctx.head_params) * positions + ctx.head_params * head_positions
    return (8 if recompute else 6) * per_pass * epochs


def check_grpo(ctx: Ctx, fig: dict) -> None:
    run = ctx.plan.get("P")
    fig["run"] = "P" if run.name == "P" else f"{run.name} (tiny: the reference run of check 4 stands in)"
    fig.update(run.facts())
    run.ok()
    shape = ctx.size.perf if run.name == "P" else ctx.size.small
    rows = run.rows()
    steady = rows[1:]  # step 1 warms up: the allocator grows, cuBLAS and the kernels are chosen
    sequences = shape["prompts"] * shape["group"]
    fig["first_step_s"] = rows[0].get("timing_s/step")
    fig["phases_s"] = {k: median(r.get(f"timing_s/{k}") for r in steady) for k in PHASES}
    fig["tokens_per_s"] = median(r.get("perf/throughput") for r in steady)
    fig["gen_tokens_per_s"] = median(sequences * r["response_length/mean"] / r["timing_s/gen"] for r in steady)
    fig["response_length"] = median(r["response_length/mean"] for r in steady)
    rates = [update_flops(r, sequences, shape["epochs"], ctx) / r["timing_s/update_actor"] / 1e12 for r in steady]
    tflops = fig["update_tflops"] = round(median(rates), 3)
    peak = fig["bf16_peak_tflops"] = bf16_peak(ctx.gpu_name) if ctx.gpu_name else None
    fig["fraction_of_bf16_peak"] = round(tflops / peak, 4) if peak else None
    fig["fraction_of_measured_matmul"] = round(tflops / ctx.matmul_tflops, 4) if ctx.matmul_tflops else None
    fig["gpu_memory_source"] = run.gpu_source
    extensions = ctx.work / "torch_extensions"
    fig["jit_builds"] = sorted(p.name for p in extensions.iterdir()) if extensions.exists() else []
    memory = f"peak GPU memory {fig['gpu_peak_gib']} GiB" if fig["gpu_peak_gib"] is not None else "no GPU memory"
    share = f" ({fig['fraction_of_bf16_peak']:.1%} of the {peak:.0f} bf16 peak)" if peak else ""
    fig["summary"] = (
        f"{fig['tokens_per_s']:.0f} tokens/s, generation {fig['gen_tokens_per_s']:.0f} tokens/s, update "
        f"{tflops} TFLOP/s{share}, {memory}; phases (s): "
        + ", ".join(f"{k} {v:.3g}" for k, v in fig["phases_s"].items() if v is not None)
    )
    if ctx.device == "cuda" and run.gpu_peak_mib is None:
        raise Fail("nvidia-smi gave no GPU memory reading of the run")
    if fig["jit_builds"]:
        raise Fail(f"a run JIT-compiled {', '.join(fig['jit_builds'])} (rlctl should need no DeepSpeed op)")


# -- 4: SIGKILL and resume against an uninterrupted run, under deterministic kernels -----------------------
VOLATILE = ("timing_s/", "perf/throughput", "timestamp")  # wall-clock figures, different in every run


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE) and k != "abandoned"}


def row_differences(ref: list[dict], other: list[dict]) -> list[dict]:
    """Every (step, key) whose value differs between two runs' rows (a key missing on one side too)."""
    out = []
    for a, b in zip(ref, other):
        a, b = stable(a), stable(b)
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diff = None
                if isinstance(a.get(key), (int, float)) and isinstance(b.get(key), (int, float)):
                    diff = abs(a[key] - b[key])
                out.append(
                    {"step": a.get("step"), "key": key, "reference": a.get(key), "resumed": b.get(key), "abs": diff}
                )
    if len(ref) != len(other):
        out.append({"step": None, "key": "rows", "reference": len(ref), "resumed": len(other), "abs": None})
    return out


def weights_hash(run: Run) -> str | None:
    done = run.events("completed")
    return done[-1].get("weights_sha256") if done else None


def check_resume(ctx: Ctx, fig: dict) -> None:
    ref, killed = ctx.plan.get("R"), ctx.plan.get("K")
    fig["settings"] = DETERMINISM
    fig["reference"], fig["killed"] = ref.facts(), killed.facts()
    ref.ok()
    if killed.killed_after != 3:
        raise Fail(
            f"run K was not killed after step 3 (exit {killed.rc}, last step {killed.last_step()}): {killed.tail()}"
        )
    resumed = ctx.plan.get("K+")
    fig["resumed"] = resumed.facts()
    resumed.ok()
    logs = [r.output() for r in (ref, killed, resumed)]
    kernels = sorted({m for text in logs for m in NONDETERMINISTIC.findall(text)})
    fig["kernels_without_deterministic_version"] = kernels
    fig["determinism_warnings"] = sorted(
        {
            line.strip()[:300]
            for text in logs
            for line in text.splitlines()
            if "Warning" in line and "determinis" in line
        }
    )[:10]
    resume = resumed.events("resume")
    fig["resumed_from_step"] = resume[-1].get("step") if resume else None
    fig["weights_sha256"] = {"reference": weights_hash(ref), "resumed": weights_hash(resumed)}
    norms = fig["grad_norms"] = [r.get("actor/grad_norm") for r in ref.rows()]
    if not any(n for n in norms if n is not None):
        raise Fail("the reference run never changed its weights (every grad norm 0): nothing to compare")
    diffs = row_differences(ref.rows(), resumed.rows())
    fig["rows_compared"], fig["cells_differing"] = len(ref.rows()), len(diffs)
    fig["differences"] = diffs[:20]
    same = weights_hash(ref) is not None and weights_hash(ref) == weights_hash(resumed)
    fig["summary"] = (
        f"killed after step 3, resumed from step {fig['resumed_from_step']}: weights "
        f"{'identical' if same else 'DIFFER'}, {len(ref.rows())} rows with {len(diffs)} differing values"
        + (f"; kernels without a deterministic version: {', '.join(kernels)}" if kernels else "")
    )
    if fig["resumed_from_step"] != 2:
        raise Fail(f"the resume began at step {fig['resumed_from_step']}, not at the snapshot of step 2")
    if not same or diffs:
        where = ", ".join(sorted({d["key"] for d in diffs})[:8])
        raise Fail(
            f"the resumed run differs from the uninterrupted one (weights {'same' if same else 'differ'}; {where})"
        )


# -- 5: LoRA, fp16, gradient checkpointing ---------------------------------------------------------------
def snapshot_bytes(run: Run) -> int | None:
    committed = run.events("snapshot_committed")
    return committed[-1].get("bytes") if committed else None


def check_lora(ctx: Ctx, fig: dict) -> None:
    lora, full = ctx.plan.get("L"), ctx.plan.get("R")
    fig.update(lora.facts())
    lora.ok()
    fig["lora_rank"] = ctx.size.lora_rank
    fig["snapshot_bytes"] = {"lora": snapshot_bytes(lora), "full": snapshot_bytes(full)}
    if None in fig["snapshot_bytes"].values():
        raise Fail(f"a snapshot is missing: {fig['snapshot_bytes']}")
    ratio = fig["full_over_lora"] = round(snapshot_bytes(full) / snapshot_bytes(lora), 1)
    fig["summary"] = (
        f"rank {ctx.size.lora_rank} all-linear: snapshot {snapshot_bytes(lora) / MIB:.1f} MiB against "
        f"{snapshot_bytes(full) / MIB:.1f} MiB for full fine-tuning ({ratio}x smaller)"
    )
    if ratio <= 1:
        raise Fail("the LoRA snapshot is not smaller than the full one")


def check_fp16(ctx: Ctx, fig: dict) -> None:
    if not ctx.plan.has("F"):
        raise Skip(
            "fp16 under DeepSpeed needs CUDA (rlctl refuses it on a CPU without oneDNN fp16; the dry run leaves it out)"
        )
    run = ctx.plan.get("F")
    fig.update(run.facts())
    run.ok()
    rows = run.rows()
    fig["loss_scale"] = [r.get("actor/loss_scale") for r in rows]
    fig["overflow_skipped"] = [r.get("actor/overflow_skipped") for r in rows]
    fig["summary"] = f"loss scale by step {fig['loss_scale']}, overflowed optimizer steps {fig['overflow_skipped']}"
    if None in fig["loss_scale"] or min(fig["loss_scale"]) >= 2.0**16:
        raise Fail("the loss scale never moved from 2^16 (rewards of 1e5 should overflow fp16 gradients)")


def check_ckpt(ctx: Ctx, fig: dict) -> None:
    without, with_ = ctx.plan.get("P"), ctx.plan.get("S")
    fig["with"], fig["without"] = with_.facts(), without.facts()
    with_.ok()
    one, two = with_.rows()[0], without.rows()[0]  # step 1 of each: the same shapes, both warming up
    fig["update_s_step1"] = {"with": one.get("timing_s/update_actor"), "without": two.get("timing_s/update_actor")}
    if ctx.device != "cuda":
        fig["summary"] = "trained with gradient checkpointing; peak GPU memory is measured on CUDA only"
        return
    if with_.gpu_peak_mib is None or without.gpu_peak_mib is None:
        raise Fail("nvidia-smi gave no GPU memory reading of a run")
    saved = fig["saved_gib"] = round((without.gpu_peak_mib - with_.gpu_peak_mib) / 1024, 2)
    fig["summary"] = (
        f"peak GPU memory {with_.gpu_peak_mib / 1024:.2f} GiB with, {without.gpu_peak_mib / 1024:.2f} GiB without "
        f"({saved} GiB saved); update of step 1 {one.get('timing_s/update_actor'):.3g} s against "
        f"{two.get('timing_s/update_actor'):.3g} s"
    )
    if saved <= 0:
        raise Fail("gradient checkpointing did not lower the peak GPU memory")


# -- 6: the snapshot writer process with device tensors ---------------------------------------------------
STAGING = (
    "each device tensor is copied by the training process into a shared-memory host storage (once per "
    "storage and snapshot), which the writer process copies into staging buffers of its own; training "
    "goes on once that copy is made, and the writer serializes, hashes and writes from it"
)


def fence_wait(rows: list[dict], snapshot_step: int) -> float | None:
    """Seconds the update after a snapshot took beyond the others (its optimizer step waits at the fence
    until the writer has its copy), against the median of the steady steps before and after it."""
    update = {r["step"]: r.get("timing_s/update_actor") for r in rows}
    after = update.get(snapshot_step + 1)
    others = [v for s, v in update.items() if s not in (1, snapshot_step + 1) and v is not None]
    return None if after is None or not others else round(max(0.0, after - statistics.median(others)), 4)


def check_writer(ctx: Ctx, fig: dict) -> None:
    run, sync = ctx.plan.get("P"), ctx.plan.get("S")
    fig["asynchronous"] = [
        {k: e.get(k) for k in ("step", "bytes", "stall_s", "commit_s")} for e in run.events("snapshot_committed")
    ]
    fig["synchronous"] = [
        {**{k: e.get(k) for k in ("step", "bytes", "stall_s", "commit_s")}, "save_s": e["stall_s"] + e["commit_s"]}
        for e in sync.events("snapshot_committed")
    ]
    fig["fallbacks"] = [
        e.get("reason") for e in run.events("snapshot_writer_fallback") + sync.events("snapshot_writer_fallback")
    ]
    fig["writer_process_seen"] = bool(run.writer_pids)
    size = fig["asynchronous"][0]["bytes"] if fig["asynchronous"] else 0
    fig["host_staging"] = {
        "how": STAGING,
        "snapshot_gib": round(size / GIB, 3),
        "dev_shm_peak_gib": round(run.shm_peak / GIB, 3),
        "writer_peak_rss_gib": round(run.writer_hwm_kib / (1 << 20), 3),
    }
    if not fig["asynchronous"] or not fig["synchronous"]:
        raise Fail(
            f"a snapshot was not committed (asynchronous {len(fig['asynchronous'])}, synchronous {len(fig['synchronous'])})"
        )
    first = fig["asynchronous"][0]
    fence = fig["fence_wait_s"] = fence_wait(run.rows(), first["step"])
    stall = fig["asynchronous_stall_s"] = round(first["stall_s"] + (fence or 0.0), 4)
    save = fig["synchronous_save_s"] = round(fig["synchronous"][0]["save_s"], 4)
    fig["stall_over_save"] = round(stall / save, 3) if save else None
    fig["summary"] = (
        f"asynchronous stall {stall:.3g} s (save call {first['stall_s']:.3g} s + fence {fence} s) against a "
        f"synchronous save of {save:.3g} s for {size / GIB:.2f} GiB; /dev/shm peak "
        f"{fig['host_staging']['dev_shm_peak_gib']} GiB, writer peak RSS {fig['host_staging']['writer_peak_rss_gib']} GiB"
    )
    if fig["fallbacks"] or not fig["writer_process_seen"]:
        raise Fail(f"the snapshots were not written by the writer process: {fig['fallbacks'] or 'no writer seen'}")
    if ctx.device == "cuda" and stall >= save:
        raise Fail("the asynchronous snapshot stalled training as long as a synchronous save")


# -- 7: the tests marked gpu ----------------------------------------------------------------------------
def check_gpu_tests(ctx: Ctx, fig: dict) -> None:
    if ctx.device != "cuda":
        raise Skip("no CUDA device: every test marked gpu would be skipped")
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    fig["files"] = files
    fig["entry_point"] = ensure_entry_point()
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    budget = min(ctx.size.budgets["gpu_tests"], max(ctx.report.left() - 5, 10))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider", *files]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        raise Fail(f"the gpu tests ran past their budget of {budget:.0f} s") from None
    output = done.stdout + done.stderr
    fig["output_tail"] = output.splitlines()[-25:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", output)}
    fig["counts"], fig["exit"] = counts, done.returncode
    fig["summary"] = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no summary line"
    if done.returncode != 0:
        raise Fail(f"pytest -m gpu exited {done.returncode} ({fig['summary']})")


def ensure_entry_point() -> str:
    """The tests run the `rlctl` console script beside this Python. Where it is missing (a bare image that
    was carried only the wheels), rlctl is installed there from this tree: editable, offline, without
    dependencies; failing that, the console script alone is written (what pip would write)."""
    script = Path(sys.executable).parent / "rlctl"
    if script.exists():
        return f"{script} was there"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation"]
    done = subprocess.run([*cmd, "-e", str(REPO)], capture_output=True, text=True, timeout=120)
    if done.returncode == 0 and script.exists():
        return f"installed {script} (pip install --no-deps --no-index -e .)"
    script.write_text(f"#!{sys.executable}\nimport sys\n\nfrom rlctl.cli import main\n\nsys.exit(main())\n")
    script.chmod(0o755)
    return f"wrote {script} (pip install -e . failed: {' '.join(done.stderr.split())[-300:]})"


# -- 8: the whole ---------------------------------------------------------------------------------------
def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def run_checks(ctx: Ctx) -> None:
    """Checks 1 to 7, in order; each one's budget counts the phases of runs it starts."""
    report, plan, budgets = ctx.report, ctx.plan, ctx.size.budgets
    report.run("1", "env", "environment, rlctl's imports and bounds", budgets["env"], lambda f: check_env(ctx, f))
    report.run("2", "build", "Qwen2-shaped model and tokenizer", budgets["build"], lambda f: check_build(ctx, f))
    runs = [
        ("3", "grpo", "GRPO, ZeRO-2, bf16, HF rollout", ("P",), check_grpo),
        ("4", "resume", "SIGKILL and resume, deterministic", ("R", "K", "K+"), check_resume),
        ("5a", "lora", "LoRA snapshot against the full one", ("L", "R"), check_lora),
        ("5b", "fp16", "fp16 loss scaling", ("F",), check_fp16),
        ("5c", "ckpt", "gradient checkpointing's memory", ("S", "P"), check_ckpt),
        ("6", "writer", "snapshot writer process, device tensors", ("P", "S"), check_writer),
    ]
    for number, name, title, needs, fn in runs:
        pending = plan.budget_until(*(n for n in needs if plan.has(n))) if any(plan.has(n) for n in needs) else 0
        report.run(number, name, title, pending + 10, lambda f, fn=fn: fn(ctx, f))
    report.run("7", "gpu_tests", "pytest -m gpu", budgets["gpu_tests"], lambda f: check_gpu_tests(ctx, f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for report.json and summary.txt")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the built-in model's sizes: the CPU dry run")
    parser.add_argument("--work", type=Path, default=None, help="where the temporary folder goes (default: TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (model, runs, logs)")
    args = parser.parse_args(argv)
    if str(REPO) not in sys.path:  # this tree's rlctl, installed or not (the runs get it on PYTHONPATH)
        sys.path.insert(1, str(REPO))
    os.environ["DS_ACCELERATOR"] = args.device  # before anything imports DeepSpeed
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="rlctl-gpu-check-", dir=args.work))
    meta = {
        "mode": "tiny" if args.tiny else "full",
        "device": args.device,
        "machine": platform.node(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rlctl_commit": git_commit(),
        "budget_s": TOTAL_BUDGET,
        "work": str(work),
    }
    report = Report(args.out, meta)
    ctx = Ctx(args.device, TINY if args.tiny else FULL, args.tiny, work, report, fp16=fp16_here(args.device))
    ctx.plan = Plan(ctx)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        run_checks(ctx)
    except KeyboardInterrupt:
        report.meta["interrupted"] = True
        log("interrupted: the report holds the checks that ran")
    finally:
        for run in ctx.plan.runs.values():
            run.kill()
        report.meta["gpu"] = ctx.gpu_name
        report.write()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(report.summary(), end="")
    log(f"report: {args.out / 'report.json'}")
    return 1 if report.failed() or report.meta.get("interrupted") else 0


def interrupted(signum, frame) -> None:
    """SIGTERM (a timeout's kill) ends the checks as Ctrl-C does: the report keeps what ran."""
    raise KeyboardInterrupt


def fp16_here(device: str) -> bool:
    """Whether DeepSpeed trains in fp16 on this device (rlctl refuses it on a CPU without oneDNN fp16)."""
    if device == "cuda":
        return True
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main())
