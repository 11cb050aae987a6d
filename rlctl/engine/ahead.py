"""``rollout.mode: one_step_off`` and ``async``: the batches of the next steps are generated while a step
trains.

At the start of step N the trainer takes step N's batch (``take``), generated during an earlier step,
and starts the batches of the steps up to N+K (``fill``; K is 1 for one_step_off, rollout.max_staleness
for async): each takes a copy of the weights step N starts from, and a copy of the actor's module
generates them one after another in background threads (a core of their own; torch runs each thread's
ops on that thread), while the main thread trains step N on the actor. So a batch trains K updates after
the weights that sampled it (``rollout/staleness/mean``; fewer in the first K steps, which have no older
weights), and the result depends on nothing but the step: prompts are drawn from the run's cursor in
step order, seeds come from (seed, step, prompt, sample), the weights from the step the generation was
started at.

The batches in flight are part of the run's state (``Stateful``): a snapshot waits for them and holds
each one's tokens, masks, rollout log-probs, scores, generation metrics, the dataset indices it drew,
the weight version that sampled it and the cursor's state before it drew, so a resume trains exactly
the batches the uninterrupted run trained. Batches are dropped, their prompts given back to the cursor,
when one cannot be trained as sampled: a rollback restores the snapshot's batches instead (those in
flight were sampled by weights the rollback undoes), and a batch sampled with other sampling knobs than
its step's (a policy's ``adjust``, a schedule) or holding a prompt a policy skipped is made again,
synchronously, with the current weights, with every batch after it (drawn after it). No prompt is
trained twice or skipped by a drop. Under rollout.multi_turn the
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
from rlctl.stateful import check_version

STALENESS_REDUCTIONS = {"rollout/staleness/mean": MEAN, "rollout/staleness/max": MAX}
SEQ_FIELDS = ("input_ids", "attention_mask", "response_mask", "rollout_log_probs", "turn_rewards")


def sampling_knobs(cfg: RunConfig) -> dict[str, Any]:
    """What a batch was sampled with, beyond the weights and the seeds."""
    r = cfg.rollout
    return {
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "min_p": r.min_p,
        "max_new_tokens": r.max_new_tokens,
    }


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
    the actor trains (its weights copied from the actor by ``load_from``).

    Under ZeRO-3 the actor's module holds only this rank's shards, and DeepSpeed's hooks on it gather them
    for every forward (a collective): the copy is a plain model of the actor's class instead, built from
    its config, whose weights are the actor's gathered ones (merged under LoRA, as the vLLM backend gets
    them). It holds every weight on every rank, as a gathered generate does while it runs."""

    def __init__(self, actor) -> None:
        self.runtime, self.partitioned = actor.runtime, actor.zero_stage == 3
        self.module = plain_model(actor) if self.partitioned else copy.deepcopy(actor.module)
        self.module.requires_grad_(False)

    def weights_of(self, actor) -> list[torch.Tensor]:
        """The actor's weights in the copy's order (under ZeRO-3, call inside ``actor.full_parameters``:
        clone what outlives it)."""
        if not self.partitioned:
            return [p.detach() for p in actor.module.parameters()]
        named = dict(actor.merged_weights())
        return [named[name] for name, _ in self.module.named_parameters()]

    def kept(self, actor) -> list[torch.Tensor]:
        """The actor's weights now, copied: loaded once the generator is free."""
        with torch.no_grad(), actor.full_parameters():
            return [w.clone() for w in self.weights_of(actor)]

    def load_from(self, actor) -> None:
        with actor.full_parameters():
            self.load(self.weights_of(actor))

    def load(self, weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.module.parameters(), weights, strict=True):
                mine.copy_(theirs)

    def full_parameters(self):
        import contextlib

        return contextlib.nullcontext()


