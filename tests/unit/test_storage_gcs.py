"""rlctl's storage on GCS, against a real server on loopback (gcp-storage-emulator through gcsfs): what a
run directory needs of its store, on the one store whose client cannot append. (An exclusive create,
the lease's, is gcsfs's ifGenerationMatch=0, which this emulator does not enforce: untested here.)"""

import hashlib
import os
import uuid

import pytest

from rlctl.storage import Storage


@pytest.fixture
def gcs(gcs_env, monkeypatch):
    env, opts = gcs_env
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"])
    return Storage(f"gs://rlctl-runs/unit-{uuid.uuid4().hex[:8]}", opts, retry_timeout=10)


def test_appends_to_a_file_on_gcs_keep_what_it_held(gcs):
    """gcsfs opens a file for append as for writing (what it held is gone): every line appended stays."""
    lines = [f'{{"step": {i}}}\n'.encode() for i in range(1, 4)]
    for line in lines:
        gcs.append_bytes("events.jsonl", line)
    assert gcs.read_bytes("events.jsonl") == b"".join(lines)


def test_a_snapshot_directory_on_gcs_moves_lists_and_hashes_whole(gcs):
    blob = os.urandom(3 << 20)
    gcs.write_bytes("step-000002.tmp/weights.bin", blob)
    gcs.write_bytes("step-000002.tmp/manifest.json", b"{}")
    gcs.move_dir("step-000002.tmp", "step-000002")
    assert gcs.file_sizes("step-000002") == {"manifest.json": 2, "weights.bin": len(blob)}
    assert not gcs.exists("step-000002.tmp/manifest.json")
    assert gcs.sha256("step-000002/weights.bin") == hashlib.sha256(blob).hexdigest()
