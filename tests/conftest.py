"""Fixtures: a CPU runtime, real S3, GCS and Azure endpoints on loopback, and GPU tests skipped without a
GPU.

Tests that share a module-scoped fixture run on one pytest-xdist worker, so that it is made once: a test
module lists its module-scoped fixtures in ``SHARED_FIXTURES`` (a fixture's scope is not public at
collection, so the list is the declaration; a module-scoped fixture missing from it fails the tests that
use it), and each test that uses one is marked ``xdist_group(<its file, from tests/>)``. The module's
other tests, and all other tests, are spread over the workers. Under ``--dist loadgroup`` (``make test``)
the scheduler honours those marks through pytest-xdist's public hooks alone, no private pytest or
pytest-xdist attribute (pytest-xdist 3.8's own way, an ``@group`` suffix on the node id, is lost under
pytest 9): the controller names a folder in each worker's ``workerinput`` (``pytest_configure_node``),
each worker writes its tests' groups there as it collects, and ``pytest_xdist_make_scheduler`` returns
pytest-xdist's ``LoadGroupScheduling`` reading them (tests/support/xdist_groups.py). Any other ``--dist`` keeps
pytest-xdist's own scheduler, and without workers (``-n0``, or no pytest-xdist) the marks change nothing."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# gcsfs reads this once, as it is imported, and any test may be the first to import it (a gs:// URL in a
# preflight or a storage test): on, every bucket is first probed over gRPC, which no emulator answers
# (60 s a probe), and a worker's GCS tests would test another client than their neighbours'.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

# A pytest-xdist worker ignores SIGINT (execnet's doing), and a process it starts would inherit that:
# Python then installs no KeyboardInterrupt handler, and the Ctrl-C tests' rlctl would not stop. Python's
# own handler here gives children the default disposition, as a shell would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


E2E = Path(__file__).parent / "e2e"
_GROUPS = pytest.StashKey[str]()  # the controller's folder for the workers' groups
_GROUPS_KEY = "rlctl_xdist_groups"  # that folder, in each worker's config.workerinput


# The modules whose tests take longest (a minute to three each: Ray nodes, a Slurm cluster, the benchmarks'
# dry runs, vLLM on two ranks), handed to the workers first: the suite's 2 cores are full while they run
# beside short tests, rather than idle at the end while one of them finishes alone.
LONGEST_FIRST = (
    "e2e/test_multirank.py",
    "e2e/test_slurm.py",
    "e2e/test_gpu_check_dry_run.py",
    "e2e/test_grpo_vs_trl_dry_run.py",
    "e2e/test_vllm_cli.py",
    "e2e/test_tool_conversations_train_and_resume.py",
)


def _longest_first(item) -> int:
    """An item's place among ``LONGEST_FIRST`` (the rest after them)."""
    where = item.path.relative_to(E2E.parent).as_posix() if item.path.is_relative_to(E2E.parent) else ""
    return LONGEST_FIRST.index(where) if where in LONGEST_FIRST else len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Every test under tests/e2e is marked ``slow``, as are the unit and CLI tests marked where they are
    defined (`make test-fast` runs tests/unit and tests/cli with ``-m "not slow"``). A test that uses one
    of the fixtures its module lists in ``SHARED_FIXTURES`` (its module-scoped ones: a finished run, a
    vLLM engine) is marked ``xdist_group(<its file, from tests/>)``, so that under ``--dist loadgroup``
    the tests sharing them run on one pytest-xdist worker and the fixture is made once
    (``pytest_xdist_make_scheduler`` below); the module's other tests, and every other test, are spread
    over the workers. GPU tests are skipped without a GPU."""
    items.sort(key=_longest_first)  # (stable: the order within each module, and of the rest, is kept)
    for item in items:
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.slow)
        shared = set(getattr(getattr(item, "module", None), "SHARED_FIXTURES", ()))
        if shared.intersection(getattr(item, "fixturenames", ())) and not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(item.path.relative_to(E2E.parent).as_posix()))
    folder = getattr(config, "workerinput", {}).get(_GROUPS_KEY)
    if folder:  # a pytest-xdist worker under --dist loadgroup: tell the controller the groups
        from xdist_groups import write_groups

        write_groups(folder, config.workerinput["workerid"], items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    """A module-scoped fixture must be listed in its module's ``SHARED_FIXTURES``: one that is not would
    be made again on each worker that runs one of its tests, which nothing else would show."""
    if fixturedef.scope == "module" and fixturedef.argname not in getattr(request.module, "SHARED_FIXTURES", ()):
        pytest.fail(
            f"{request.module.__name__}: the module-scoped fixture {fixturedef.argname!r} is not in the "
            "module's SHARED_FIXTURES (tests/conftest.py: its tests would not share one worker)",
            pytrace=False,
        )


def pytest_configure(config):
    """pytest-xdist's controller under ``--dist loadgroup`` with workers: a folder for their groups."""
    workers = config.getoption("dist", "no") == "loadgroup" and config.getoption("tx", None)
    if workers and not hasattr(config, "workerinput"):
        config.stash[_GROUPS] = tempfile.mkdtemp(prefix="rlctl-xdist-groups-")


