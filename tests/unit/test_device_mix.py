"""The watch that finds on the CPU the device mixes a GPU would refuse (tests/device_mix.py), on calls of
this file's: what it reports and what it lets pass, as CUDA does."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from device_mix import DEVICE, DeviceMix  # noqa: E402


def watched(fn) -> list[str]:
    """The calls of ``fn`` (run under the watch) that it reports."""
    mode = DeviceMix(root=__file__)
    with mode:
        fn()
    return [m["call"] for m in mode.mixes.values()]


def test_a_cpu_tensor_of_one_dimension_or_more_beside_a_device_tensor_is_reported():
    def mixes():
        on = torch.ones(4, device=DEVICE)
        torch.isin(on, torch.tensor([1.0]))  # (the HF rollout's decode, before its fix)
        torch.where(on > 0, on, torch.zeros(4))
        _ = on.to(dtype=torch.float64) + torch.ones(4)  # a dtype is no move
        torch.mm(torch.ones(2, 4), torch.nn.Parameter(torch.ones(4, 4)))  # a weight's input left behind

    assert watched(mixes) == ["isin", "where", "add", "mm"]


def test_what_cuda_allows_is_not_reported():
    def allowed():
        on = torch.nn.Linear(4, 4)(torch.ones(2, 4, device=DEVICE))  # (a parameter is on the device)
        _ = on * torch.tensor(2.0)  # a 0-dimensional CPU tensor
        _ = on[torch.tensor([0])]  # indexing with a CPU index
        _ = on.cpu() + torch.ones(2, 4)  # moved to the CPU first (here the same tensor: told apart)
        _ = torch.zeros(2, 4, device=on.device) + on  # made on the device through .device
        _ = torch.ones(2, 4).to(on.device) + on  # moved there
        _ = torch.full_like(on, 1.0) + on  # made like it
        on.detach().copy_(torch.ones(2, 4))  # copies cross devices

    assert watched(allowed) == []
    assert torch.nn.Linear(1, 1).weight.device == torch.device("cpu")  # (outside the watch: the CPU's)
