"""Process setup before torch or DeepSpeed does any work: device, threads, the distributed env.

DeepSpeed reads ``DS_ACCELERATOR`` when its accelerator is first asked for, and
``deepspeed.init_distributed`` looks for MPI unless RANK/WORLD_SIZE/MASTER_* are set; a single
``rlctl start`` process sets them for a world of one. On CPU every process runs one intra-op thread.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    dtype: torch.dtype
    backend: str  # torch.distributed backend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(pref: str) -> str:
    if pref == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if pref == "cuda" and not torch.cuda.is_available():
        from rlctl.errors import ConfigError

        raise ConfigError("'device' is cuda but torch sees no CUDA device; use device: cpu or auto")
    return pref


def resolve_dtype(pref: str, device: str) -> torch.dtype:
    if pref == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[pref]


def setup_runtime(device_pref: str, dtype_pref: str, num_threads: int) -> Runtime:
    device = resolve_device(device_pref)
    os.environ.setdefault("DS_ACCELERATOR", device)
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device == "cpu":
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        torch.set_num_threads(num_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_libraries()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch_device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        torch_device = torch.device("cpu")
    return Runtime(torch_device, resolve_dtype(dtype_pref, device), "nccl" if device == "cuda" else "gloo")


def quiet_libraries() -> None:
    """Library chatter goes to stderr and only above INFO: stdout is for data."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    for handler in ds_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)


def init_distributed(backend: str) -> None:
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # The shared-memory comm op is a JIT C++ build (about a minute) that a single process never needs.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
