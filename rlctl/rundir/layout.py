"""Names of the files in a run directory, in one place (see rlctl/rundir/__init__.py for what each holds),
and the error of a directory that holds no run."""

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


def not_a_run(url: str) -> ConfigError:
    """The error of a directory that holds no run (no config.yaml, or not even metric rows)."""
    return ConfigError(f"{url} is not an rlctl run directory (it has no {CONFIG})")
