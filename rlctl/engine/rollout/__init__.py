"""Rollouts: prompts in, sampled completions out. ``backends`` holds the one interface and picks a backend
(``hf``: rlctl's own batched decode over the actor's module, ``kv_cache`` its static cache and CUDA
graphs; ``vllm``), ``multi_turn`` and ``vllm_multi_turn`` the conversations with tools, ``sampling`` and
``noise`` how a token is drawn, ``seeds`` the seed of every sample. This package only re-exports.
"""

from rlctl.engine.rollout.backends import RolloutBackend, make_backend
from rlctl.engine.rollout.seeds import sample_seed

__all__ = ["RolloutBackend", "make_backend", "sample_seed"]
