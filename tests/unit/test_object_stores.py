"""What a run directory needs of its store, on each object store rlctl has an extra for, each against a
real server on loopback: S3 (moto's), GCS (gcp-storage-emulator through gcsfs) and Azure Blob (Azurite
through adlfs). GCS's client cannot append; Azure's can only to blobs made for it."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from rlctl.storage import Storage

ENVS = {"s3": "s3_env", "gs": "gcs_env", "az": "azure_env"}


@pytest.fixture(params=list(ENVS))
def store(request):
    _, opts = request.getfixturevalue(ENVS[request.param])
    return Storage(f"{request.param}://rlctl-runs/unit-{uuid.uuid4().hex[:8]}", opts, retry_timeout=10)


def test_appends_keep_what_the_file_held(store):
    """gcsfs opens a file for append as for writing (what it held would be gone): every line stays."""
    lines = [f'{{"step": {i}}}\n'.encode() for i in range(1, 4)]
    for line in lines:
        store.append_bytes("events.jsonl", line)
    assert store.read_bytes("events.jsonl") == b"".join(lines)


def test_a_dropped_connections_unawaited_task_is_no_traceback_and_other_errors_still_are(store, caplog):
    """aiohttp writes a request's body in a task nobody awaits; a server that dies mid-request fails the
    request (our retry budget takes it) and leaves that task's connection error: not printed."""
    handler = store.fs.loop.get_exception_handler()
    assert handler is not None
    dropped = ConnectionResetError("Cannot write to closing transport")
    with caplog.at_level("ERROR", logger="asyncio"):
        handler(store.fs.loop, {"message": "Task exception was never retrieved", "exception": dropped})
        assert not caplog.records
        handler(store.fs.loop, {"message": "Task exception was never retrieved", "exception": ValueError("a bug")})
    assert [r.getMessage() for r in caplog.records] == ["Task exception was never retrieved"]


def test_an_exclusive_write_is_refused_when_the_object_exists(store):
    """The lease's create. On GCS it is an ifGenerationMatch=0 upload, which the emulator ignores."""
    if store.url.startswith("gs://"):
        pytest.skip("gcp-storage-emulator does not enforce ifGenerationMatch: GCS's exclusive create is untested")
    store.write_bytes("lease.json", b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        store.write_bytes("lease.json", b"second", exclusive=True)
    assert store.read_bytes("lease.json") == b"first"


def test_a_snapshot_directory_moves_lists_and_hashes_whole(store):
    blob = os.urandom(3 << 20)
    store.write_bytes("step-000002.tmp/weights.bin", blob)
    store.write_bytes("step-000002.tmp/manifest.json", b"{}")
    store.move_dir("step-000002.tmp", "step-000002")
    assert store.file_sizes("step-000002") == {"manifest.json": 2, "weights.bin": len(blob)}
    assert not store.exists("step-000002.tmp/manifest.json")
    assert store.sha256("step-000002/weights.bin") == hashlib.sha256(blob).hexdigest()


def test_an_object_comes_back_byte_for_byte_whatever_its_line_ends(store):
    """Every byte a multipart upload's parser could take for part of a boundary's line end, in the body
    and as its last byte. CI once stored a random 3 MiB blob 1 byte short on GCS: it ended in CR, and the
    emulator's parser took gcsfs's LF before the closing boundary for a CR LF (tests/support/gcs_emulator.py)."""
    for i, tail in enumerate([b"\r", b"\n", b"\r\n", b"\n\r", b"\r\r", b"x"]):
        blob = b"\r\n\n\r" + os.urandom(64) + tail
        store.write_bytes(f"blob-{i}.bin", blob)
        assert store.read_bytes(f"blob-{i}.bin") == blob, tail


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["gs", "az"])
def test_a_dead_endpoint_fails_within_the_budget_not_after_the_clients_own_retries(protocol, request):
    """gcsfs would try each request 6 times (about 31 s of backoff) and the Azure SDK 4 times (85 s against
    a dead endpoint) before rlctl saw a failure: rlctl's clients make one try, so a write to a server that
    is gone gives up after the 3 s budget."""
    from conftest import AZURITE_ACCOUNT, AZURITE_KEY, _server, _stop, gcs_server

    from rlctl.errors import StorageError

    _, options = request.getfixturevalue(ENVS[protocol])  # (the installed server, and its options)
    if protocol == "gs":
        proc, url = gcs_server()
        options = {**options, "endpoint_url": url}
    else:
        argv = [
            str(Path(sys.executable).parents[1] / "azurite/node_modules/.bin/azurite-blob"),
            "--inMemoryPersistence",
        ]
        proc, url = _server(
            [*argv, "--blobHost", "127.0.0.1", "--blobPort", "{port}", "--skipApiVersionCheck"], "Azurite"
        )
        options = {
            "connection_string": f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={url}/{AZURITE_ACCOUNT};"
        }
    try:
        store = Storage(f"{protocol}://gone-{uuid.uuid4().hex[:8]}/run", options, retry_timeout=3)
        store.fs.mkdir(store.root.split("/")[0])
        store.write_bytes("config.yaml", b"trainer: {}\n")
    finally:
        _stop(proc)  # the endpoint now refuses every connection
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="gave up after"):
        store.write_bytes("metrics.jsonl", b'{"step": 1}\n')
    assert time.monotonic() - t0 < 3 + 5, time.monotonic() - t0  # the budget, the last try, some slack


