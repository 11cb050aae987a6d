"""The knobs: run-config settings that are safe to change in the middle of a run, one list.

A policy's ``adjust`` action may change them, a run config may give them a ``schedule``, and
``rlctl resume --set`` may change them (with a few settings that may change only between processes,
``RESUME_ONLY``). Each one takes effect at the next step without rebuilding anything; what does not
(the model, the batch shape, the ZeRO stage, the seed) is not a knob: changing it would make the run
another run.

Pure data (this floor knows no config model); ``rlctl.config`` checks that every knob is a number
field of the run config, and the trainer makes the engine follow each one.
"""

from __future__ import annotations

KNOBS: dict[str, str] = {
    "actor.lr": "the actor's base learning rate (warm-up still applies on top)",
    "actor.grad_clip": "the actor's gradient-norm clip",
    "actor.weight_decay": "the actor's AdamW weight decay",
    "critic.lr": "the critic's base learning rate",
    "critic.grad_clip": "the critic's gradient-norm clip",
    "critic.cliprange_value": "the value-function clip range",
    "algorithm.kl_coef": "the KL coefficient (an adaptive controller's current value)",
    "algorithm.kl_ctrl.target_kl": "the KL an adaptive controller steers toward",
    "algorithm.clip_ratio": "the PPO clip range epsilon",
    "algorithm.clip_ratio_low": "the lower clip epsilon",
    "algorithm.clip_ratio_high": "the upper clip epsilon (clip-higher)",
    "algorithm.clip_ratio_c": "the dual-clip bound for negative advantages",
    "algorithm.entropy_coef": "the entropy bonus weight",
    "rollout.temperature": "the sampling temperature (and the one log-probs are computed at)",
}

# settings ``rlctl resume --set`` may also change: they take effect when a process starts
RESUME_ONLY: frozenset[str] = frozenset(
    {
        "trainer.total_steps",
        "trainer.num_threads",
        "trainer.lease_timeout",
        "trainer.lease_heartbeat",
        "rollout.max_new_tokens",
        "checkpoint.every",
        "checkpoint.keep_last",
        "checkpoint.keep_every",
        "checkpoint.asynchronous",
        "checkpoint.writer",
        "checkpoint.staging_dir",
        "cluster.address",
        "trainer.nproc",  # another world size: an elastic resume (rlctl.checkpoint.elastic)
        "trainer.nnodes",
        "trainer.n_devices_per_node",
        "rollout.multi_turn.tool_retry_budget",  # (a multi-turn run's tools: how long to ride out an outage,
        "rollout.multi_turn.tool_timeout_s",  # how long a call may run, how many run at once)
        "rollout.multi_turn.tool_workers",
    }
)

SAFE_ON_RESUME: frozenset[str] = frozenset(KNOBS) | RESUME_ONLY
