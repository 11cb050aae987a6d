"""Process setup before torch or DeepSpeed does any work: device, threads, the distributed env.

``device`` is ``auto``, ``cuda``, ``npu`` or ``cpu``. ``auto`` takes CUDA when torch sees it, else an
Ascend NPU when ``torch_npu`` is installed and sees one, else the CPU. ``torch_npu`` is imported only to
answer that question (and only where it is installed: ``importlib.util.find_spec`` is asked first) or
because ``device: npu`` asked for it; under ``auto`` a broken install falls back to the CPU quietly,
under ``device: npu`` it is a ConfigError. (torch 2.5+ also *autoloads* an installed ``torch_npu`` at
``import torch`` unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` is set before that import; an autoloaded
``torch_npu`` is used as it is.)

One resolved device decides everything else, so they cannot disagree:

=======  ==============  =================  ===============  ===========================
device   DS_ACCELERATOR  torch.distributed  torch.device     ``model.dtype: auto``
=======  ==============  =================  ===============  ===========================
cuda     cuda            nccl               cuda:LOCAL_RANK  bf16 (fp32 without native bf16)
npu      npu             hccl               npu:LOCAL_RANK   bf16 (fp32 without native bf16)
cpu      cpu             gloo               cpu              fp32
=======  ==============  =================  ===============  ===========================

An explicit ``fp32`` or ``bf16`` is honoured everywhere; ``fp16`` (DeepSpeed's dynamic loss scaling over
fp32 master weights, for devices without bf16: a V100, an Ascend 910A) wherever DeepSpeed trains in
it: CUDA, NPU, and only a CPU whose oneDNN computes in fp16 (``resolve_dtype`` refuses it elsewhere).
On a CPU with AVX512-BF16 (or AMX), bf16 pays off once matrix multiplies dominate (a 25.8M-parameter
GRPO step ran about 2x faster than in fp32, see benchmarks/grpo_vs_trl.py --dtype fp32,bf16) and costs
time on tiny models, whose steps are per-operation overhead.

DeepSpeed reads ``DS_ACCELERATOR`` when its accelerator is first asked for (``import deepspeed`` asks).
The resolved device wins over a value already in the environment, with a warning on stderr: an
accelerator that is not the training device fails later and less clearly. A single ``rlctl start``
process sets RANK/WORLD_SIZE/MASTER_ADDR for a world of one, and only where a launcher (torchrun, the
deepspeed launcher, Ray) has not set them first.

The rendezvous (``init_distributed``, in ``rlctl.engine.rendezvous``) is the last step of ``open_rank``.

On the CPU every process runs ``trainer.num_threads`` intra-op threads (one by default: more ranks than
cores otherwise oversubscribe them, 10-100x slower); on a GPU or NPU thread settings are left alone.

vLLM rollouts on an NPU need the vllm-ascend platform plugin (``pip install vllm-ascend``, matching
the vllm version); vLLM discovers it by itself, nothing here imports it. ``check_rollout_device`` turns
its absence into a ConfigError before any model is loaded.

``open_rank(cfg)`` does all of it, in order, for one rank of a run: the runtime, the rollout device
check, the seeds, the process group; it returns the ``RankContext`` (runtime and ``Dist``) that the
snapshot manager and the trainer are then built with.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from rlctl.config import RunConfig
from rlctl.engine.accelerator import deepspeed_accelerator
from rlctl.engine.dist import Dist
from rlctl.engine.rendezvous import init_distributed
from rlctl.errors import ConfigError

DEVICES = ("cuda", "npu", "cpu")
BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}  # torch.distributed backend of each device


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    dtype: torch.dtype
    backend: str  # torch.distributed backend: nccl, hccl or gloo
    kind: str = "cpu"  # the resolved device: cuda, npu or cpu (also DeepSpeed's accelerator name)

    @property
    def accelerator(self) -> ModuleType | None:
        """``torch.cuda`` or ``torch.npu`` (synchronize, empty_cache, memory stats), None on the CPU."""
        return device_module(self.kind)

    @property
    def synchronize(self) -> Callable[[], None] | None:
        """The accelerator's ``synchronize`` (None on the CPU): what a phase's timing waits for."""
        return getattr(self.accelerator, "synchronize", None)


def device_module(kind: str) -> ModuleType | None:
    return None if kind == "cpu" else getattr(torch, kind)


def _import_torch_npu() -> str | None:
    """Import torch_npu if it is installed; None when it worked, else why not (a sentence fragment)."""
    if "torch_npu" not in sys.modules:  # not already imported (or autoloaded by torch)
        try:
            found = importlib.util.find_spec("torch_npu") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return "torch_npu is not installed"
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:  # a broken install fails in many ways: missing CANN libraries, ABI, ...
            return f"torch_npu does not import ({type(exc).__name__}: {exc})"
    if getattr(torch, "npu", None) is None:
        return "torch_npu imported but registered no torch.npu"
    return None


def _npu_problem() -> str | None:
    """None when an NPU is usable, else why not."""
    problem = _import_torch_npu()
    if problem is not None:
        return problem
    try:
        if torch.npu.is_available():
            return None
    except Exception as exc:
        return f"torch.npu.is_available() failed ({type(exc).__name__}: {exc})"
    return "torch_npu sees no NPU (check the Ascend driver and ASCEND_RT_VISIBLE_DEVICES)"


def resolve_device(pref: str) -> str:
    """``cuda``, ``npu`` or ``cpu`` for ``device: pref``; a ConfigError naming 'device' when the device
    asked for explicitly is not there."""
    if pref not in ("auto", *DEVICES):
        raise ConfigError(f"'device' is {pref!r}; valid: auto, {', '.join(DEVICES)}")
    if pref == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if _npu_problem() is None else "cpu"
    if pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'device' is cuda but torch sees no CUDA device; use device: cpu or auto")
    if pref == "npu":
        problem = _npu_problem()
        if problem is not None:
            raise ConfigError(
                f"'device' is npu but {problem}; install torch_npu matching torch {torch.__version__} "
                "(and the Ascend CANN toolkit), or use device: cpu or auto"
            )
    return pref


def _native_bf16(kind: str) -> bool:
    """Whether the device computes in bf16 natively (not by emulation); assumed so when it cannot say."""
    if kind == "cuda":
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except Exception:
            return True
    check = getattr(device_module(kind), "is_bf16_supported", None)
    try:
        return True if check is None else bool(check())
    except Exception:
        return True


def cpu_fp16() -> bool:
    """Whether DeepSpeed trains in fp16 on this CPU: its CPU accelerator refuses fp16 ("Type fp16 is not
    supported on your device") unless oneDNN computes in fp16 (AVX512-FP16 or AMX-FP16)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


def resolve_dtype(pref: str, device: str) -> torch.dtype:
    """``model.dtype``: auto is bf16 on CUDA and NPU (fp32 on one without native bf16, e.g. a V100 or
    an Ascend 910A), fp32 on the CPU; an explicit fp32 or bf16 is honoured on every device, fp16 where
    DeepSpeed trains in it (CUDA, NPU, a CPU with oneDNN fp16), else a ConfigError naming the key."""
    if pref == "auto":
        return torch.bfloat16 if device != "cpu" and _native_bf16(device) else torch.float32
    if pref == "fp16" and device == "cpu" and not cpu_fp16():
        raise ConfigError(
            "'model.dtype' is fp16, which needs a CUDA or NPU device: DeepSpeed refuses fp16 on a CPU without "
            "oneDNN fp16 support, such as this one; use model.dtype: bf16 or fp32 on the CPU"
        )
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[pref]


def _local_index(kind: str, local_rank: int) -> int:
    """The device this rank takes: number LOCAL_RANK, or the only one a launcher (Ray) made visible."""
    count = device_module(kind).device_count()
    if local_rank < count:
        return local_rank
    if count == 1:
        return 0
    raise ConfigError(
        f"'device' is {kind} but local rank {local_rank} has no {kind} device of its own ({count} visible); "
        f"run at most {count} ranks per node (trainer.nproc, trainer.n_devices_per_node)"
    )


def check_local_ranks(device_pref: str, nproc: int) -> None:
    """Before local ranks start: every rank needs a device of its own on CUDA and NPU (two NCCL ranks on
    one GPU fail later, inside NCCL, with a duplicate-GPU error). A ConfigError that says so."""
    kind = resolve_device(device_pref)
    if kind == "cpu" or nproc <= 1:
        return
    count = device_module(kind).device_count()
    if nproc > count:
        raise ConfigError(
            f"'trainer.nproc' is {nproc} but this machine has {count} {kind} device{'s' * (count != 1)}; every "
            f"local rank needs one of its own: use --nproc {count} or fewer (or device: cpu)"
        )


def bind_device(kind: str) -> torch.device:
    """This process's torch.device, made current (``torch.cuda.set_device`` / ``torch.npu.set_device``)."""
    if kind == "cpu":
        return torch.device("cpu")
    index = _local_index(kind, int(os.environ.get("LOCAL_RANK", "0")))
    device_module(kind).set_device(index)
    return torch.device(kind, index)


def set_accelerator(kind: str) -> None:
    """DS_ACCELERATOR for DeepSpeed: the resolved device wins over a different value already set."""
    before = os.environ.get("DS_ACCELERATOR")
    if before is not None and before != kind:
        print(f"warning: DS_ACCELERATOR={before} is replaced by {kind}, the resolved 'device'", file=sys.stderr)
    os.environ["DS_ACCELERATOR"] = kind
    chosen = deepspeed_accelerator()
    if chosen is not None and chosen != kind:
        print(
            f"warning: DeepSpeed already chose the {chosen} accelerator; this process trains on {kind}", file=sys.stderr
        )


def setup_runtime(device_pref: str, dtype_pref: str, num_threads: int) -> Runtime:
    kind = resolve_device(device_pref)
    dtype = resolve_dtype(dtype_pref, kind)
    set_accelerator(kind)
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        os.environ.setdefault(key, value)  # (no MASTER_PORT: a world of one meets in memory)
    if kind == "cpu":
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        torch.set_num_threads(num_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_libraries()
    return Runtime(bind_device(kind), dtype, BACKENDS[kind], kind)


def check_rollout_device(device: str, backend: str) -> None:
    """A ConfigError when the rollout backend cannot run on the device: vLLM on an Ascend NPU needs the
    vllm-ascend plugin. ``device`` is the resolved one (``Runtime.kind``); ``auto`` is resolved here."""
    if backend != "vllm":
        return
    if device == "auto":
        device = resolve_device("auto")
    if device == "npu":
        try:
            found = importlib.util.find_spec("vllm_ascend") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(
                "'rollout.backend' is vllm on an Ascend NPU ('device': npu), which needs the vllm-ascend "
                "plugin: pip install vllm-ascend (matching your vllm), or use rollout.backend: hf"
            )


MUON = "deepspeed.runtime.zero.muon.original_muon"  # DeepSpeed's Muon optimizer, which rlctl never uses


def import_deepspeed(muon: bool = True):
    """DeepSpeed, imported without its two slow side trips (each 1.5 to 4 s at every start of every rank):

    * its autotuner imports MLflow when MLflow is installed; it is hidden for that import only (rlctl
      imports MLflow itself for a run that logs to it, later);
    * its Muon optimizer module applies ``torch.compile`` at import, which imports ``torch._inductor``;
      every ZeRO optimizer imports that module (for an ``isinstance`` check). It is imported here first
      with torch's documented ``TORCHDYNAMO_DISABLE=1`` set for that import only, which turns the
      decorator into a no-op: Muon's Newton-Schulz kernel stays uncompiled, and nothing runs it (rlctl's
      optimizer is always torch's AdamW). Nothing else is compiled differently. ``muon=False`` leaves
      that module out, for a process that builds no optimizer (``import_deepspeed_for_state``).
    """
    if "deepspeed" not in sys.modules:
        hidden = "mlflow" not in sys.modules
        if hidden:
            sys.modules["mlflow"] = None  # an ImportError for DeepSpeed's `try: import mlflow`
        try:
            import deepspeed  # noqa: F401
        finally:
            if hidden and sys.modules.get("mlflow", 0) is None:
                del sys.modules["mlflow"]
    if muon:
        _import_muon_uncompiled()  # (also where something imported DeepSpeed before: it imports Muon lazily)
    return sys.modules["deepspeed"]


def import_deepspeed_for_state():
    """DeepSpeed for a process that only unpickles and writes its engines' state dicts (the snapshot
    writer): the classes those hold (the loss scaler, ZeRO's stage enum, tensor fragments) import on
    demand; the Muon module, which no state dict names, stays out (importing it, even uncompiled, pulls
    in torch._dynamo: about 1.5 s of CPU at every start of every writer)."""
    return import_deepspeed(muon=False)


def _import_muon_uncompiled() -> None:
    """DeepSpeed's Muon module, imported with dynamo off for that import only (see ``import_deepspeed``)."""
    if MUON in sys.modules:
        return
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(MUON)
    except ImportError:  # a DeepSpeed without it: nothing to avoid
        pass
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


def quiet_libraries() -> None:
    """Library chatter goes to stderr and only above INFO: stdout is for data."""
    import_deepspeed()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    for handler in ds_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)


CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's fixed workspace for deterministic results (PyTorch's randomness notes)


