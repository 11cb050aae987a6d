"""The run directory on any fsspec storage (local, s3://, memory://).

``layout`` names every file of a run and says what each holds (``layout.tree()``, drawn in
docs/concepts.md). ``handle`` is the run as the engine is handed it (``RunDir``: its logs, config,
policy state, turning back, tool-call record, trajectories and built-in model, whose ``model_store``
keeps it whole); the engine imports nothing else of this floor. Writing a run: ``directory`` creates and loads a run directory;
``overrides`` says what ``rlctl resume --set`` may change; ``history`` turns a run away from the steps
after N; ``lease`` keeps one writer per run.
Its snapshots: ``snapshots`` gives a run's catalog (the read side) and manager (the write side);
``selection`` chooses snapshots for a resume, an export and a rollback, and holds the resume plan.
Reading a run (never writing): ``trajectories`` reads a multi-turn run's conversations; ``record`` is
the one reading of a run (config, rows in write order,
events, last outcome, status); ``replay`` replays a policy over that history; ``summary`` says what a
run holds, for ``rlctl inspect`` and at a run's end.
"""
