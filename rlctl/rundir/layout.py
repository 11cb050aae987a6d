"""Every name of a run directory, in one place, and the error of a directory that holds no run.

See rlctl/rundir/__init__.py for what each holds. A module that trains or reads a run asks
for these names; it never spells one. Inside a snapshot, rlctl/checkpoint/layout.py names the files."""

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
# a file of one step and rank under TOOL_CALLS or TRAJECTORIES: step-000012.rank-0.jsonl
STEP_RANK_FILE = re.compile(r"step-(\d{6})\.rank-(\d+)\.jsonl")


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
