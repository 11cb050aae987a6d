"""Check 1, the environment: versions, the GPU, bf16, DeepSpeed (built without ops), rlctl's imports and
every installed dependency against rlctl's bounds in pyproject.toml; the GPU's bf16 matrix product rate
(the peak the MFU is measured against); the size of /dev/shm and how fast the disk and /dev/shm take
writes (a snapshot's commit and the writer process's staging go at those speeds)."""

from __future__ import annotations

import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from gpucheck.context import Ctx, bf16_peak
from gpucheck.report import GIB, MIB, Clock, Fail
from gpucheck.runs import nvidia_smi

REPO = Path(__file__).resolve().parents[2]

PACKAGES = ("torch", "transformers", "tokenizers", "deepspeed", "pydantic", "pydantic-core", "orjson", "hjson")
PACKAGES += ("peft", "accelerate", "safetensors", "numpy", "pyarrow", "fsspec", "packaging")


def check_env(ctx: Ctx, fig: dict, clock: Clock) -> None:
    import torch

    fig.update(python=platform.python_version(), machine=platform.machine(), cpus=os.cpu_count())
    fig.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    cuda = ctx.device == "cuda" and torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(0)
        ctx.gpu_name = props.name
        driver = nvidia_smi(["--query-gpu=driver_version"])
        fig.update(gpu=props.name, capability=f"{props.major}.{props.minor}")
        fig.update(bf16=torch.cuda.is_bf16_supported(including_emulation=False))
        fig.update(gpu_memory_gib=round(props.total_memory / GIB, 1), multiprocessors=props.multi_processor_count)
        fig.update(driver=driver[0][0] if driver else None, bf16_peak_datasheet_tflops=bf16_peak(props.name))
    versions = installed_versions()
    fig["packages"] = {name: versions.get(name) for name in PACKAGES}
    fig["outside_rlctl_bounds"] = bound_problems(versions)
    fig["rlctl_import_s"], fig["deepspeed_prebuilt_ops"] = import_rlctl()
    if cuda or ctx.device == "cpu":
        ctx.matmul_tflops = fig["matmul_tflops"] = matmul_rate(ctx)
    fig["host"] = host = host_facts(ctx.work)
    ctx.shm_free = host["dev_shm_free_bytes"]
    io_time = max(1.0, (clock.left() - 2) / 2)  # what is left of the budget, shared by the two writes
    host["disk_write"] = write_speed(ctx.work, ctx.size.io_mib, io_time)
    host["dev_shm_write"] = write_speed(Path("/dev/shm"), ctx.size.io_mib, io_time, host["dev_shm_free_bytes"])
    fig["summary"] = env_summary(fig, versions)
    if ctx.device == "cuda" and not cuda:
        raise Fail("torch sees no CUDA device (use --device cpu --tiny for the dry run)")
    if fig["outside_rlctl_bounds"]:
        raise Fail("installed outside rlctl's bounds: " + "; ".join(fig["outside_rlctl_bounds"]))
    if host["work_disk_free_gib"] < ctx.size.disk_gib:
        raise Fail(f"{host['work_disk_free_gib']} GiB free in {ctx.work}; the runs' snapshots need {ctx.size.disk_gib}")
    if cuda and not fig["bf16"]:
        raise Fail(f"{fig['gpu']} computes no bf16 natively; the runs train in bf16")


def env_summary(fig: dict, versions: dict) -> str:
    host = fig["host"]
    disk, shm = host["disk_write"], host["dev_shm_write"]
    return (
        f"torch {fig['torch']} (CUDA {fig['torch_cuda']}), {fig.get('gpu', 'CPU')}, bf16 {fig.get('bf16', 'n/a')}, "
        f"DeepSpeed {versions.get('deepspeed')} ({len(fig['deepspeed_prebuilt_ops'])} prebuilt ops), rlctl imports "
        f"in {fig['rlctl_import_s']} s, {fig.get('matmul_tflops')} TFLOP/s matrix product; /dev/shm "
        f"{host['dev_shm_gib']} GiB ({host['dev_shm_free_bytes'] / GIB:.1f} free), writes at "
        f"{shm.get('gib_per_s')} GiB/s, disk {disk.get('gib_per_s')} GiB/s, {host['work_disk_free_gib']} GiB free"
    )


