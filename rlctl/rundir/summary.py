"""What a person wants to know about a run, from its one reading (``rlctl.rundir.record.RunRecord``).

Two shapes of one reading, on purpose: ``state_summary`` is a run's state at any moment (what `rlctl
inspect` prints and `--format json` gives: status, last snapshots, firings, skips, key metrics and their
trend), ``run_summary`` what training did, for the person who just ran it (reward and validation from
start to end, time, each rollback, the best snapshot), returned by ``start_run`` and ``resume_run``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlctl.errors import RlctlError
from rlctl.events import POLICY, ROLLBACK, SKIP, SNAPSHOT_COMMITTED
from rlctl.numbers import is_number
from rlctl.rundir.directory import validate_run_config
from rlctl.rundir.record import RunRecord
from rlctl.rundir.snapshots import snapshot_catalog
from rlctl.storage import Storage

if TYPE_CHECKING:
    from rlctl.config import RunConfig

KEY_METRICS = (
    "critic/score/mean",
    "val/score/mean",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/entropy",
    "response_length/mean",
    "perf/throughput",
    # a multi-turn run's (absent from other runs' rows, so not shown for them)
    "tool/calls/mean",
    "tool/error_frac",
    "tool/invalid_call_frac",
    "multi_turn/infra_masked_frac",
    "multi_turn/template_drift_frac",
    "multi_turn/turn_reward/mean",
    # rollout.mode one_step_off's (its batches trained an update after the weights that sampled them)
    "rollout/staleness/mean",
)
SPARKS = "▁▂▃▄▅▆▇█"


def series(record: RunRecord, metric: str) -> list[float]:
    """The values of ``metric`` in the rows the run kept, in step order (numbers only)."""
    return [r[metric] for r in record.rows if is_number(r.get(metric))]


def state_summary(record: RunRecord) -> dict[str, Any]:
    """The run's state now: status, step, its last (and last good) committed snapshot, rollbacks, policy
    firings and skips, unreadable metric lines, and the latest value and trend of each KEY_METRICS."""
    run = record.run
    snaps = [s for s in snapshot_catalog(run, validate_run_config(run, record.config)).scan() if s.committed]
    good = [s for s in snaps if s.good]
    skips = record.events_of(SKIP)
    mode, backend, stale = record.rollout
    return {
        "run": record.url,
        "status": record.status(),
        "step": record.step,
        "total_steps": record.total_steps,
        "rollout": {"mode": mode, "backend": backend, "staleness": stale},
        "last_snapshot": snaps[-1].step if snaps else None,
        "last_good_snapshot": good[-1].step if good else None,
        "rollbacks": len(record.events_of(ROLLBACK)),
        "policy_firings": len(record.events_of(POLICY)),
        "skipped_batches": sum(e["batches"] for e in skips if isinstance(e.get("batches"), int)),
        "skipped_prompts": sum(len(e["prompts"]) for e in skips if isinstance(e.get("prompts"), list)),
        "bad_lines": record.bad_lines,
        "metrics": {
            key: {"latest": values[-1], "trend": sparkline(values)}
            for key in KEY_METRICS
            if (values := series(record, key))
        },
    }


def run_summary(run: Storage, cfg: RunConfig | None = None, window: int = 10) -> dict[str, Any]:
    """What training did: steps and time, the reward (mean of the first and the last ``window`` steps)
    and the validation score (first and last) from start to end, snapshots committed, each rollback
    (step, rule, where it went back to), the best snapshot (with ``cfg``), and the trackers the run feeds."""
    record = RunRecord(run)
    scores, val = series(record, "critic/score/mean"), series(record, "val/score/mean")
    first, last = scores[:window], scores[-window:]
    return {
        "run_dir": run.url,
        "steps": record.step,
        "reward_start": sum(first) / len(first) if first else float("nan"),
        "reward_end": sum(last) / len(last) if last else float("nan"),
        "val_start": val[0] if val else None,
        "val_end": val[-1] if val else None,
        "window": window,
        "seconds": sum(series(record, "timing_s/step")),
        "snapshots": len(record.events_of(SNAPSHOT_COMMITTED)),
        "rollbacks": [
            {"rule": e.get("rule"), "from_step": e.get("from_step"), "to_step": e.get("to_step")}
            for e in record.events_of(ROLLBACK)
        ],
        "best": _best_snapshot(run, cfg) if cfg is not None else None,
        "loggers": list(cfg.trainer.loggers) if cfg is not None else [],
    }


def _best_snapshot(run: Storage, cfg: RunConfig) -> dict[str, Any] | None:
    """{"step", "metric", "value"} of the run's best snapshot by its validation metric, or None."""
    catalog = snapshot_catalog(run, cfg)
    rule = catalog.best_rule
    try:
        best = catalog.best(rule.metric, rule.mode)
    except RlctlError:  # the storage is failing: the summary does without
        return None
    return {"step": best[0].step, "metric": rule.metric, "value": best[0].val_metric(rule.metric)} if best else None


def sparkline(values: Sequence[float], width: int = 24) -> str:
    """The trend of ``values`` in ``width`` characters (bucket means); '!' marks a non-finite bucket."""
    if not values:
        return ""
    n = min(width, len(values))
    buckets = [values[i * len(values) // n : (i + 1) * len(values) // n] for i in range(n)]
    means = [sum(b) / len(b) for b in buckets]
    finite = [m for m in means if math.isfinite(m)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    span = hi - lo or 1.0
    return "".join(SPARKS[round((m - lo) / span * 7)] if math.isfinite(m) else "!" for m in means)