class EngineWeights:
    """The generator of an overlapped vllm rollout: the rank's engine, which holds weights of its own (the
    actor's, pushed in by ``reload_weights``), so no copy of the module is made. The trainer's rollout and
    this one share the engine; only one of them generates at a time (the trainer waits for the batches in
    flight before it validates or restores)."""

    def __init__(self, engine, actor) -> None:
        self.engine, self.runtime = engine, actor.runtime

    def kept(self, actor) -> list[tuple[str, torch.Tensor]]:
        with torch.no_grad(), actor.full_parameters():
            return [(name, w.clone()) for name, w in actor.merged_weights()]

    def load_from(self, actor) -> None:
        self.engine.sync_weights()

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(weights)


class RolloutAhead:
    """Batches generated ahead, one after another in background threads (see the module): ``ahead`` of
    them at most (1: one_step_off; async: rollout.max_staleness). Stateful (version 2, a list of batches;
    version 1, one batch or none, still loads)."""

    VERSION = 2

    def __init__(
        self,
        cfg: RunConfig,
        actor,
        experience: Experience,
        knobs: Callable[[], dict[str, Any]],
        events: list[dict[str, Any]] | None = None,
        pool=None,
        ahead: int = 1,
        generating: GeneratingActor | EngineWeights | None = None,
    ):
        """``experience``: draws, generates and scores with a rollout over a ``GeneratingActor`` of
        ``actor`` (its cursor the run's); ``knobs``: the sampling knobs of the step about to run;
        ``events``: where its rollout emits (gathered into each batch); ``pool``: its tool workers
        (multi-turn; closed by ``close``); ``ahead``: how many steps ahead it generates; ``generating``:
        what holds the generator's weights (the rollout's actor unless given)."""
        self.cfg, self.actor, self.experience, self.knobs = cfg, actor, experience, knobs
        self.events, self.pool, self.ahead = events if events is not None else [], pool, ahead
        self.generating = generating if generating is not None else experience.rollout.actor
        self.ready: dict[int, Batch] = {}  # step -> its batch, made
        self._threads: dict[int, threading.Thread] = {}  # step -> the thread making its batch
        self._scheduled = 0  # the last step whose batch is made or being made
        self._error: BaseException | None = None
        self.dropped = 0  # trajectories dropped since the last ``take_dropped``

    def take(self, step: int, trained: int, skipped: frozenset[int] | set[int]) -> tuple[Batch, dict[str, float]]:
        """Step ``step``'s batch, and its staleness metrics: the one made ahead when it can be trained as
        sampled, else one made now by the current weights (``trained``: updates so far), every batch made
        after it dropped too (their prompts were drawn after its)."""
        self.wait(step)
        batch = self.ready.pop(step, None)
        if batch is not None and (batch.knobs != self.knobs() or set(batch.drawn) & set(skipped)):
            self.ready[step] = batch
            batch = None
        if batch is None:
            self._drop_all()
            batch = self._make(step, trained)
            self._scheduled = max(self._scheduled, step)
        stale = float(trained - batch.version)
        return batch, {"rollout/staleness/mean": stale, "rollout/staleness/max": stale}

    def fill(self, step: int, trained: int, total: int) -> None:
        """Start the batches of the steps after ``step`` up to ``ahead`` of it (not past ``total``), each
        by the actor's weights now (``trained`` updates), one after another in the background."""
        for later in range(max(self._scheduled, step) + 1, min(step + self.ahead, total) + 1):
            self._start(later, trained)
            self._scheduled = later

    def _start(self, step: int, trained: int) -> None:
        """Step ``step``'s batch made in a thread of its own, by the weights of now: copied straight into
        the generator when it is idle (one_step_off), else kept aside until the batch before is made."""
        before = self._threads.get(max(self._threads)) if self._threads else None
        weights = None
        if before is None or not before.is_alive():
            self.generating.load_from(self.actor)
        else:
            weights = self.generating.kept(self.actor)

        def run() -> None:
            try:
                if before is not None:
                    before.join()
                if self._error is None:
                    if weights is not None:
                        self.generating.load(weights)
                    self.ready[step] = self._make(step, trained, synced=True)
            except BaseException as exc:  # raised again in the trainer's thread (``wait``)
                self._error = exc

        thread = self._threads[step] = threading.Thread(target=run, name=f"rlctl-rollout-{step}", daemon=True)
        thread.start()

    def wait(self, step: int | None = None) -> None:
        """The batches in flight up to ``step`` (all: None) finished (what one raised raised here)."""
        for s in sorted(self._threads):
            if step is None or s <= step:
                self._threads.pop(s).join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _drop_all(self) -> None:
        """Drop every batch made or in flight, their prompts given back to the cursor (from the first's)."""
        self.wait()
        if self.ready:
            batches = sorted(self.ready.values(), key=lambda b: b.step)
            self.dropped += sum(len(b.seqs) for b in batches)
            self.experience.data.load_state_dict(batches[0].cursor_before)
            self.ready.clear()
        self._scheduled = 0

    def take_dropped(self) -> int:
        n, self.dropped = self.dropped, 0
        return n

    def close(self) -> None:
        """Training is over: the batches in flight finished, what they raised ignored (the run ends anyway);
        the tool workers closed."""
        for thread in self._threads.values():
            thread.join()
        self._threads.clear()
        self._error = None
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

    def state_dict(self) -> dict[str, Any]:
        self.wait()
        return {"version": self.VERSION, "ready": [self.ready[s].state_dict() for s in sorted(self.ready)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The snapshot's batches; those in flight (sampled by weights the restore replaces) discarded
        without touching the cursor, which the snapshot restores too."""
        if state.get("version") != 1:
            check_version("rollout buffer", state, self.VERSION)
        self.wait()
        self.dropped += sum(len(b.seqs) for b in self.ready.values())
        kept = state.get("ready")
        kept = [kept] if isinstance(kept, dict) else kept or []  # version 1: one batch or None
        device = self.generating.runtime.device
        self.ready = {b.step: b for b in (Batch.from_state(k, device) for k in kept)}
        self._scheduled = max(self.ready, default=0)


def plain_model(actor) -> torch.nn.Module:
    """A model of the actor's (base) class from its config, on its device and in its dtype, in eval mode;
    its weights are set by ``GeneratingActor.load``. Built by the class itself, not ``from_config``, which
    would partition it under ZeRO-3 as the actor's was."""
    base = actor.module.get_base_model() if actor.has_lora else actor.module
    module = type(base)(copy.deepcopy(base.config))
    module.generation_config = copy.deepcopy(base.generation_config)  # (its eos ids: the loaded model's)
    return module.to(device=actor.runtime.device, dtype=actor.runtime.dtype).eval()


def rollout_ahead(host) -> RolloutAhead | None:
    """Under rollout.mode one_step_off or async (else None), the generator of the trainer ``host``'s rank:
    a rollout (``host.rollouts``) over a copy of the actor's module (hf) or over the rank's vLLM engine,
    shared with the trainer's rollout (vllm), with its own tokenizer (the trainer's stays the main
    thread's) and, under multi_turn, its own pool of tool workers and the run's record and trajectories;
    it draws from the run's cursor and scores with the run's reward, as the trainer's experience does.
    Its events are gathered into each batch and emitted when the batch trains."""
    cfg = host.cfg
    if cfg.rollout.mode == "sync":
        return None
    e, events = host.experience, []
    pool = host.rollouts.new_pool()
    own = copy.deepcopy(host.tokenizer)
    if cfg.rollout.backend == "vllm":
        engine = getattr(host.rollout, "engine", host.rollout)  # (multi-turn: the engine it samples with)
        generating = EngineWeights(engine, host.actor)
        rollout = host.rollouts.make("vllm", host.actor, own, pool, events.append, engine=engine.beside(own))
    else:
        generating = GeneratingActor(host.actor)
        rollout = host.rollouts.make("hf", generating, own, pool, events.append)
    # dynamic sampling's rounds agree across the ranks: over a process group of the generator's own
    dist = e.dist.own_group() if cfg.algorithm.dynamic_sampling.enabled else e.dist
    ahead = Experience(cfg, e.data, rollout, e.reward_fn, e.pad_id, dist, tokenizer=own)
    steps = 1 if cfg.rollout.mode == "one_step_off" else cfg.rollout.max_staleness
    return RolloutAhead(cfg, host.actor, ahead, lambda: sampling_knobs(cfg), events, pool, steps, generating)
