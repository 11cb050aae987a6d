import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

REPO = Path(__file__).resolve().parents[1]
RLCTL = [str(Path(sys.executable).parent / "rlctl")]  # the installed console script


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def runtime():
    """One process-wide CPU runtime with a world-of-one gloo group, as `rlctl start` sets up."""
    from rlctl.engine.runtime import init_distributed, setup_runtime

    rt = setup_runtime("cpu", "fp32", 1)
    init_distributed(rt.backend)
    return rt


DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """This environment without the distributed variables an in-process test may have set (a child
    would inherit a MASTER_PORT this process already holds)."""
    return {**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, **extra}


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
    """The real entry point in a subprocess."""
    return subprocess.run([*RLCTL, *args], capture_output=True, text=True, cwd=cwd or REPO, timeout=timeout,
                          env=child_env(**(env or {})))  # fmt: skip


def metrics_of(run_dir, rel: str = "metrics.jsonl") -> list[dict]:
    from rlctl.checkpoint.storage import Storage
    from rlctl.metrics import read_rows

    return read_rows(Storage(str(run_dir)), rel)


@pytest.fixture(scope="session")
def s3_env():
    """A real S3 endpoint on loopback (moto), and the fsspec config that points s3fs at it."""
    import logging

    moto_server = pytest.importorskip("moto.server")
    import s3fs

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "key": "test", "secret": "test"}
    s3fs.S3FileSystem(**opts, skip_instance_cache=True).mkdir("rlctl-runs")
    yield {"FSSPEC_S3": json.dumps(opts), "AWS_DEFAULT_REGION": "us-east-1"}, opts
    server.stop()
