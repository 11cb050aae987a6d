"""The tool calls of each step, recorded in the run directory and replayed when the step runs again.

A resumed run (after a SIGKILL or a preemption) and a rolled-back one train some steps again from a
snapshot. They sample the same conversations (seeds from seed, step, prompt, sample and turn), so they
make the same calls; each call gets the answer it got the first time, read from the record, and a run
whose tools are not deterministic (a clock, a sandbox, a web lookup) still resumes bit for bit. A call
that was never answered (the process died while it ran) runs again. A call is the same call when its
step, prompt, sample, turn, position in the turn, tool and arguments are all the same.

RUN_DIR/tools/step-000012.rank-0.jsonl holds one line per call a rank answered at step 12 (its key,
outcome, seconds and the sha256 of its text), appended as each call ends; RUN_DIR/tools/results/SHA256
holds each text once (content-addressed: an answer given a thousand times is stored once). A line is
written after its text, so a line never names a missing text; a torn last line (a kill mid-append) and
a missing or damaged text are skipped: that call runs again. An infrastructure failure (a timeout, an
unavailable tool) is not recorded either: the call runs again, since the outage may be over.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import orjson

from rlctl.rundir.handle import RunDir


def call_key(step: int, prompt: str, seed: tuple[int, int], turn: int, position: int, name: str, args: Any) -> str:
    """The identity of a call: a hash of everything that makes it the same call (see the module)."""
    body = json.dumps([step, prompt, list(seed), turn, position, name, args], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass(frozen=True)
class Recorded:
    outcome: str
    text: str
    seconds: float


class ToolRecord:
    """One rank's record of the calls of the step it runs (``begin``), and the answers recorded before."""

    def __init__(self, run: RunDir, rank: int, world: int = 1):
        self.run, self.rank, self.world = run, rank, world
        self.step = -1
        self._known: dict[str, Recorded] = {}
        self._lines: list[bytes] = []
        self._texts: dict[str, str] = {}

    def begin(self, step: int) -> None:
        """Start recording ``step``; the answers recorded for it before (by every rank of the world: a
        file each, read without listing the folder, which grows with the steps) become replayable."""
        if step != self.step:
            self.step, self._known = step, self._read(step)

    def replay(self, key: str) -> Recorded | None:
        return self._known.get(key)

    def add(self, key: str, outcome: str, text: str, seconds: float) -> None:
        sha = hashlib.sha256(text.encode()).hexdigest()
        self._texts[sha] = text
        self._known[key] = Recorded(outcome, text, seconds)
        line = {"key": key, "outcome": outcome, "result": sha, "seconds": round(seconds, 6)}
        self._lines.append(orjson.dumps(line) + b"\n")

    def flush(self) -> None:
        """The calls added since the last flush on storage: their texts, then their lines."""
        for sha, text in self._texts.items():
            self.run.add_tool_answer(sha, text.encode())  # (the same answer given before is kept)
        if self._lines:
            self.run.append_tool_calls(self.step, self.rank, b"".join(self._lines))
        self._texts, self._lines = {}, []

    def _read(self, step: int) -> dict[str, Recorded]:
        known: dict[str, Recorded] = {}
        for rank in range(self.world):
            data = self.run.tool_calls(step, rank)
            if data is None:  # (a step that never ran a call on that rank)
                continue
            for raw in data.splitlines():
                line = _parse(raw)
                if line is None:
                    continue
                text = self._text(line["result"])
                if text is not None:
                    known[line["key"]] = Recorded(line["outcome"], text, float(line["seconds"]))
        return known

    def _text(self, sha: str) -> str | None:
        data = self.run.tool_answer(sha)
        return data.decode() if data is not None and hashlib.sha256(data).hexdigest() == sha else None


def _parse(raw: bytes) -> dict[str, Any] | None:
    """A recorded line, or None when it is torn or malformed."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    ok = isinstance(line, dict) and all(isinstance(line.get(k), str) for k in ("key", "outcome", "result"))
    return line if ok and isinstance(line.get("seconds"), int | float) else None
