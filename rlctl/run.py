"""The run directory: its layout, creation, and the summary of a finished run.

RUN_DIR/
  config.yaml       the resolved config (every key, defaults included)
  model/            the built-in model and tokenizer (when model.path is empty)
  metrics.jsonl     one orjson line per step
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlctl.config import RunConfig
from rlctl.errors import ConfigError
from rlctl.metrics import read_rows


def create_run_dir(run_dir: Path, cfg: RunConfig) -> None:
    if (run_dir / "config.yaml").exists() or (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"--run-dir {run_dir} already holds a run; choose a new directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())


def run_summary(run_dir: Path, window: int = 10) -> dict[str, Any]:
    rows = list(read_rows(run_dir / "metrics.jsonl"))
    scores = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    first, last = scores[:window], scores[-window:]
    return {
        "run_dir": str(run_dir),
        "steps": rows[-1]["step"] if rows else 0,
        "reward_start": sum(first) / len(first) if first else float("nan"),
        "reward_end": sum(last) / len(last) if last else float("nan"),
        "window": window,
        "seconds": sum(r.get("timing_s/step", 0.0) for r in rows),
    }
