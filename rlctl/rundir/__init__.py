"""The run directory on any fsspec storage (local, s3://, memory://).

RUN_DIR/
  config.yaml              the resolved config (every key; updated by `resume --set`, changes in events)
  model/                   the built-in model and tokenizer (when model.path is empty)
  metrics.jsonl            one orjson row per step, each step exactly once
  metrics.abandoned.jsonl  rows of steps a resume turned away from, tagged with the resume
  events.jsonl             start, resume, snapshot commits and failures, preemption, completion
  lease.json               the live writer (host, pid, when taken); absent when nobody writes
  .lease/                  the writer's heartbeat (beat-OWNER) and takeover markers
  checkpoints/             snapshots (unless checkpoint.dir is set)

``layout`` names these files; ``directory`` creates and loads a run directory, finds its snapshots
and summarises it; ``overrides`` says what ``rlctl resume --set`` may change; ``history`` turns a
run away from the steps after N; ``lease`` keeps one writer per run.
"""