@pytest.mark.slow
def test_a_gcs_server_that_stops_answering_is_given_up_on_within_a_readers_timeout(gcs_env):
    """gcsfs gives its requests no timeout of their own (aiohttp then waits for ever on a server that
    accepted the connection and went silent): rlctl's connect and read timeouts, capped by a read-only
    command's --timeout (2 s here), end the read in about that."""
    from conftest import _pause, _stop, gcs_server

    from rlctl.errors import StorageError

    proc, url = gcs_server()
    options, bucket = {**gcs_env[1], "endpoint_url": url}, f"paused-{uuid.uuid4().hex[:8]}"
    try:
        reader = Storage.for_reading(f"gs://{bucket}/run", 2, options)
        assert type(reader.fs).__name__ == "GCSFileSystem"  # (not gcsfs's experimental gRPC-probing one)
        Storage(f"gs://{bucket}", options).fs.mkdir(bucket)
        Storage(f"gs://{bucket}/run", options).write_bytes("config.yaml", b"trainer: {}\n")
        _pause(proc)  # connections are accepted (the kernel's backlog); nothing answers
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="gave up after"):
            answer = reader.read_bytes("config.yaml")
            status = psutil.Process(proc.pid).status()
            pytest.fail(f"a paused server ({status} now) answered {answer!r} in {time.monotonic() - t0:.1f} s")
        assert time.monotonic() - t0 < 2 + 4, time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGCONT)
        _stop(proc)


@pytest.mark.slow
@pytest.mark.parametrize(("variable", "client"), [(None, "GCSFileSystem"), ("true", "ExtendedGcsFileSystem")])
def test_gcsfs_experimental_client_is_left_off_unless_its_variable_says_otherwise(gcs_env, variable, client):
    """gcsfs's experimental client asks a bucket's type over gRPC, outside every timeout rlctl sets: a
    process of rlctl's that imports gcsfs leaves it off, unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is set."""
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}  # (the tests' own)
    if variable is not None:
        env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = variable
    code = (  # (the preflight asks fsspec for gs://'s class first, which imports gcsfs)
        "import json, sys, fsspec; from rlctl.storage import Storage; fsspec.get_filesystem_class('gs'); "
        "print(type(Storage(sys.argv[1], json.loads(sys.argv[2])).fs).__name__)"
    )
    argv = [sys.executable, "-c", code, "gs://rlctl-runs/run", json.dumps(gcs_env[1])]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-1] == client, done.stderr[-2000:]
