"""rlctl: resumable GRPO/PPO fine-tuning of language models on DeepSpeed ZeRO."""

__version__ = "0.1.0"
