"""The random number generators of the process, as one Stateful: Python, NumPy, torch CPU, and the
generator of this process's CUDA or NPU device, where it uses one."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from rlctl.stateful import check_version


class RNGState:
    VERSION = 1

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "version": self.VERSION,
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        for name, module in _accelerators_in_use():  # this rank's device's: the others are other ranks'
            state[name] = module.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("RNG", state, self.VERSION)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        for name, module in _accelerators_in_use():
            if name in state:
                module.set_rng_state(_this_devices(module, state[name]))


def _accelerators_in_use() -> list[tuple[str, Any]]:
    """("cuda", torch.cuda) and ("npu", torch.npu) where this process has made a context on one (a CPU run
    on a GPU machine makes none for its snapshots: a context before the writer's fork refuses the fork)."""
    found = []
    for name in ("cuda", "npu"):
        module = getattr(torch, name, None)
        initialized = getattr(module, "is_initialized", None) or getattr(module, "is_available", None)
        if initialized is not None and initialized():
            found.append((name, module))
    return found


def _this_devices(module: Any, saved: Any) -> torch.Tensor:
    """The saved generator state of this process's device. Earlier snapshots hold a list, one state per
    visible device, where this rank's is at its device's index (a resume on fewer visible devices has no
    such index: device 0's then, as a rank on one device is)."""
    if isinstance(saved, torch.Tensor):
        return saved
    index = module.current_device()
    return saved[index] if index < len(saved) else saved[0]
