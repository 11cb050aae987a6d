"""Device selection (auto, cuda, npu, cpu) and what follows from it: DeepSpeed's accelerator, the
torch.distributed backend, the torch.device, the default precision, thread settings.

The CUDA and NPU branches run on a CPU machine by patching ``torch.cuda`` and by putting a stand-in
``torch_npu`` package on ``sys.path``: they test rlctl's selection logic, not a real GPU or NPU.
"""

import importlib.util
import os
import sys
import textwrap

import pytest
import torch

from rlctl.engine import runtime
from rlctl.engine.runtime import (
    Runtime,
    check_rollout_device,
    resolve_device,
    resolve_dtype,
    setup_runtime,
)
from rlctl.errors import ConfigError

ENV_KEYS = (
    "DS_ACCELERATOR",
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
needs_no_torch_npu = pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")

FAKE_NPU = """
import types

import torch

calls = []
npu = types.SimpleNamespace(
    is_available=lambda: {available},
    device_count=lambda: 2,
    set_device=calls.append,
    is_bf16_supported=lambda: {bf16},
)
torch.npu = npu  # what the real torch_npu registers
"""


@pytest.fixture(autouse=True)
def env():
    """The process environment and thread count as they were: setup_runtime writes both."""
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    threads = torch.get_num_threads()
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_num_threads(threads)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda says two devices with native bf16; set_device calls are recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return calls


@pytest.fixture
def quiet(monkeypatch):
    """No transformers/DeepSpeed import: DeepSpeed would pick its accelerator from a fake device."""
    monkeypatch.setattr(runtime, "quiet_libraries", lambda: None)


@pytest.fixture
def install_npu(tmp_path, monkeypatch):
    """Put a stand-in torch_npu package on sys.path (installed, not imported); undone afterwards."""
    assert "torch_npu" not in sys.modules
    monkeypatch.setattr(torch, "npu", None, raising=False)  # removed again afterwards

    def install(body: str = FAKE_NPU.format(available=True, bf16=True)) -> None:
        (tmp_path / "torch_npu").mkdir()
        (tmp_path / "torch_npu" / "__init__.py").write_text(textwrap.dedent(body))
        monkeypatch.syspath_prepend(str(tmp_path))

    yield install
    sys.modules.pop("torch_npu", None)


# -- auto on a CPU-only machine -------------------------------------------------------------------------


@needs_no_torch_npu
def test_auto_on_a_cpu_machine_is_cpu_gloo_fp32_and_never_imports_torch_npu(no_cuda):
    assert resolve_device("auto") == "cpu"
    assert "torch_npu" not in sys.modules
    rt = setup_runtime("auto", "auto", 1)  # the real thing, library imports included
    assert rt == Runtime(torch.device("cpu"), torch.float32, "gloo", "cpu")
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert rt.accelerator is None
    assert "torch_npu" not in sys.modules


def test_runtime_keeps_its_three_field_constructor():
    rt = Runtime(torch.device("cpu"), torch.float32, "gloo")
    assert rt.kind == "cpu" and rt.accelerator is None


# -- explicit devices that are not there ----------------------------------------------------------------


def test_explicit_cuda_without_cuda_names_device(no_cuda):
    with pytest.raises(ConfigError, match=r"^'device' is cuda but torch sees no CUDA device; use device: cpu"):
        resolve_device("cuda")


@needs_no_torch_npu
def test_explicit_npu_without_torch_npu_names_device_and_the_fix():
    with pytest.raises(ConfigError) as err:
        resolve_device("npu")
    assert err.value.message.startswith("'device' is npu but torch_npu is not installed; install torch_npu")
    assert "use device: cpu or auto" in err.value.message
    assert "torch_npu" not in sys.modules


def test_unknown_device_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="'device' is 'tpu'; valid: auto, cuda, npu, cpu"):
        resolve_device("tpu")


# -- auto order: CUDA, then NPU, then CPU -----------------------------------------------------------------


