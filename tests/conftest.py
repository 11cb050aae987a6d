"""Fixtures: a CPU runtime, a real S3 endpoint on loopback, and GPU tests skipped without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


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


@pytest.fixture(scope="session")
def s3_env():
    """A real S3 endpoint on loopback (moto's server in its own process, so Flask never enters this
    one: vLLM's CPU platform walks every loaded module at engine start and trips over Flask's context
    proxies), and the fsspec config that points s3fs at it."""
    import socket
    import time
    import urllib.request

    server_bin = Path(sys.executable).parent / "moto_server"
    if not server_bin.exists():
        pytest.skip("moto[server] is not installed")
    import s3fs

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [str(server_bin), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    opts = {"client_kwargs": {"endpoint_url": url}, "key": "test", "secret": "test"}
    s3fs.S3FileSystem(**opts, skip_instance_cache=True).mkdir("rlctl-runs")
    yield {"FSSPEC_S3": json.dumps(opts), "AWS_DEFAULT_REGION": "us-east-1"}, opts
    proc.terminate()
    proc.wait(timeout=30)
