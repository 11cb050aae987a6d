"""Names of the files in a run directory, in one place (see rlctl/rundir/__init__.py for what each holds),
and the error of a directory that holds no run."""

import re

from rlctl.errors import ConfigError

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
ABANDONED = "metrics.abandoned.jsonl"
EVENTS = "events.jsonl"
POLICY_STATE = "policy_state.json"
MODEL = "model"
CHECKPOINTS = "checkpoints"
TOOL_CALLS = "tools"
TRAJECTORIES = "trajectories"
# a file of one step and rank under TOOL_CALLS or TRAJECTORIES: step-000012.rank-0.jsonl
STEP_RANK_FILE = re.compile(r"step-(\d{6})\.rank-(\d+)\.jsonl")


def step_rank_file(folder: str, step: int, rank: int) -> str:
    return f"{folder}/step-{step:06d}.rank-{rank}.jsonl"


def not_a_run(url: str) -> ConfigError:
    """The error of a directory that holds no run (no config.yaml, or not even metric rows)."""
    return ConfigError(f"{url} is not an rlctl run directory (it has no {CONFIG})")
