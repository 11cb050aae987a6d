"""Files on any fsspec filesystem (local paths, file://, s3://, gs://, az://, memory://), with retries,
one sentence per failure and a shared outage clock: the ground floor every writer of a run stands on.

``store`` is ``Storage``, a directory on such a filesystem; ``clients`` opens the filesystems and bounds
their clients; ``failures`` classes and retries each failure; ``outages`` is the process's outage clock;
``deadline`` cuts a request that hangs once its store's outage has lasted the budget;
``appends`` appends without rewriting where the store allows; ``mounts`` tells a local disk from a
network one. This package only re-exports.
"""

from rlctl.storage.clients import fence_third_party_random
from rlctl.storage.failures import describe, guarded, is_transient
from rlctl.storage.store import RETRY_TIMEOUT_ENV, Storage, default_retry_timeout, fsync_path

__all__ = [
    "RETRY_TIMEOUT_ENV",
    "Storage",
    "default_retry_timeout",
    "describe",
    "fence_third_party_random",
    "fsync_path",
    "guarded",
    "is_transient",
]
