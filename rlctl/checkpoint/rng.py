"""The random number generators of the process, as one Stateful: Python, NumPy, torch CPU, and the
generator of this process's CUDA device (where it uses one) or the NPU generators when present."""

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
        if torch.cuda.is_initialized():  # (a CPU run on a GPU machine makes no CUDA context for this)
            state["cuda"] = torch.cuda.get_rng_state()  # this rank's device's: the others are other ranks'
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            state["npu"] = npu.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("RNG", state, self.VERSION)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(_this_devices(state["cuda"]))
        npu = getattr(torch, "npu", None)
        if "npu" in state and npu is not None and npu.is_available():
            npu.set_rng_state_all(state["npu"])


def _this_devices(saved: Any) -> torch.Tensor:
    """The saved CUDA generator state of this process's device. Earlier snapshots hold a list, one state
    per visible device, where this rank's is at its device's index (a resume on fewer visible devices has
    no such index: device 0's then, as a rank on one device is)."""
    if isinstance(saved, torch.Tensor):
        return saved
    index = torch.cuda.current_device()
    return saved[index] if index < len(saved) else saved[0]