def deterministic_kernels(kind: str) -> None:
    """``trainer.deterministic``: the settings under which CUDA computes a step bit for bit the same in
    every process, so a resumed run repeats an uninterrupted one (set before the first cuBLAS call):
    ``CUBLAS_WORKSPACE_CONFIG`` (unless already set), ``torch.use_deterministic_algorithms(True,
    warn_only=True)`` (an op without a deterministic kernel warns once rather than stopping the run),
    cuDNN's deterministic algorithms and no cuDNN autotuning. Uninitialised memory is filled on a GPU or
    NPU only: on the CPU, whose kernels rlctl runs are deterministic already, the fill of every
    ``torch.empty`` (DeepSpeed's ZeRO buckets at every step) made a tiny model's update 20-50x slower.
    On CUDA, attention takes PyTorch's math kernel: the flash, memory-efficient and cuDNN kernels'
    backward passes add up in a varying order, and under ``warn_only`` they only say so."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = kind != "cpu"
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if kind == "cuda":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class RankContext:
    """One rank of a run, set up: its device and dtype, and its view of the process group."""

    runtime: Runtime
    dist: Dist


def open_rank(cfg: RunConfig) -> RankContext:
    """Set this process up as a rank of the run described by ``cfg``: device, dtype and threads,
    deterministic kernels where asked for, the rollout backend's device check, every seed, then the
    process group (joined where a launcher set one up, else a world of one). Before any model is built."""
    runtime = setup_runtime(cfg.device, cfg.model.dtype, cfg.trainer.num_threads)
    if cfg.trainer.deterministic:
        deterministic_kernels(runtime.kind)
    check_rollout_device(runtime.kind, cfg.rollout.backend)
    seed_everything(cfg.seed)
    init_distributed(runtime.backend, runtime.device)
    return RankContext(runtime, Dist(runtime.device))