def host_facts(work: Path) -> dict:
    facts: dict[str, Any] = {"work_disk_free_gib": round(shutil.disk_usage(work).free / GIB, 1)}
    try:
        st = os.statvfs("/dev/shm")
        facts["dev_shm_gib"] = round(st.f_blocks * st.f_frsize / GIB, 1)
        facts["dev_shm_free_bytes"] = st.f_bavail * st.f_frsize
    except OSError:
        facts["dev_shm_gib"], facts["dev_shm_free_bytes"] = None, 0
    try:
        with open("/proc/meminfo") as fh:
            facts["memory_gib"] = round(int(fh.readline().split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return facts


def write_speed(folder: Path, mib: int, seconds: float, free: int | None = None) -> dict:
    """GiB/s of writing up to ``mib`` MiB of random bytes into a new file in ``folder`` (16 MiB at a time,
    then fsync), stopped after ``seconds``; the file is removed. Not more than half of ``free``."""
    if free is not None:
        mib = min(mib, int(free / MIB / 2) // 16 * 16)
    if mib < 16:
        return {"skipped": f"{free} bytes free in {folder}"}
    block = os.urandom(16 * MIB)
    path = folder / f".gpu-check-write-{os.getpid()}"
    written, t = 0, time.perf_counter()
    try:
        with open(path, "wb") as fh:
            while written < mib * MIB and time.perf_counter() - t < seconds:
                fh.write(block)
                written += len(block)
            fh.flush()
            os.fsync(fh.fileno())
        took = time.perf_counter() - t
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "bytes": written}
    finally:
        path.unlink(missing_ok=True)
    return {"bytes": written, "seconds": round(took, 3), "gib_per_s": round(written / GIB / took, 2)}


def installed_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        out.setdefault(name, dist.version)  # (the first on sys.path wins, as for an import)
    return out


def bound_problems(versions: dict[str, str]) -> list[str]:
    """Each of rlctl's dependencies (and the lora extra) that is missing or outside its bounds."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return []
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    problems = []
    for text in [*project["dependencies"], *project["optional-dependencies"]["lora"]]:
        req = Requirement(text)
        have = versions.get(req.name.lower().replace("_", "-"))
        if have is None:
            problems.append(f"{req.name} is not installed (rlctl needs {req.name}{req.specifier})")
        elif not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name} {have} is outside rlctl's {req.name}{req.specifier}")
    return problems


def import_rlctl() -> tuple[float, list[str]]:
    """Seconds to import rlctl's trainer, actor and snapshot writer with this torch, DeepSpeed as rlctl
    imports it; and the ops DeepSpeed was built with (none: rlctl uses none, so none is JIT-compiled)."""
    t = time.monotonic()
    from rlctl.engine.runtime import import_deepspeed

    import_deepspeed()
    import deepspeed.git_version_info as ds_info

    import rlctl.checkpoint.writer  # noqa: F401
    import rlctl.engine.actor  # noqa: F401
    import rlctl.engine.trainer  # noqa: F401

    return round(time.monotonic() - t, 1), sorted(op for op, built in ds_info.installed_ops.items() if built)


def matmul_rate(ctx: Ctx) -> float:
    """TFLOP/s of a square matrix product: bf16 on the GPU (its practical peak), fp32 on the CPU."""
    import torch

    n, cuda = ctx.size.matmul, ctx.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    sync()
    rate = 2 * n**3 * reps / (time.perf_counter() - t) / 1e12
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return round(rate, 3 if not cuda else 1)