def test_auto_takes_cuda_first_without_importing_torch_npu(fake_cuda, install_npu):
    install_npu()
    assert resolve_device("auto") == "cuda"
    assert "torch_npu" not in sys.modules


def test_auto_takes_an_npu_when_torch_npu_sees_one(no_cuda, install_npu):
    install_npu()
    assert resolve_device("auto") == "npu"
    assert "torch_npu" in sys.modules
    assert resolve_device("npu") == "npu"


@pytest.mark.parametrize(
    "body, why",
    [
        ("raise ImportError('libhccl.so: cannot open shared object file')", "torch_npu does not import (ImportError"),
        ("raise RuntimeError('Two accelerators cannot be used at the same time')", "torch_npu does not import (Run"),
        (FAKE_NPU.format(available=False, bf16=True), "torch_npu sees no NPU"),
        ("", "torch_npu imported but registered no torch.npu"),
    ],
    ids=["import-error", "broken-install", "no-device", "no-torch.npu"],
)
def test_auto_falls_back_to_cpu_quietly_where_npu_npu_gives_the_reason(no_cuda, install_npu, capsys, body, why):
    install_npu(body)
    assert resolve_device("auto") == "cpu"
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError) as err:
        resolve_device("npu")
    assert err.value.message.startswith(f"'device' is npu but {why}")


# -- precision -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pref, kind, expected",
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("auto", "npu", torch.bfloat16),
        ("fp32", "cuda", torch.float32),
        ("fp32", "npu", torch.float32),
        ("bf16", "cpu", torch.bfloat16),
        ("bf16", "npu", torch.bfloat16),
    ],
)
def test_dtype_per_device(fake_cuda, install_npu, pref, kind, expected):
    install_npu()
    if kind == "npu":
        resolve_device("npu")
    assert resolve_dtype(pref, kind) == expected


