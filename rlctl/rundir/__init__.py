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
  tools/                   a multi-turn run's tool calls by step and rank, and their answers (results/,
                           by sha256): replayed when a step runs again (rlctl.engine.tools.record)
  trajectories/            a multi-turn run's conversations by step and rank (`rlctl trajectories`)

Writing a run: ``layout`` names these files; ``directory`` creates and loads a run directory;
``overrides`` says what ``rlctl resume --set`` may change; ``history`` turns a run away from the steps
after N; ``lease`` keeps one writer per run.
Its snapshots: ``snapshots`` gives a run's catalog (the read side) and manager (the write side);
``selection`` chooses snapshots for a resume, an export and a rollback, and holds the resume plan.
Reading a run (never writing): ``transcripts`` reads a multi-turn run's conversations; ``record`` is
the one reading of a run (config, rows in write order,
events, last outcome, status); ``replay`` replays a policy over that history; ``summary`` says what a
run holds, for ``rlctl inspect`` and at a run's end.
"""
