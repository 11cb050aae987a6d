"""Snapshots on fsspec storage. Knows Stateful objects (rlctl.stateful), never models: never imports
rlctl.engine."""
