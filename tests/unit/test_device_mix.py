"""The watch that finds on the CPU the device mixes a GPU would refuse (tests/support/device_mix.py), on calls of
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


def test_a_cpu_tensor_indexed_by_a_device_tensor_is_reported():
    def indexing():
        on = torch.arange(4, device=DEVICE)
        torch.arange(8)[on]  # (CUDA: indices on the CPU or on the indexed tensor's device)

    assert watched(indexing) == ["__getitem__"]


def test_a_library_given_a_cpu_input_is_reported_where_the_watched_code_called_it(tmp_path):
    (tmp_path / "a_model_library.py").write_text(
        "import torch\n\ndef embed(ids, table):\n    return torch.nn.functional.embedding(ids, table)\n"
    )
    sys.path.insert(0, str(tmp_path))
    from a_model_library import embed

    mode = DeviceMix(root=__file__)
    with mode:
        embed(torch.tensor([[1, 2]]), torch.nn.Parameter(torch.ones(4, 3)))
    (mix,) = mode.mixes.values()
    assert mix["call"] == "embedding" and "embed(torch.tensor" in mix["code"] and "a_model_library.py" in mix["in"]


def test_what_cuda_allows_is_not_reported():
    def allowed():
        on = torch.nn.Linear(4, 4)(torch.ones(2, 4, device=DEVICE))  # (a parameter is on the device)
        _ = on * torch.tensor(2.0)  # a 0-dimensional CPU tensor
        _ = on[torch.tensor([0])]  # indexing with a CPU index
        on[torch.tensor([0])] = torch.zeros(1, 4)  # and writing through one
        _ = on.cpu() + torch.ones(2, 4)  # moved to the CPU first (here the same tensor: told apart)
        _ = torch.zeros(2, 4, device=on.device) + on  # made on the device through .device
        _ = torch.ones(2, 4).to(on.device) + on  # moved there
        _ = torch.full_like(on, 1.0) + on  # made like it
        on.detach().copy_(torch.ones(2, 4))  # copies cross devices

    assert watched(allowed) == []
    assert torch.nn.Linear(1, 1).weight.device == torch.device("cpu")  # (outside the watch: the CPU's)
