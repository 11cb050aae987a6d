"""Storage that every node reaches: a path's filesystem read from the mount table, and a run whose ranks
are on several Ray nodes refused before any work when its run directory or snapshots would be on one
machine's own disk or in the process's memory (each node would hold its ranks' part of a snapshot)."""

import pytest

from rlctl.errors import ExitCode
from rlctl.storage.mounts import mount_type, node_local

from helpers import invoke

MOUNTS = "/dev/vda / ext4 rw 0 0\nserver:/export /mnt/shared nfs4 rw 0 0\ntmpfs /mnt/shared/scratch tmpfs rw 0 0\n"


def test_the_mount_that_holds_a_path_gives_its_filesystem(tmp_path):
    table = tmp_path / "mounts"
    table.write_text(MOUNTS)
    assert (
        mount_type("/mnt/shared/runs/x", str(table)) == "nfs4" and node_local("/mnt/shared/runs/x", str(table)) is None
    )
    assert node_local("/mnt/shared/scratch/x", str(table)) == "tmpfs"  # the longest mount point wins
    assert node_local("/mnt/sharedother/x", str(table)) == "ext4"  # a name that only starts alike is not inside
    assert mount_type("/x", str(tmp_path / "absent")) is None  # no mount table: nothing claimed


def test_ranks_on_two_nodes_with_a_run_directory_on_this_machines_disk_are_refused_before_any_work(tmp_path):
    nodes = ["--ray-address", "local", "--set", "trainer.nnodes=2", "--set", "trainer.n_devices_per_node=1"]
    kind = node_local(str(tmp_path))
    run = tmp_path / "run"
    r = invoke("start", "--run-dir", str(run), *nodes, "--set", "checkpoint.dir=s3://bucket/ckpt")
    if kind is None:
        pytest.skip("the tmp directory is on a shared filesystem here: nothing to refuse")
    assert r.returncode == ExitCode.CONFIG, r.stderr
    assert (
        f"the run directory {run} is on this machine's own {kind} filesystem, but the run's ranks are on 2 nodes"
        in r.stderr
    )
    assert not run.exists()
    r = invoke("start", "--run-dir", "memory://two-nodes/run", *nodes)
    assert r.returncode == ExitCode.CONFIG and "on the memory of this process" in r.stderr
