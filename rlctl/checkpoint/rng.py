"""The random number generators of the process, as one Stateful: Python, NumPy, torch CPU, and the
CUDA or NPU generators when present."""

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
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            state["npu"] = npu.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("RNG", state, self.VERSION)
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        npu = getattr(torch, "npu", None)
        if "npu" in state and npu is not None and npu.is_available():
            npu.set_rng_state_all(state["npu"])
