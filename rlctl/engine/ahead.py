"""``rollout.mode: one_step_off``: the batch of step N+1 is generated while step N trains.

At the start of step N the trainer takes step N's batch (``take``), generated during step N-1, and
starts step N+1's (``start``): a copy of the actor's module takes the weights step N starts from and
generates in a background thread (its own core; torch runs each thread's ops on that thread), while
the main thread trains step N on the actor. So a batch is sampled by the weights one update older than
those it trains (``rollout/staleness/mean`` 1; the first step's batch has none older, 0), and the
result depends on nothing but the step: prompts are drawn from the run's cursor in step order, seeds
come from (seed, step, prompt, sample), the weights from the step the generation started at.

The batch in flight is part of the run's state (``Stateful``): a snapshot waits for it and holds its
tokens, masks, rollout log-probs, scores, generation metrics, the dataset indices it drew, the weight
version that sampled it and the cursor's state before it drew, so a resume trains exactly the batch
the uninterrupted run trained. A batch is dropped, its prompts given back to the cursor, when it cannot
be trained as sampled: a rollback restores the snapshot's batch instead (the one in flight was sampled
by weights the rollback undoes), and a batch sampled with other sampling knobs than the step's (a
policy's ``adjust``, a schedule) or holding a prompt a policy skipped is made again, synchronously,
with the current weights. No prompt is trained twice or skipped by a drop. Under rollout.multi_turn the
generating rollout has tool workers of its own; its calls are recorded as they end (a resume replays
them) and its events are held with the batch and emitted when it trains.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlctl.config import RunConfig
from rlctl.engine.batch import Sequences
from rlctl.engine.dist import MAX, MEAN
from rlctl.engine.experience import Experience
from rlctl.engine.tools.pool import ToolPool
from rlctl.stateful import check_version

STALENESS_METRICS = {"rollout/staleness/mean": MEAN, "rollout/staleness/max": MAX}
SEQ_FIELDS = ("input_ids", "attention_mask", "response_mask", "rollout_log_probs", "turn_rewards")


def sampling_knobs(cfg: RunConfig) -> dict[str, Any]:
    """What a batch was sampled with, beyond the weights and the seeds."""
    r = cfg.rollout
    return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "min_p": r.min_p}


@dataclass
class Batch:
    """A step's batch, made ahead: what ``Experience.rollout_batch`` returned, the dataset indices it drew,
    the number of updates of the weights that sampled it, the knobs it was sampled with and the cursor's
    state before it drew (to give its prompts back)."""

    step: int
    seqs: Sequences
    scores: torch.Tensor
    sampling: dict[str, float]
    drawn: list[int]
    version: int
    knobs: dict[str, Any]
    cursor_before: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)  # the generation's, emitted when it trains

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seqs": {name: getattr(self.seqs, name) for name in SEQ_FIELDS},
            "prompt_len": self.seqs.prompt_len,
            "scores": self.scores,
            "sampling": self.sampling,
            "drawn": self.drawn,
            "version": self.version,
            "knobs": self.knobs,
            "cursor_before": self.cursor_before,
            "events": self.events,
        }

    @staticmethod
    def from_state(state: dict[str, Any], device: torch.device) -> Batch:
        fields = {k: (v.to(device) if v is not None else None) for k, v in state["seqs"].items()}
        seqs = Sequences(prompt_len=state["prompt_len"], **fields)
        return Batch(
            state["step"],
            seqs,
            state["scores"],
            state["sampling"],
            list(state["drawn"]),
            state["version"],
            state["knobs"],
            state["cursor_before"],
            list(state.get("events", [])),
        )


class GeneratingActor:
    """What the rollout backend needs of an actor, over a copy of the actor's module that generates while
    the actor trains (its weights copied from the actor by ``load_from``)."""

    def __init__(self, actor) -> None:
        self.runtime, self.module = actor.runtime, copy.deepcopy(actor.module)
        self.module.requires_grad_(False)

    def load_from(self, actor) -> None:
        with torch.no_grad(), actor.full_parameters():
            for mine, theirs in zip(self.module.parameters(), actor.module.parameters()):
                mine.copy_(theirs)

    def full_parameters(self):
        import contextlib

        return contextlib.nullcontext()


class RolloutAhead:
    """One batch generated ahead, in a background thread (see the module). Stateful (version 1)."""

    VERSION = 1

    def __init__(
        self,
        cfg: RunConfig,
        actor,
        experience: Experience,
        knobs: Callable[[], dict[str, Any]],
        events: list[dict[str, Any]] | None = None,
        pool=None,
    ):
        """``experience``: draws, generates and scores with a rollout over a ``GeneratingActor`` of
        ``actor`` (its cursor the run's); ``knobs``: the sampling knobs of the step about to run;
        ``events``: where its rollout emits (gathered into each batch); ``pool``: its tool workers
        (multi-turn; closed by ``close``)."""
        self.cfg, self.actor, self.experience, self.knobs = cfg, actor, experience, knobs
        self.events, self.pool = events if events is not None else [], pool
        self.generating: GeneratingActor = experience.rollout.actor
        self.ready: Batch | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.dropped = 0  # trajectories dropped since the last ``take_dropped``

    def take(self, step: int, trained: int, skipped: frozenset[int] | set[int]) -> tuple[Batch, dict[str, float]]:
        """Step ``step``'s batch, and its staleness metrics: the one made ahead when it can be trained as
        sampled, else one made now by the current weights (``trained``: updates so far)."""
        self.wait()
        batch, self.ready = self.ready, None
        if batch is not None and (batch.step != step or batch.knobs != self.knobs() or set(batch.drawn) & set(skipped)):
            self._give_back(batch)
            batch = None
        if batch is None:
            batch = self._make(step, trained)
        stale = float(trained - batch.version)
        return batch, {"rollout/staleness/mean": stale, "rollout/staleness/max": stale}

    def start(self, step: int, trained: int) -> None:
        """Generate step ``step``'s batch in the background, by the actor's weights now (``trained``
        updates)."""
        self.wait()
        self.generating.load_from(self.actor)

        def run() -> None:
            try:
                self.ready = self._make(step, trained, synced=True)
            except BaseException as exc:  # raised again in the trainer's thread (``wait``)
                self._error = exc

        self._thread = threading.Thread(target=run, name="rlctl-rollout-ahead", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """The batch in flight finished (what it raised raised here)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def drop(self) -> None:
        """Drop the batch in flight or ready (a rollback: sampled by weights it undoes), its prompts given
        back to the cursor."""
        self.wait()
        if self.ready is not None:
            self._give_back(self.ready)
            self.ready = None

    def take_dropped(self) -> int:
        n, self.dropped = self.dropped, 0
        return n

    def close(self) -> None:
        """Training is over: the batch in flight finished, what it raised ignored (the run ends anyway); the
        tool workers closed."""
        if self._thread is not None:
            self._thread.join()
            self._thread, self._error = None, None
        if self.pool is not None:
            self.pool.close()

    def _make(self, step: int, trained: int, synced: bool = False) -> Batch:
        if not synced:
            self.generating.load_from(self.actor)
        before = self.experience.data.state_dict()
        self.events.clear()
        seqs, scores, sampling = self.experience.rollout_batch(step)
        drawn, events = list(self.experience.drawn), list(self.events)
        return Batch(step, seqs, scores, sampling, drawn, trained, self.knobs(), before, events)

    def _give_back(self, batch: Batch) -> None:
        self.dropped += len(batch.seqs)
        self.experience.data.load_state_dict(batch.cursor_before)

    def state_dict(self) -> dict[str, Any]:
        self.wait()
        return {"version": self.VERSION, "ready": self.ready.state_dict() if self.ready is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The snapshot's batch; the one in flight (sampled by weights the restore replaces) discarded
        without touching the cursor, which the snapshot restores too."""
        check_version("rollout buffer", state, self.VERSION)
        self.wait()
        if self.ready is not None:
            self.dropped += len(self.ready.seqs)
        ready = state.get("ready")
        self.ready = Batch.from_state(ready, self.generating.runtime.device) if ready is not None else None


def rollout_ahead(host) -> RolloutAhead | None:
    """Under rollout.mode one_step_off (else None), the generator of the trainer ``host``'s rank: an HF
    rollout (``host.make_rollout``) over a copy of the actor's module, with its own tokenizer (the trainer's
    stays the main thread's) and, under multi_turn, its own pool of tool workers and the run's record and
    transcripts; it draws from the run's cursor and scores with the run's reward, as the trainer's
    experience does. Its events are gathered into each batch and emitted when the batch trains."""
    cfg = host.cfg
    if cfg.rollout.mode != "one_step_off":
        return None
    mt, e, events = cfg.rollout.multi_turn, host.experience, []
    pool = ToolPool(mt.tool_workers, mt.tool_timeout_s) if mt is not None else None
    own = copy.deepcopy(host.tokenizer)
    rollout = host.make_rollout("hf", GeneratingActor(host.actor), own, pool, events.append)
    ahead = Experience(cfg, e.data, rollout, e.reward_fn, e.pad_id, e.dist, tokenizer=own)
    return RolloutAhead(cfg, host.actor, ahead, lambda: sampling_knobs(cfg), events, pool)
