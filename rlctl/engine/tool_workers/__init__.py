"""Running a rollout's tool calls: the rank's worker processes (``pool``) and what each runs
(``process``), the run's tools as loaded from its config (``loader``), the record of calls a resume
replays (``call_record``) and the retry budget of steps whose tools were down (``budget``). Not to be
confused with ``rlctl.tools``: what a tool author imports (formats, schemas, ``ToolError``)."""
