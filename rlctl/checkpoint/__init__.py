"""Snapshots on fsspec storage. Knows Stateful objects, never models: never imports rlctl.engine."""

from rlctl.checkpoint.stateful import Stateful, check_version

__all__ = ["Stateful", "check_version"]