def pytest_unconfigure(config):
    if _GROUPS in config.stash:
        shutil.rmtree(config.stash[_GROUPS], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, for each worker it starts: where to write its tests' groups."""
    if _GROUPS in node.config.stash:
        node.workerinput[_GROUPS_KEY] = node.config.stash[_GROUPS]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup``, pytest-xdist's LoadGroupScheduling with the groups the workers wrote
    (tests/support/xdist_groups.py); any other ``--dist`` keeps pytest-xdist's own scheduler."""
    if _GROUPS not in config.stash:
        return None
    from xdist_groups import SharedModuleScheduling

    return SharedModuleScheduling(config, log, config.stash[_GROUPS])


@pytest.fixture(autouse=True)
def _no_outage_carried_over():
    """The process's outage clock is global and keyed by scheme and bucket: an outage a test leaves open
    is forgotten before the next test on the worker meets a bucket of the same name."""
    yield
    outages = sys.modules.get("rlctl.storage.outages")
    if outages is not None:
        outages.OUTAGES.clear()


@pytest.fixture(scope="session")
def runtime():
    """One process-wide CPU runtime with a world-of-one gloo group, as `rlctl start` sets up."""
    from rlctl.engine.rendezvous import init_distributed
    from rlctl.engine.runtime import setup_runtime

    rt = setup_runtime("cpu", "fp32", 1)
    init_distributed(rt.backend)
    return rt


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The built-in tiny model and its tokenizer, written as `rlctl start` writes them into RUN_DIR/model
    (the same function): a Hugging Face directory that a config can name as model.path. Read only."""
    from rlctl.config import RunConfig
    from rlctl.engine.model import prepare_model_dir
    from rlctl.rundir.handle import RunDir
    from rlctl.storage import Storage

    return prepare_model_dir(RunConfig(), RunDir(Storage(str(tmp_path_factory.mktemp("tiny-model")))))


def _server(argv: list[str], name: str, env: dict | None = None):
    """``argv`` (with {port}: a free port on loopback) started in its own process; (the process, its
    http://127.0.0.1:PORT URL) once that process listens there. A port is free only when it is probed:
    where another process takes it first (the suite's workers start servers and rendezvous on probed
    ports all the time), the server cannot bind, and a mere connection would reach the other process.
    So the listener must be the server's own; if the server exits instead, another port is tried. Ports are
    chosen outside the kernel's ephemeral range (``ports.server_port``), where no port-0 bind lands."""
    from ports import server_port

    for _ in range(5):
        port = server_port()
        proc = _start([a.format(port=port) for a in argv], env)
        if _listens(proc, port):
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"{name} did not start")


_HELD: list = []  # the sockets that keep refused ports bound


def refused_port() -> int:
    """A port on loopback that refuses every connection: bound and never listened on, and kept bound while
    the tests run, so no other worker's server can take it."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _HELD.append(sock)
    return sock.getsockname()[1]


def _start(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    """A test server in a session of its own: signals to the suite's process group (a terminal's Ctrl-C,
    the kernel's SIGHUP and SIGCONT to a group left orphaned with a stopped member) never reach it, and
    one its test has paused with SIGSTOP stays paused until that test continues it."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


def _listens(proc: subprocess.Popen, port: int, seconds: float = 60) -> bool:
    """Whether ``proc`` itself comes to listen on ``port`` within ``seconds``; killed if it does not."""
    import time

    import psutil

    deadline = time.time() + seconds
    while proc.poll() is None and time.time() < deadline:
        try:
            sockets = psutil.Process(proc.pid).net_connections("tcp")
        except psutil.NoSuchProcess:
            break
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in sockets):
            return True
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    return False


