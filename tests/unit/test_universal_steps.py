"""After a universal-checkpoint load (elastic resume), each optimizer ``step`` sits beside its parameter
where the optimizer is fused or capturable (a fused CUDA AdamW reads it unchecked), found through the
optimizer's state (ZeRO-3 leaves its groups' parameter lists empty between steps). The CPU has one
device, so the parameter here is on the meta device."""

import torch

from rlctl.engine.universal import _steps_beside_their_parameters


class Optimizer:  # (what the function reads of a torch optimizer: its groups' flags and its state)
    def __init__(self, flags: dict, state: dict) -> None:
        self.param_groups, self.state = [{"params": [], **flags}], state


def test_a_fused_optimizers_steps_move_beside_their_parameters_and_others_stay():
    away, here = torch.nn.Parameter(torch.empty(3, device="meta")), torch.nn.Parameter(torch.empty(3))
    kept = torch.tensor(5.0)
    fused = Optimizer({"fused": True}, {away: {"step": torch.tensor(5.0, dtype=torch.float64)}, here: {"step": kept}})
    _steps_beside_their_parameters(fused)
    moved = fused.state[away]["step"]
    assert moved.device == away.device and moved.dtype == torch.float32
    assert fused.state[here]["step"] is kept
    plain = Optimizer({"fused": False}, {away: {"step": kept}})
    _steps_beside_their_parameters(plain)
    assert plain.state[away]["step"] is kept  # (an unfused AdamW keeps its steps on the CPU)
