"""Whether a local path is on a disk of this machine only (ext4, xfs, tmpfs...) or on a filesystem every
node of a cluster may mount (NFS, Lustre, GPFS, CephFS, a FUSE mount of an object store): read from
/proc/mounts, the mount point that holds the path. Where that cannot be read (not Linux), nothing is
claimed."""

from __future__ import annotations

import os

# filesystems on one machine's own disks or memory
NODE_LOCAL = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "ramfs", "f2fs", "zfs", "vfat"})


def mount_type(path: str, mounts: str = "/proc/mounts") -> str | None:
    """The filesystem type of the mount that holds ``path`` (None where /proc/mounts cannot be read)."""
    try:
        with open(mounts, encoding="utf-8") as fh:
            table = [line.split()[1:3] for line in fh if len(line.split()) >= 3]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, kind = "", None
    for point, fstype in table:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def node_local(path: str, mounts: str = "/proc/mounts") -> str | None:
    """The filesystem type when ``path`` is on this machine only (NODE_LOCAL), else None."""
    kind = mount_type(path, mounts)
    return kind if kind in NODE_LOCAL else None
