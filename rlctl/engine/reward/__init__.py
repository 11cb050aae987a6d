"""Reward functions, loaded by ``module:function`` like any user's, and called as untrusted code.

A reward function is called once per step as ``fn(prompts, completions, **columns, **kwargs)`` where
``prompts`` and ``completions`` are lists of strings of equal length (each prompt repeated
``group_size`` times) and ``columns`` are the dataset's other columns, aligned the same way. It returns
one finite number per completion (a list, tuple, 1-D numpy array or tensor; ints, floats, numpy numbers
and bools count). This is the signature TRL's reward functions use, so they carry over. Under a
multi-turn rollout an item may instead be ``{"score": number, "turns": [number, ...]}``: rewards of the
model's single turns besides the score (``check_scores``).

The module's import and every call are user code (``rlctl.usercode``): whatever they raise or exit with
is an InputError naming ``module:function`` and the cause, and so is a result that is not one finite
number per completion. ``loader`` imports the function, ``scores`` calls it and checks what it returned;
``sources`` composes a run's rewards, and ``builtin``, ``gsm8k``, ``lookup``, ``code``, ``model`` and
``remote`` are rewards of rlctl's own.
"""

from rlctl.engine.reward.loader import RewardFn, load_reward_fn
from rlctl.engine.reward.scores import BatchScorer, check_scores, finite_number, score_completions
from rlctl.usercode import call_user_code, describe_exception

__all__ = [
    "BatchScorer",
    "RewardFn",
    "call_user_code",
    "check_scores",
    "describe_exception",
    "finite_number",
    "load_reward_fn",
    "score_completions",
]