def _stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def _pause(proc) -> None:
    """SIGSTOP ``proc`` and wait until the kernel shows it stopped."""
    import time

    import psutil

    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.01)


def _installed(path: Path, what: str) -> str:
    if not path.exists():
        pytest.skip(f"{what} is not installed ({path}: `make venv` installs it)")
    return str(path)


@pytest.fixture(scope="session")
def s3_env():
    """A real S3 endpoint on loopback (moto's server in its own process, so Flask never enters this
    one: vLLM's CPU platform walks every loaded module at engine start and trips over Flask's context
    proxies) holding the bucket ``rlctl-runs``, and the fsspec config that points s3fs at it."""
    server = _installed(Path(sys.executable).parent / "moto_server", "moto[server]")
    import s3fs

    proc, url = _server([server, "-H", "127.0.0.1", "-p", "{port}"], "moto_server")
    opts = {"client_kwargs": {"endpoint_url": url}, "key": "test", "secret": "test"}
    s3fs.S3FileSystem(**opts, skip_instance_cache=True).mkdir("rlctl-runs")
    yield {"FSSPEC_S3": json.dumps(opts), "AWS_DEFAULT_REGION": "us-east-1"}, opts
    _stop(proc)


def gcs_server(*args: str):
    """gcp-storage-emulator in memory on loopback, started through tests/support/gcs_emulator.py (which mends its
    multipart reader) with this interpreter: (the process, its URL)."""
    _installed(Path(sys.executable).parent / "gcp-storage-emulator", "gcp-storage-emulator")
    argv = [sys.executable, str(Path(__file__).parent / "support" / "gcs_emulator.py"), "start", "--in-memory", *args]
    return _server([*argv, "--host", "127.0.0.1", "--port", "{port}"], "gcp-storage-emulator")


@pytest.fixture(scope="session")
def gcs_env():
    """A real GCS endpoint on loopback (gcp-storage-emulator, in memory) holding the bucket
    ``rlctl-runs``, and the fsspec config that points gcsfs at it. (gcsfs's hierarchical-namespace probe,
    which no emulator answers, is off: in this process as the conftest is imported, in rlctl's own.)"""
    proc, url = gcs_server("--default-bucket", "rlctl-runs")
    opts = {"endpoint_url": url, "token": "anon", "project": "rlctl-tests"}
    yield {"FSSPEC_GS": json.dumps(opts)}, opts
    _stop(proc)


# Azurite's well-known development account (its documentation's; it guards nothing)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.fixture(scope="session")
def azure_env():
    """A real Azure Blob endpoint on loopback (Azurite, in memory; the Makefile installs it from npm)
    holding the container ``rlctl-runs``, and the fsspec config that points adlfs at it."""
    server = _installed(Path(sys.executable).parents[1] / "azurite/node_modules/.bin/azurite-blob", "Azurite")
    args = ["--inMemoryPersistence", "--blobHost", "127.0.0.1", "--blobPort", "{port}", "--skipApiVersionCheck"]
    proc, url = _server([server, *args, "--loose", "--silent"], "Azurite")
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={url}/{AZURITE_ACCOUNT};"
    )
    opts = {"connection_string": connection}
    import adlfs

    adlfs.AzureBlobFileSystem(**opts, skip_instance_cache=True).mkdir("rlctl-runs")
    yield {"FSSPEC_AZ": json.dumps(opts)}, opts
    _stop(proc)
