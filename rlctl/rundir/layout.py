"""Names of the files in a run directory, in one place (see rlctl/rundir/__init__.py for what each holds)."""

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
ABANDONED = "metrics.abandoned.jsonl"
EVENTS = "events.jsonl"
POLICY_STATE = "policy_state.json"
MODEL = "model"
CHECKPOINTS = "checkpoints"
