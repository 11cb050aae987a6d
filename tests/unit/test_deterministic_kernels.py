"""trainer.deterministic: a rank opened with it computes with deterministic kernels (the settings CUDA
needs for a resumed run to repeat an uninterrupted one); one opened without it leaves torch's defaults."""

import os

import pytest
import torch

from rlctl.config import RunConfig
from rlctl.engine.runtime import CUBLAS_WORKSPACE, open_rank


@pytest.fixture
def torch_defaults_back(monkeypatch):
    """What these tests change in the process is put back (other tests share the worker)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
    torch.utils.deterministic.fill_uninitialized_memory = before[4]


def test_a_deterministic_rank_sets_every_setting(torch_defaults_back):
    torch.backends.cudnn.benchmark = True
    open_rank(RunConfig.model_validate({"device": "cpu", "trainer": {"deterministic": True}}))
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()  # a missing kernel warns, never stops a run
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    # no NaN fill of every torch.empty on the CPU (deterministic without it; it made updates 20-50x slower)
    assert torch.utils.deterministic.fill_uninitialized_memory is False


def test_a_workspace_the_user_set_is_kept(torch_defaults_back, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    open_rank(RunConfig.model_validate({"device": "cpu", "trainer": {"deterministic": True}}))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_the_default_leaves_torch_alone(torch_defaults_back):
    assert RunConfig().trainer.deterministic is False
    open_rank(RunConfig.model_validate({"device": "cpu"}))
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory is True  # torch's default, untouched
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
