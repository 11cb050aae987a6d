"""MLflow: $MLFLOW_TRACKING_URI if set, else a SQLite store in the run directory
(sqlite:///RUN_DIR/mlflow.db, artifacts in RUN_DIR/mlartifacts/), through MlflowClient (no global
active run). The experiment is named after the rlctl run.

The MLflow run id lives in RUN_DIR/trackers.json, so a resume continues the same MLflow run; a step it
already holds for a metric is not logged again (a bit-exact resume re-does steps with the same values).
A rollback, or a resume that changes the run, ends the current MLflow run tagged
``rlctl.turned_away_at_step`` and starts a new one (tags ``rlctl.branch``, ``rlctl.parent_run_id``) with
the settled history replayed. MLflow's names allow no "@": ``val/score/mean@4`` is logged as
``val/score/mean_at_4``. Events: the metric ``events/<kind>`` and a text artifact
``events/<step>-<kind>.txt``.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from rlctl.trackers.base import History
from rlctl.trackers.run_ids import TrackerIds

KEY = "mlflow"
BATCH = 1000  # MLflow's limit of metrics per log_batch
PARAM_BATCH = 100  # and of params
_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_name(name: str) -> str:
    """A metric or param name MLflow accepts: "@" becomes "_at_", other characters it refuses "_"."""
    cleaned = _BAD.sub("_", name.replace("@", "_at_")).strip("/")
    return re.sub(r"/+", "/", cleaned) or "_"


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The run config as MLflow params: dotted keys, values as text."""
    params = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flat_params(value, f"{name}."))
        else:
            params[mlflow_name(name)] = str(value)
    return params


class MlflowTracker:
    name = "MLflow"

    def __init__(self, run_dir: str, run_name: str, config: dict[str, Any], ids: TrackerIds, history: History):
        self.run_dir, self.run_name, self.config = os.path.abspath(run_dir), run_name, config
        self.ids, self.history = ids, history
        self.client = None
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.join(self.run_dir, 'mlflow.db')}"
        self.run_id: str | None = None
        self.branch = 0
        self._high: dict[str, int] = {}  # the last step logged of each metric (a continued run: looked up)
        self._continued = False

    def _client(self):
        if self.client is None:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no telemetry thread in a training run
            from mlflow import MlflowClient

            if not os.environ.get("MLFLOW_TRACKING_URI"):  # creating our own store is no news to the user
                logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)

            self.client = MlflowClient(tracking_uri=self.uri)
        return self.client

    def _experiment_id(self) -> str:
        client = self._client()
        found = client.get_experiment_by_name(self.run_name)
        if found is not None:
            return found.experiment_id
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        location = "file://" + os.path.join(self.run_dir, "mlartifacts") if local else None
        return client.create_experiment(self.run_name, artifact_location=location)

    def _current(self) -> str:
        """The MLflow run being fed: the one in trackers.json (a resume), else a new one."""
        if self.run_id is None:
            record = self.ids.get(KEY)
            if record is not None and record.get("tracking_uri") == self.uri and self._exists(record["run_id"]):
                self.run_id, self.branch, self._continued = record["run_id"], int(record.get("branch", 1)), True
                self._client().update_run(self.run_id, status="RUNNING")
            else:
                self._branch(1, parent=None)
        return self.run_id

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self._client().get_run(run_id)
        except MlflowException:
            return False
        return True

    def _branch(self, branch: int, parent: str | None) -> None:
        """Start MLflow run number ``branch`` with the params and the settled history, and make it current."""
        client = self._client()
        tags = {"rlctl.run": self.run_name, "rlctl.branch": str(branch)}
        if parent:
            tags["rlctl.parent_run_id"] = parent
            tags["mlflow.note.content"] = f"Branched from run {parent} at step {self.history.settled}."
        name = self.run_name if branch == 1 else f"{self.run_name}-branch-{branch}"
        run = client.create_run(self._experiment_id(), run_name=name, tags=tags)
        self.run_id, self.branch, self._high, self._continued = run.info.run_id, branch, {}, False
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flat_params(self.config).items()]
        for i in range(0, len(params), PARAM_BATCH):
            client.log_batch(self.run_id, params=params[i : i + PARAM_BATCH])
        for step, values, wall in self.history.rows():
            self._metrics(step, values, wall)
        self.ids.put(KEY, {"run_id": self.run_id, "branch": branch, "tracking_uri": self.uri})

    def _new(self, key: str, step: int) -> bool:
        """Whether ``key`` at ``step`` is not in the run yet (steps only go forward within one run)."""
        if key not in self._high:
            history = self._client().get_metric_history(self.run_id, key) if self._continued else []
            self._high[key] = max((m.step for m in history), default=-1)
        if step <= self._high[key]:
            return False
        self._high[key] = step
        return True

    def _metrics(self, step: int, values: dict[str, float], wall: float | None) -> None:
        from mlflow.entities import Metric

        stamp = int((wall if wall is not None else time.time()) * 1000)
        names = {mlflow_name(k): v for k, v in values.items()}
        metrics = [Metric(k, v, stamp, step) for k, v in names.items() if self._new(k, step)]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + BATCH])

    def log(self, step: int, values: dict[str, float], wall: float | None) -> None:
        self._current()
        self._metrics(step, values, wall)

    def event(self, step: int, kind: str, text: str) -> None:
        self._current()
        self._metrics(step, {f"events/{kind}": 1.0}, None)
        self.client.log_text(self.run_id, text + "\n", f"events/{step:08d}-{mlflow_name(kind)}.txt")

    def turn(self, step: int, *, branch: bool, why: str) -> None:
        if not branch:
            return  # a bit-exact resume: the same MLflow run goes on
        record = self.ids.get(KEY)
        parent = self.run_id or (record["run_id"] if record and record.get("tracking_uri") == self.uri else None)
        if parent is not None and self._exists(parent):
            client = self._client()
            client.set_tag(parent, "rlctl.turned_away_at_step", str(step))
            client.set_tag(parent, "rlctl.turned_away_by", why[:5000])
            client.set_terminated(parent, status="FINISHED")
        else:
            parent = None
        self._branch(int(record.get("branch", 1)) + 1 if record else 1, parent)

    def close(self, ok: bool) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FINISHED" if ok else "KILLED")
            self.run_id = None