def test_auto_dtype_is_fp32_without_native_bf16(fake_cuda, install_npu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_dtype("auto", "cuda") == torch.float32  # a V100: bf16 only by emulation
    install_npu(FAKE_NPU.format(available=True, bf16=False))
    resolve_device("npu")
    assert resolve_dtype("auto", "npu") == torch.float32  # an Ascend 910A
    assert resolve_dtype("bf16", "npu") == torch.bfloat16


# -- the whole setup per device --------------------------------------------------------------------------


def test_setup_on_cuda_binds_local_rank_and_leaves_threads_alone(fake_cuda, quiet, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    threads = torch.get_num_threads()
    rt = setup_runtime("auto", "auto", 1)
    assert rt == Runtime(torch.device("cuda", 1), torch.bfloat16, "nccl", "cuda")
    assert fake_cuda == [1]
    assert os.environ["DS_ACCELERATOR"] == "cuda"
    assert os.environ["OMP_NUM_THREADS"] == "7" and torch.get_num_threads() == threads


def test_setup_on_npu_binds_local_rank_with_hccl(no_cuda, install_npu, quiet, monkeypatch):
    install_npu()
    monkeypatch.setenv("LOCAL_RANK", "1")
    # A CPU-only torch knows no 'npu' device type until the real torch_npu renames PrivateUse1.
    monkeypatch.setattr(torch, "device", lambda kind, index=None: f"{kind}:{index}")
    rt = setup_runtime("npu", "auto", 1)
    assert (rt.device, rt.dtype, rt.backend, rt.kind) == ("npu:1", torch.bfloat16, "hccl", "npu")
    assert sys.modules["torch_npu"].calls == [1]
    assert rt.accelerator is torch.npu
    assert os.environ["DS_ACCELERATOR"] == "npu"


@pytest.mark.parametrize(
    "local_rank, count, index", [(0, 2, 0), (1, 2, 1), (3, 1, 0)], ids=["rank0", "rank1", "one-visible"]
)
def test_device_index_is_local_rank_or_the_only_visible_one(fake_cuda, monkeypatch, local_rank, count, index):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert runtime.bind_device("cuda") == torch.device("cuda", index)
    assert fake_cuda == [index]


def test_more_ranks_than_devices_is_a_config_error(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match=r"local rank 2 has no cuda device of its own \(2 visible\)"):
        runtime.bind_device("cuda")


def test_local_ranks_need_a_device_each_before_any_starts(fake_cuda, monkeypatch, tmp_path):
    """Three local ranks on a machine with two GPUs: a ConfigError from the driver, before any rank
    process starts (not NCCL's duplicate-GPU error from inside the ranks later)."""
    from rlctl.config import RunConfig
    from rlctl.ranks import local
    from rlctl.storage import Storage

    runtime.check_local_ranks("cuda", 2)  # one each: fine
    runtime.check_local_ranks("auto", 2)
    spawned = []
    monkeypatch.setattr(local.subprocess, "Popen", lambda *a, **k: spawned.append(a))
    cfg = RunConfig.model_validate(
        {"device": "cuda", "trainer": {"nproc": 3, "prompts_per_step": 6}, "algorithm": {"group_size": 2}}
    )
    with pytest.raises(
        ConfigError,
        match=r"'trainer.nproc' is 3 but this machine has 2 cuda devices; every local "
        r"rank needs one of its own: use --nproc 2 or fewer",
    ):
        local.launch_local(Storage(str(tmp_path / "run")), cfg, None, reporter=None)
    assert spawned == []


def test_cpu_ranks_share_the_cpu(no_cuda):
    runtime.check_local_ranks("auto", 4)
    runtime.check_local_ranks("cpu", 4)


def test_cpu_threads_follow_num_threads(no_cuda, quiet):
    setup_runtime("cpu", "fp32", 2)
    assert os.environ["OMP_NUM_THREADS"] == "2" and torch.get_num_threads() == 2
    setup_runtime("cpu", "fp32", 1)
    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1


def test_the_resolved_device_wins_over_ds_accelerator_with_a_warning(no_cuda, quiet, monkeypatch, capsys):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    setup_runtime("cpu", "fp32", 1)
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert "warning: DS_ACCELERATOR=cuda is replaced by cpu" in capsys.readouterr().err
    setup_runtime("cpu", "fp32", 1)
    assert capsys.readouterr().err == ""  # agreeing: nothing to say


def test_a_launchers_distributed_env_is_kept(no_cuda, quiet, monkeypatch):
    launcher = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    for key, value in launcher.items():
        monkeypatch.setenv(key, value)
    setup_runtime("cpu", "fp32", 1)
    assert {k: os.environ[k] for k in launcher} == launcher


def test_a_single_process_gets_a_world_of_one(no_cuda, quiet, monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    setup_runtime("cpu", "fp32", 1)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert "MASTER_PORT" not in os.environ  # a world of one meets in memory: no port to probe or bind


# -- rollout backend on the device ------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("vllm_ascend") is not None, reason="vllm-ascend is installed here")
def test_vllm_on_npu_needs_vllm_ascend():
    with pytest.raises(ConfigError) as err:
        check_rollout_device("npu", "vllm")
    assert err.value.message.startswith("'rollout.backend' is vllm on an Ascend NPU ('device': npu)")
    assert "pip install vllm-ascend" in err.value.message and "rollout.backend: hf" in err.value.message


def test_vllm_on_npu_with_the_plugin_and_other_combinations_pass(tmp_path, monkeypatch, no_cuda):
    for device, backend in [("npu", "hf"), ("cuda", "vllm"), ("cpu", "vllm"), ("cpu", "hf")]:
        check_rollout_device(device, backend)
    if not HAS_TORCH_NPU:
        check_rollout_device("auto", "vllm")  # resolves to cpu here
    (tmp_path / "vllm_ascend").mkdir()
    (tmp_path / "vllm_ascend" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_rollout_device("npu", "vllm")
    assert "vllm_ascend" not in sys.modules  # found, not imported: vLLM loads its plugins itself


def test_runtime_accelerator_is_the_torch_device_module(fake_cuda):
    assert Runtime(torch.device("cuda", 0), torch.bfloat16, "nccl", "cuda").accelerator is torch.cuda
