"""Every name of a run directory, in one place, and the error of a directory that holds no run.

``TREE`` says what each holds and ``tree()`` draws it: docs/concepts.md shows that drawing, written
by docs/gen_run_dir.py and checked for drift by a test. A module that trains or reads a run asks for
these names; it never spells one. Inside a snapshot, rlctl/checkpoint/layout.py names the files."""

import os
import re
import time

from rlctl.errors import ConfigError

CONFIG = "config.yaml"
MODEL = "model"
MODEL_COMPLETE = ".rlctl-complete"  # written last into MODEL: the only proof the directory is whole
MODEL_TEMPORARY = f".{MODEL}.tmp-"  # MODEL being written (a local run), renamed into place when whole
METRICS = "metrics.jsonl"
ABANDONED = "metrics.abandoned.jsonl"
EVENTS = "events.jsonl"
LEASE_FILE = "lease.json"
BEAT_DIR = ".lease"
POLICY_STATE = "policy_state.json"
CHECKPOINTS = "checkpoints"
TOOL_CALLS = "tools"
TOOL_RESULTS = f"{TOOL_CALLS}/results"
TRAJECTORIES = "trajectories"
TRACKERS = "trackers.json"
# a file of one step and rank under TOOL_CALLS or TRAJECTORIES: step-000012.rank-0.jsonl
STEP_RANK_FILE = re.compile(r"step-(\d{6})\.rank-(\d+)\.jsonl")


# What each name holds, in the order a person reads them; a description may go on over rows of its own.
# The trackers' own folders and databases are named by each tracker (rlctl/trackers, on a floor above).
TREE = [
    (CONFIG, "the resolved config: every key, defaults included (updated by `resume --set`)"),
    (f"{MODEL}/", "the built-in model and tokenizer (save_pretrained; reload with any HF tool) when"),
    ("", f"model.path is empty; {MODEL_COMPLETE} in it is written last (a local run writes it"),
    ("", f"into {MODEL_TEMPORARY}*, renamed into place when whole)"),
    (METRICS, "one orjson line per step, each step exactly once"),
    (ABANDONED, "rows of steps a resume turned away from, tagged with that resume"),
    (EVENTS, "start, prompts filtered (data.filter_overlong_prompts), snapshot commits and"),
    ("", "failures, resumes (and their source), policy firings, rollbacks, adjustments, skips,"),
    ("", "halts, preemption, completion (with a sha256 of the final weights)"),
    (LEASE_FILE, "the live writer: host, pid, when it took the run (absent when nobody writes)"),
    (f"{BEAT_DIR}/", "the writer's heartbeat (beat-OWNER) and takeover markers"),
    (POLICY_STATE, "the rollback policies' state at the last rollback or halt, with its step"),
    (f"{CHECKPOINTS}/step-000500/", "a snapshot (or under checkpoint.dir)"),
    (f"{CHECKPOINTS}/quarantine/", "snapshots whose manifest could not be read, moved aside (never deleted)"),
    (f"{TOOL_CALLS}/", "a multi-turn run's tool calls by step and rank (step-000012.rank-0.jsonl), and"),
    ("", f"their answers by sha256 ({TOOL_RESULTS}/): replayed when a step runs again"),
    (f"{TRAJECTORIES}/", "a multi-turn run's conversations by step and rank (`rlctl trajectories`)"),
    ("tensorboard/ wandb/", "trackers' files (trainer.loggers); mlflow.db and mlartifacts/ for MLflow"),
    (TRACKERS, "the W&B and MLflow runs a resume continues"),
]


def tree() -> str:
    """The run directory drawn as text: a name and what it holds on each line."""
    width = max(len(name) for name, _ in TREE) + 2
    lines = [f"  {name:<{width}}{what}" for name, what in TREE]
    return "\n".join(["RUN_DIR/", *lines]) + "\n"


def step_rank_file(folder: str, step: int, rank: int) -> str:
    return f"{folder}/step-{step:06d}.rank-{rank}.jsonl"


def beat_file(owner: str) -> str:
    """The heartbeat file of the lease's ``owner``."""
    return f"{BEAT_DIR}/beat-{owner}"


def takeover_file(digest: str) -> str:
    """The marker of a takeover of the stale lease whose record has sha256 ``digest``."""
    return f"{BEAT_DIR}/takeover-{digest}"


def set_aside(name: str) -> str:
    """Where an unreadable ``name`` of the run directory is moved aside (never deleted)."""
    return f"{name}.incomplete-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


def not_a_run(url: str) -> ConfigError:
    """The error of a directory that holds no run (no config.yaml, or not even metric rows)."""
    return ConfigError(f"{url} is not an rlctl run directory (it has no {CONFIG})")
