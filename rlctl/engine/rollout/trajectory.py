"""The trajectories of a multi-turn run's conversations, one file per step and rank, for `rlctl trajectories`.

RUN_DIR/trajectories/step-000012.rank-0.jsonl holds one orjson line per conversation rank 0 trained on
at step 12 (every round of dynamic sampling): its prompt and sample, its score, whether an
infrastructure failure masked it, the drift check's first differing position, its tool calls (tool,
arguments, outcome, the answer as the model saw it) and its tokens as segments: runs of the model's
own tokens (trained, unless the conversation is masked) and of the tools' and the template's tokens
(never trained), each with its text and token count. A step run again (after a resume or a rollback)
writes its file anew: the trajectory is the step as it was trained last. The reading side is
``rlctl.rundir.trajectories``.
"""

from __future__ import annotations

from typing import Any

import orjson

from rlctl.rundir.handle import RunDir


def segments(ids: list[int], model: list[bool], trained: bool, decode) -> list[dict[str, Any]]:
    """``ids`` cut into runs of the model's tokens and of the others, each decoded (``decode(ids)``)."""
    out: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or model[i] != model[start]:
            own = model[start]
            out.append(
                {
                    "by": "model" if own else "tools",
                    "trained": own and trained,
                    "tokens": i - start,
                    "text": decode(ids[start:i]),
                }
            )
            start = i
    return out


class TrajectoryLog:
    """One rank's trajectories of the step it trains, written when the step's rollout is over."""

    def __init__(self, run: RunDir, rank: int):
        self.run, self.rank = run, rank
        self._lines: list[bytes] = []
        self._step = -1

    def add(self, step: int, trajectory: dict[str, Any]) -> None:
        if step != self._step:
            self._step, self._lines = step, []
        self._lines.append(orjson.dumps({"step": step, "rank": self.rank, **trajectory}) + b"\n")

    def write(self) -> None:
        """The step's trajectories on storage (replacing an earlier run's of the same step)."""
        if self._lines:
            self.run.write_trajectories(self._step, self.rank, b"".join(self._lines))
            self._lines = []
