"""Which accelerator DeepSpeed chose in this process, read without importing torch or DeepSpeed (the
ranks floor asks before the run's imports: ``rlctl.ranks.worker``; ``rlctl.engine.runtime`` when it sets
the run's)."""

from __future__ import annotations

import sys


def deepspeed_accelerator() -> str | None:
    """The accelerator DeepSpeed chose in this process (it reads DS_ACCELERATOR as it chooses), None
    before it chose or when it is not imported."""
    real = sys.modules.get("deepspeed.accelerator.real_accelerator")
    return getattr(getattr(real, "ds_accelerator", None), "_name", None)
