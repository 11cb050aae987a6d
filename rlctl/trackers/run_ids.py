"""RUN_DIR/trackers.json: the tracker runs a resume continues (W&B's run id, MLflow's run id and the
branch number of each), written whole and atomically (a temporary file, then os.replace)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rlctl.rundir.layout import TRACKERS as FILE

VERSION = 1


class TrackerIds:
    """The current tracker run of each tracker (``{"run_id": ..., "branch": N, ...}``) in a local run
    directory. A file that cannot be read counts as empty (with one warning): trackers then start new
    runs rather than stop."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, FILE)
        self._data: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._data is None:
            try:
                with open(self.path, "rb") as fh:
                    data = json.loads(fh.read())
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
            except FileNotFoundError:
                data = {}
            except (OSError, ValueError) as exc:
                print(f"warning: cannot read {self.path} ({exc}); trackers start new runs", file=sys.stderr)
                data = {}
            self._data = data
        return self._data

    def get(self, tracker: str) -> dict[str, Any] | None:
        record = self._load().get(tracker)
        return record if isinstance(record, dict) and isinstance(record.get("run_id"), str) else None

    def put(self, tracker: str, record: dict[str, Any]) -> None:
        data = {**self._load(), "version": VERSION, tracker: record}
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._data = data
