"""Experiment trackers fed from a run's metric rows and events: TensorBoard, Weights & Biases, MLflow.

The JSONL log (metrics.jsonl, events.jsonl) stays the truth; trackers are views of it for people who
look at curves. Rank 0 alone feeds them, through ``Trackers``. A tracker library is imported only when
it is configured and the first row or event arrives, and a tracker that fails at runtime is dropped
with one warning, never the training.

A rollback or a resume that changes the run turns it away from the steps after N: TensorBoard purges
the later steps, W&B and MLflow end the current tracker run (tagged as turned away) and start a branch
with the history through N replayed, so no tracker shows two values for one step as if both were real.
"""

from __future__ import annotations

from rlctl.trackers.fanout import Trackers
from rlctl.trackers.install import PIP, REQUIRES, missing

__all__ = ["PIP", "REQUIRES", "Trackers", "missing"]
