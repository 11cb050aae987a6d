"""Appends on each object store, against the real servers on loopback (moto's S3, gcp-storage-emulator,
Azurite) seen through a proxy that counts what the client sends: the file holds what a local file holds
after the same appends (a resume that sets rows aside included), and on GCS and Azure an append sends
the new bytes, not the file (the read-and-rewrite way sent the whole file each time)."""

import os
import re
import sys
import uuid

import pytest

from rlctl.rundir.history import abandon_rows_after, turn_tag
from rlctl.storage import Storage, appends

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from byte_counter import CountingProxy  # noqa: E402

ENVS = {"s3": "s3_env", "gs": "gcs_env", "az": "azure_env"}


def through(proxy_url: str, scheme: str, opts: dict) -> dict:
    """``opts`` (a store's fsspec options) with the proxy in place of the server."""
    if scheme == "s3":
        return {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": proxy_url}}
    if scheme == "gs":
        return {**opts, "endpoint_url": proxy_url}
    connection = re.sub(r"BlobEndpoint=http://[^/;]+", f"BlobEndpoint={proxy_url}", opts["connection_string"])
    return {**opts, "connection_string": connection}


def upstream_of(scheme: str, opts: dict) -> str:
    if scheme == "s3":
        return opts["client_kwargs"]["endpoint_url"]
    if scheme == "gs":
        return opts["endpoint_url"]
    return re.search(r"BlobEndpoint=(http://[^/;]+)", opts["connection_string"]).group(1)


@pytest.fixture(params=list(ENVS))
def counted(request):
    """(a Storage on the store seen through a counting proxy, the proxy)."""
    scheme = request.param
    _, opts = request.getfixturevalue(ENVS[scheme])
    proxy = CountingProxy(upstream_of(scheme, opts))
    url = f"{scheme}://rlctl-runs/appends-{uuid.uuid4().hex[:8]}"
    yield Storage(url, through(proxy.url, scheme, opts), retry_timeout=10), proxy
    proxy.close()


def rows(first: int, count: int, width: int = 200) -> bytes:
    return b"".join(b'{"step": %d, "pad": "%s"}\n' % (i, b"x" * width) for i in range(first, first + count))


@pytest.mark.slow
def test_appends_hold_what_a_local_file_holds_with_a_resume_that_sets_rows_aside(counted, tmp_path):
    """Many appends of every size (one over Azure's 4 MiB block), a resume from step 40 that moves the
    later rows to metrics.abandoned.jsonl and rewrites metrics.jsonl whole, then more appends: byte for
    byte what the same calls leave on a local disk. On Azure the rewritten file is an append blob again."""
    store, _ = counted
    local = Storage(str(tmp_path))
    tag = turn_tag("resume", from_step=40)
    for target in (store, local):
        target.append_bytes("events.jsonl", b"")  # an empty append creates the file
        step = 0
        for count in (1, 3, 1, 10, 2, 5, 1, 30):
            target.append_bytes("metrics.jsonl", rows(step, count))
            step += count
        target.append_bytes("metrics.jsonl", rows(step, 1, width=(4 << 20) + 100))
        step += 1
        assert abandon_rows_after(target, 40, tag) == step - 41
        for count in (2, 1, 7):
            target.append_bytes("metrics.jsonl", rows(41, count))
    for rel in ("metrics.jsonl", "metrics.abandoned.jsonl", "events.jsonl"):
        assert store.read_bytes(rel) == local.read_bytes(rel), rel
    if store.url.startswith("az://"):
        assert _blob_type(store, "metrics.jsonl") == "AppendBlob"


@pytest.mark.slow
def test_a_block_blob_of_an_older_rlctl_becomes_an_append_blob_at_its_first_append(azure_env):
    _, opts = azure_env
    store = Storage(f"az://rlctl-runs/older-{uuid.uuid4().hex[:8]}", opts, retry_timeout=10)
    store.write_bytes("metrics.jsonl", rows(0, 5))  # a whole write: a block blob
    assert _blob_type(store, "metrics.jsonl") == "BlockBlob"
    store.append_bytes("metrics.jsonl", rows(5, 2))
    store.append_bytes("metrics.jsonl", rows(7, 1))
    assert _blob_type(store, "metrics.jsonl") == "AppendBlob"
    assert store.read_bytes("metrics.jsonl") == rows(0, 8)


def test_an_append_blob_near_its_block_limit_is_made_again_with_what_it_held(azure_env, monkeypatch):
    """Azure refuses a block past an append blob's 50,000th; the blob is made again first (here with the
    limit lowered to 4 so that the test need not send 50,000 requests)."""
    _, opts = azure_env
    monkeypatch.setattr(appends, "AZURE_BLOCKS", 4)
    store = Storage(f"az://rlctl-runs/limit-{uuid.uuid4().hex[:8]}", opts, retry_timeout=10)
    counts = []
    for i in range(10):
        store.append_bytes("metrics.jsonl", rows(i, 1))
        counts.append(_committed_blocks(store, "metrics.jsonl"))
    assert store.read_bytes("metrics.jsonl") == rows(0, 10)
    assert max(counts) <= 4 and counts[:6] == [1, 2, 3, 4, 1, 2]


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_a_try_after_a_lost_answer_appends_once(scheme, request):
    """The retry loop tries an append again when a try failed; a try whose bytes landed but whose answer
    was lost must not append them twice: the next try finds them there."""
    _, opts = request.getfixturevalue(ENVS[scheme])
    store = Storage(f"{scheme}://rlctl-runs/twice-{uuid.uuid4().hex[:8]}", opts, retry_timeout=10)
    store.append_bytes("metrics.jsonl", rows(0, 3))
    once = appends.appender(store.fs, store.path("metrics.jsonl"), rows(3, 2))
    once()
    once()  # (as the retry loop would, after the first try's answer was lost)
    assert store.read_bytes("metrics.jsonl") == rows(0, 5)
    assert not [n for n in store.listdir() if ".append-" in n]  # no temporary left


@pytest.mark.slow
def test_an_append_sends_the_new_bytes_not_the_file(counted):
    """The bytes sent by one append (a flush of 10 rows, about 2 KiB) with the file at 64 KiB and at
    6 MiB and 12 MiB: the same within a few KiB of headers on GCS and Azure (the read-and-rewrite way
    sent 6 and 12 MiB), and on S3 past 5 MiB, where s3fs copies the object server-side."""
    store, proxy = counted
    flush = rows(0, 10)
    sent = {}
    for size in (64 << 10, 6 << 20, 12 << 20):
        rel = f"metrics-{size}.jsonl"
        store.write_bytes(rel, b"y" * (size - 1) + b"\n")
        store.append_bytes(rel, b"")  # (Azure: a whole write is a block blob, made an append blob here)
        before = proxy.sent
        store.append_bytes(rel, flush)
        sent[size] = proxy.sent - before
        assert store.size(rel) == size + len(flush)
    assert sent[12 << 20] - sent[6 << 20] < 8 << 10, sent
    assert sent[12 << 20] < len(flush) + (16 << 10), sent
    if not store.url.startswith("s3://"):  # (s3fs rewrites a file under 5 MiB: 64 KiB sends 64 KiB)
        assert sent[6 << 20] - sent[64 << 10] < 8 << 10, sent


def _props(store: Storage, rel: str):
    from fsspec.asyn import sync

    container, blob, _ = store.fs.split_path(store.path(rel))

    async def props():
        async with store.fs.service_client.get_blob_client(container=container, blob=blob) as bc:
            return await bc.get_blob_properties()

    return sync(store.fs.loop, props)


def _blob_type(store: Storage, rel: str) -> str:
    kind = _props(store, rel).blob_type
    return str(getattr(kind, "value", kind))


def _committed_blocks(store: Storage, rel: str) -> int:
    return _props(store, rel).append_blob_committed_block_count


@pytest.mark.slow
def test_a_whole_write_over_an_append_blob_of_more_than_64_mib(azure_env):
    """A resume rewrites metrics.jsonl whole; past 64 MiB the SDK stages blocks, which Azure refuses onto
    an append blob (adlfs said FileExistsError): the write replaces it, and appends go on."""
    _, opts = azure_env
    store = Storage(f"az://rlctl-runs/big-{uuid.uuid4().hex[:8]}", opts, retry_timeout=10)
    store.append_bytes("metrics.jsonl", rows(0, 3))
    kept = b"z" * (65 << 20) + b"\n"
    store.write_bytes("metrics.jsonl", kept)
    store.append_bytes("metrics.jsonl", rows(3, 1))
    assert store.read_bytes("metrics.jsonl") == kept + rows(3, 1)
    assert _blob_type(store, "metrics.jsonl") == "AppendBlob"
