"""What a person wants to know when a run ends, read from its run directory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlctl.errors import RlctlError
from rlctl.metrics import read_rows
from rlctl.rundir.layout import EVENTS, METRICS
from rlctl.rundir.snapshots import snapshot_manager
from rlctl.storage import Storage

if TYPE_CHECKING:
    from rlctl.config import RunConfig


def run_summary(run: Storage, cfg: RunConfig | None = None, window: int = 10) -> dict[str, Any]:
    """What a person wants to know when a run ends: steps and time, the reward (mean of the first and the
    last ``window`` steps) and the validation score (first and last) from start to end, snapshots
    committed, each rollback (step, rule, where it went back to), the best snapshot (with ``cfg``), and
    the trackers the run feeds."""
    rows = read_rows(run, METRICS, require_step=True)
    events = read_rows(run, EVENTS)
    scores = [r["critic/score/mean"] for r in rows if _number(r.get("critic/score/mean"))]
    val = [r["val/score/mean"] for r in rows if _number(r.get("val/score/mean"))]
    first, last = scores[:window], scores[-window:]
    return {
        "run_dir": run.url,
        "steps": rows[-1]["step"] if rows else 0,
        "reward_start": sum(first) / len(first) if first else float("nan"),
        "reward_end": sum(last) / len(last) if last else float("nan"),
        "val_start": val[0] if val else None,
        "val_end": val[-1] if val else None,
        "window": window,
        "seconds": sum(r["timing_s/step"] for r in rows if _number(r.get("timing_s/step"))),
        "snapshots": sum(e.get("event") == "snapshot_committed" for e in events),
        "rollbacks": [
            {"rule": e.get("rule"), "from_step": e.get("from_step"), "to_step": e.get("to_step")}
            for e in events
            if e.get("event") == "rollback"
        ],
        "best": _best_snapshot(run, cfg) if cfg is not None else None,
        "loggers": list(cfg.trainer.loggers) if cfg is not None else [],
    }


def _best_snapshot(run: Storage, cfg: RunConfig) -> dict[str, Any] | None:
    """{"step", "metric", "value"} of the run's best snapshot by its validation metric, or None."""
    manager = snapshot_manager(run, cfg)
    rule = manager.best_rule
    try:
        best = manager.best(rule.metric, rule.mode)
    except RlctlError:  # the storage is failing: the summary does without
        return None
    return {"step": best[0].step, "metric": rule.metric, "value": best[0].val_metric(rule.metric)} if best else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
