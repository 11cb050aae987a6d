"""Bytes sent per flush of ``metrics.jsonl``, with the file at 1, 10 and 100 MB, on each store.

    .venv/bin/python benchmarks/appends.py [--sizes-mb 1 10 100] [--stores local s3 gs az]

Starts the suite's servers on loopback (moto's S3, gcp-storage-emulator, Azurite) and puts a proxy that
counts what the client sends in front of each (tests/support/byte_counter.py); on a local disk the count is the
bytes this process passed to write() (``wchar`` in /proc/self/io). For each size: writes the file, then
times and counts one flush of ten rows (``Storage.append_bytes``: after) and the same flush the
read-and-rewrite way that GCS and Azure appended with before (``cat_file`` + ``pipe_file``: before). On a
local disk and S3 "before" is the unchanged append (O_APPEND; s3fs's "ab"). Checks the file's bytes at the
end. Prints a table.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "support")]  # the suite's server starters, the proxy

from rlctl.storage import Storage  # noqa: E402

from byte_counter import CountingProxy  # noqa: E402

ROW = b'{"step": %d, "actor/pg_loss": 0.0123, "actor/kl_loss": 0.0004, "critic/score/mean": 0.5, "pad": "%s"}\n'


def rows(first: int, count: int) -> bytes:
    return b"".join(ROW % (i, b"x" * 900) for i in range(first, first + count))  # about 1 KB a row


def start_servers(stores: list[str]):
    """{store: (server process or None, fsspec options pointing at a counting proxy, the proxy)}."""
    import conftest

    started = {}
    if "s3" in stores:
        import s3fs

        proc, url = conftest._server(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", "{port}"], "moto"
        )
        proxy = CountingProxy(url)
        opts = {"client_kwargs": {"endpoint_url": proxy.url}, "key": "test", "secret": "test"}
        s3fs.S3FileSystem(**opts, skip_instance_cache=True).mkdir("rlctl-runs")
        started["s3"] = (proc, opts, proxy)
    if "gs" in stores:
        proc, url = conftest.gcs_server("--default-bucket", "rlctl-runs")
        proxy = CountingProxy(url)
        started["gs"] = (proc, {"endpoint_url": proxy.url, "token": "anon", "project": "bench"}, proxy)
    if "az" in stores:
        import adlfs

        azurite = str(Path(sys.executable).parents[1] / "azurite/node_modules/.bin/azurite-blob")
        args = ["--inMemoryPersistence", "--blobHost", "127.0.0.1", "--blobPort", "{port}", "--skipApiVersionCheck"]
        proc, url = conftest._server([azurite, *args, "--loose", "--silent"], "Azurite")
        proxy = CountingProxy(url)
        connection = (
            f"DefaultEndpointsProtocol=http;AccountName={conftest.AZURITE_ACCOUNT};"
            f"AccountKey={conftest.AZURITE_KEY};BlobEndpoint={proxy.url}/{conftest.AZURITE_ACCOUNT};"
        )
        opts = {"connection_string": connection}
        adlfs.AzureBlobFileSystem(**opts, skip_instance_cache=True).mkdir("rlctl-runs")
        started["az"] = (proc, opts, proxy)
    return started


def local_written() -> int:
    with open("/proc/self/io") as fh:
        return int(re.search(r"wchar: (\d+)", fh.read()).group(1))


def rewrite(store: Storage, rel: str, data: bytes) -> None:
    """The append GCS and Azure had before: read the object, write it back with the new bytes."""
    path = store.path(rel)
    store.fs.pipe_file(path, store.fs.cat_file(path) + data)


def measure(store: Storage, counter, size: int, body: bytes) -> tuple[int, float, int, float]:
    """(bytes sent, seconds) of one flush after, then before, with the file at ``size`` bytes."""
    flush = rows(10**9, 10)
    rewrote = store.url.split(":")[0] in ("gs", "az")
    ways = {
        "after": store.append_bytes,
        "before": (lambda r, d: rewrite(store, r, d)) if rewrote else store.append_bytes,
    }
    counts = []
    for name, way in ways.items():
        rel = f"{size}/{name}/metrics.jsonl"
        store.write_bytes(rel, body)  # (on Azure a block blob, as an older rlctl left it ...)
        if name == "after":
            store.append_bytes(rel, b"")  # (... which the first append makes an append blob)
        before, t0 = counter(), time.perf_counter()
        way(rel, flush)
        counts += [counter() - before, time.perf_counter() - t0]
        assert store.read_bytes(rel) == body + flush, f"{store.url}/{rel}: wrong bytes"
        store.rm(rel)
    return tuple(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--stores", nargs="+", default=["local", "s3", "gs", "az"], choices=["local", "s3", "gs", "az"])
    args = ap.parse_args()
    whole = rows(0, (max(args.sizes_mb) << 20) // len(rows(0, 1)) + 1)
    servers = start_servers(args.stores)
    lines = []
    try:
        for name in args.stores:
            if name == "local":
                import tempfile

                store, counter = Storage(tempfile.mkdtemp(prefix="rlctl-appends-")), local_written
            else:
                _, opts, proxy = servers[name]
                store, counter = Storage(f"{name}://rlctl-runs/appends-bench", opts), lambda p=proxy: p.sent
            for mb in args.sizes_mb:
                body = whole[: whole.rindex(b"\n", 0, mb << 20) + 1]
                after, t_after, before, t_before = measure(store, counter, mb, body)
                lines.append((name, mb, before, t_before, after, t_after))
                print(
                    f"{name} {mb} MB: before {before:,} B in {t_before:.2f} s, after {after:,} B in {t_after:.2f} s",
                    file=sys.stderr,
                )
    finally:
        for proc, _, proxy in servers.values():
            proxy.close()
            proc.terminate()
            proc.wait(timeout=30)
    print(f"one flush of 10 rows ({len(rows(0, 10)):,} bytes), bytes sent by the client")
    print(f"{'store':<6} {'file':>7} {'before':>13} {'s':>6} {'after':>9} {'s':>6}")
    for name, mb, before, t_before, after, t_after in lines:
        print(f"{name:<6} {mb:>4} MB {before:>13,} {t_before:>6.2f} {after:>9,} {t_after:>6.2f}")


if __name__ == "__main__":
    main()
