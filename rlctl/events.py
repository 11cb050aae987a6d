"""The names of the events of ``events.jsonl``, in one place: what the code emits and what it reads.

Each event is a JSON object ``{"time": ..., "event": NAME, ...}``; a name here is the ``event`` field's
value. The names are part of rlctl's interface (cron scripts and trackers read them): never rename one.
"""

# how a run begins and continues
START = "start"
RESUME = "resume"
STARTED_OVER = "started_over"  # a resume that found no snapshot ever committed trains again from step 0
LEASE_TAKEN_OVER = "lease_taken_over"
UNCOMMITTED_REMOVED = "uncommitted_removed"
PROMPTS_FILTERED = "prompts_filtered"

# how a run ends
COMPLETED = "completed"
HALTED = "halted"
PREEMPTED = "preempted"
CRASHED = "crashed"
INTERRUPTED = "interrupted"
NODE_LOST = "node_lost"  # a Ray node that held ranks was lost (step, snapshot; nodes: id, ip, ranks, cause)
RANKS_PLACED = "ranks_placed"  # where Ray placed each rank (rank, node id, IP), by rank 0 as it starts

# the policies and what carrying out a verdict did
POLICY = "policy"
ROLLBACK = "rollback"
ADJUST = "adjust"
SKIP = "skip"
POLICY_STATE_IGNORED = "policy_state_ignored"

# snapshots
SNAPSHOT_COMMITTED = "snapshot_committed"
SNAPSHOT_FAILED = "snapshot_failed"
SNAPSHOT_UNUSABLE = "snapshot_unusable"
SNAPSHOT_QUARANTINED = "snapshot_quarantined"
SNAPSHOT_WRITER_FALLBACK = "snapshot_writer_fallback"
SNAPSHOTS_PURGED = "snapshots_purged"
SNAPSHOTS_PURGE_FAILED = "snapshots_purge_failed"

# fault drills (rlctl.faults): a drill that fired, recorded so that it fires once in the run
DRILL_FIRED = "drill_fired"

# multi-turn rollouts (rlctl.engine.rollout.multi_turn)
TEMPLATE_DRIFT = "template_drift"  # a conversation's ids differ from its whole rendering (the first position)
TOOL_CALLS_REPLAYED = "tool_calls_replayed"  # a step run again got its recorded tool answers
TOOLS_UNAVAILABLE = "tools_unavailable"  # every tool call failed (infrastructure) past tool_retry_budget: stopping

# the outcomes a run can end with: the last of them (after the last start or resume) is how it ended
ENDED = frozenset({COMPLETED, HALTED, PREEMPTED, CRASHED, INTERRUPTED, NODE_LOST})
