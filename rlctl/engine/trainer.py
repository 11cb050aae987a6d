"""The trainer: wiring, the Stateful set, ``train()`` and its ``train_step``.

A step's phases (``rlctl.engine.step``): generate and score a batch (``experience``), the forward passes
the update needs (old, reference log-probs, values), advantages, the critic's and the actor's updates,
the KL controller, the rollout weights re-synced, then the step's metric row, identical on every rank.
Here: what is built, restored and snapshotted, the loop, and the judgement of each row. Policy verdicts are
carried out by ``recovery``, which also restores a resume; the snapshot manager says when to snapshot
and what retention keeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from contextlib import contextmanager
from typing import Any

import torch

from rlctl import algos, faults
from rlctl import events as names
from rlctl.checkpoint.rng import RNGState
from rlctl.checkpoint.snapshots import SnapshotManager
from rlctl.config import RunConfig
from rlctl.config.knob_values import follow_schedules, knob_settings, may_exceed
from rlctl.engine.actor import Actor
from rlctl.engine.ahead import rollout_ahead
from rlctl.engine.counters import TrainerState
from rlctl.engine.critic import Critic
from rlctl.engine.data import PromptCursor, load_prompts
from rlctl.engine.dist import MAX
from rlctl.engine.experience import Experience
from rlctl.engine.model import hf_metadata_files, load_causal_lm, load_tokenizer, prepare_model_dir_once
from rlctl.engine.recovery import Recovery
from rlctl.engine.reward.sources import load_reward
from rlctl.engine.rollouts import Rollouts
from rlctl.engine.runtime import RankContext
from rlctl.engine.step import TrainStep
from rlctl.engine.validation import Validator
from rlctl.errors import ConfigError, Preempted, StorageError
from rlctl.metrics import JsonlLog, NullLog, row_is_finite
from rlctl.policies.guard import PolicyGuard
from rlctl.rundir.handle import ResumePlan, RunDir, ZeroStages, trained_stages


def faulted(row: dict[str, Any]) -> dict[str, Any]:
    """The ``metric`` fault drills: the row of their step with each metric they name replaced."""
    while (spec := faults.once("metric", row["step"])) is not None:
        key, _, value = spec.rpartition(":")
        row[key] = float(value)
    return row


StepCallback = Callable[[dict[str, Any]], None]
EventCallback = Callable[[dict[str, Any]], None]


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        run: RunDir,
        rank: RankContext,
        *,
        snapshots: SnapshotManager | None = None,
        guard: PolicyGuard | None = None,
        on_step: StepCallback | None = None,
        on_event: EventCallback | None = None,
        fence: Callable[[], None] | None = None,
        stages: ZeroStages | None = None,
    ):
        """``rank``: this process as a rank of the run (``open_rank``); ``snapshots``: built with its
        collectives; ``guard``: the run's policies, built once for the rank; ``fence`` (the lease's check):
        called before every metrics row; ``stages``: the engines' ZeRO stages (None: a fresh start's)."""
        self.cfg, self.run, self.snapshots, self.on_step, self.fence = cfg, run, snapshots, on_step, fence
        self.emit = on_event or (lambda event: None)
        fired = faults.fired_in(run.events()) if cfg.faults else ()  # (the log read for drills only)
        faults.configure(cfg.faults, fired, self.emit)  # once in the run
        self.guard = guard
        if self.guard is not None and self.guard.rolls_back and (snapshots is None or not cfg.checkpoint.every):
            raise ConfigError(
                "a policy rolls back, but 'checkpoint.every' is 0: there would be no snapshot to roll back to"
            )
        self.runtime, self.dist = rank.runtime, rank.dist  # every rank runs this loop on its share of the prompts
        if snapshots is not None and cfg.checkpoint.every:
            snapshots.start_writer()  # its start-up overlaps loading the models, not the first snapshot
        faults.while_building()
        reward_fn = load_reward(cfg.reward, device=self.runtime.device)
        self.model_dir = prepare_model_dir_once(cfg, run, self.dist)
        self.tokenizer = load_tokenizer(self.model_dir, cfg.model.trust_remote_code)
        self.rollouts = Rollouts(cfg, run, self.dist.rank, self.dist.world, self.model_dir)
        tools = self.rollouts.tools
        schemas = list(tools.schemas.values()) if tools is not None else None  # prompts render them
        prompts = load_prompts(cfg, self.tokenizer, schemas)  # filtered before the cursor numbers the rows
        prompts.announce(self.emit, self.dist.is_main)
        self.data = PromptCursor(prompts.train, cfg.seed, cfg.data.shuffle)
        self._build_models(stages or trained_stages(cfg, self.runtime.dtype == torch.float16))
        self.experience = Experience(
            cfg, self.data, self.rollout, reward_fn, self.tokenizer.pad_token_id, self.dist, tokenizer=self.tokenizer
        )
        self.validator = Validator(cfg, prompts.val, self.rollout, reward_fn, self.dist) if prompts.val else None
        self.ahead = rollout_ahead(self)  # rollout.mode one_step_off, else None
        self.recovery, self.steps = Recovery(self), TrainStep(self)  # (what carries out verdicts; a step's phases)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algos.make_kl_controller(k.type, cfg.algorithm.kl_coef, k.target_kl, k.horizon)
        self.state = TrainerState(token_budget=self.actor.token_budget)
        self.rng = RNGState()
        batch = cfg.trainer.prompts_per_step * cfg.algorithm.group_size
        # One epoch over one mini-batch is exactly on-policy: old log-probs come from the update's forward.
        self.on_policy = (
            cfg.algorithm.ppo_epochs == 1
            and self.actor.mini_batch * self.dist.world == batch
            and not cfg.algorithm.kl_in_reward
        )
        self.stop_signal: str | None = None
        self.metrics: JsonlLog | None = None
        self._hf_files = hf_metadata_files(self.model_dir)
        self._snapshotted = -1

    @property
    def shared_engine(self) -> bool:
        """Whether the rank's vllm engine also generates ahead, between the updates: its weights are then
        loaded as each batch starts (``engine.ahead``), not pushed after every update."""
        return self.ahead is not None and self.cfg.rollout.backend == "vllm"

    def _build_models(self, stages: ZeroStages) -> None:
        """The actor, the reference (when a KL term needs it), the critic (PPO) and the rollout backend, the
        engines at the ZeRO ``stages``. No optimizer step while a snapshot still reads the weights: the
        modules wait at its fence."""
        cfg, fence = self.cfg, self.snapshots.wait_staged if self.snapshots is not None else None
        at = {"collectives": self.dist, "fence": fence}
        self.actor = Actor(cfg, self.model_dir, self.runtime, **at, zero_stage=stages.actor)
        self.ref = None
        if may_exceed(cfg, "algorithm.kl_coef", 0.0):  # a warm-up from 0: loaded before it rises
            self.ensure_reference()
        self.critic = (
            Critic(cfg, self.model_dir, self.runtime, **at, zero_stage=stages.critic)
            if cfg.algorithm.name == "ppo"
            else None
        )
        r = self.rollouts
        self.rollout = r.make(cfg.rollout.backend, self.actor, self.tokenizer, r.pool, self.emit)

    def ensure_reference(self) -> None:
        """The frozen reference model (the initial weights), loaded the first time a KL term needs it; under
        LoRA the actor itself with its adapter disabled (the frozen base), nothing loaded."""
        if self.ref is None and self.actor.has_lora:
            self.ref = self.actor.reference()
        elif self.ref is None:
            ref = load_causal_lm(self.model_dir, self.runtime.dtype, self.cfg.model.trust_remote_code)
            self.ref = ref.to(self.runtime.device).eval().requires_grad_(False)

    def apply_knobs(self) -> None:
        """Make the engine follow every knob of the config (``rlctl.policies.knobs``) from the next step
        on (after a restore, a resume --set, a policy's adjust or a schedule): the config is where
        adjustments persist, the snapshot may predate them. The optimizers' lr, weight decay and
        gradient clip are set; the KL controllers' coefficient (fixed; an adaptive one's is state,
        restored as is) and target; the rest (clip ratios, entropy coefficient, value clip range,
        temperature) are read from the config where they are used."""
        cfg = self.cfg
        self.actor.set_knobs(lr=cfg.actor.lr, grad_clip=cfg.actor.grad_clip, weight_decay=cfg.actor.weight_decay)
        if self.critic is not None:
            self.critic.set_knobs(lr=cfg.critic.lr, grad_clip=cfg.critic.grad_clip)
        if cfg.algorithm.kl_ctrl.type == "fixed":
            self.kl_ctrl.value = cfg.algorithm.kl_coef
        else:
            self.kl_ctrl.target_kl = cfg.algorithm.kl_ctrl.target_kl
        if self.kl_ctrl.value > 0:
            self.ensure_reference()

    def follow_schedules(self, step: int) -> None:
        """Set every scheduled knob to its value at ``step`` and make the engine follow (before the step
        generates, so that its row shows the values it used); RUN_DIR/config.yaml shows the new values."""
        if self.cfg.schedules:
            if follow_schedules(self.cfg, step) and self.dist.is_main:
                self.run.write_config(self.cfg)
            self.apply_knobs()

    # -- state ---------------------------------------------------------------------------------------
    def stateful(self) -> dict[str, Any]:
        """Everything a snapshot restores besides the engine, by name."""
        states = {"trainer": self.state, "data": self.data, "kl_ctrl": self.kl_ctrl, "rng": self.rng}
        if self.guard is not None:
            states["policy"] = self.guard
        return {**states, "rollout_ahead": self.ahead} if self.ahead is not None else states

    def dir_stateful(self) -> dict[str, Any]:
        """The engines, saved in their own checkpoint format."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def restore(self, info, rollback: bool = False, keep_knobs: Collection[str] = ()) -> None:
        """Load a snapshot into every Stateful and the engine, then re-apply the config's knobs and
        re-sync the rollout weights. A rollback keeps the live policy state (its trigger counts must
        survive) and rewinds its history to the snapshot's step, and keeps the live knobs; a resume takes
        the snapshot's policy state, or the counts of a later rollback or halt, and the knobs that state
        records, except ``keep_knobs`` (those resume --set changed: ``Recovery.carry_policy_state``)."""
        if self.ahead is not None:  # no batch in flight draws from the cursor once it is restored
            self.ahead.wait()
        states = self.stateful()
        if rollback:
            states.pop("policy", None)
        self.snapshots.restore(info, states, self.dir_stateful())
        if self.guard is not None:
            if rollback:
                self.guard.rewind(info.step)
            else:
                self.recovery.carry_policy_state(info.step, keep_knobs)
            self.data.exclude = self.guard.skipped_prompts
        self._snapshotted = self.state.step
        self.actor.keep_token_budget(self.state.token_budget)
        self.apply_knobs()
        self.rollout.sync_weights()

    def resume(self, plan: ResumePlan, note: Callable[[str], None]) -> None:
        """Continue the run as ``plan`` says: restore its first snapshot that loads (none planned: start
        over), the knobs resume --set changed taking their new values, and turn away from the steps
        after it (``Recovery.resume``; ``note``: what a fallback to an older snapshot is said to)."""
        self.recovery.resume(plan, note)

    def snapshot(self, good: bool) -> None:
        self.metrics.flush()  # the rows the snapshot claims are on storage before it commits (rank 0)
        if self.guard is not None:
            self.guard.knobs = knob_settings(self.cfg)  # a resume from this snapshot takes these knobs
        if self.ahead is not None:  # the batches in flight drawn whole (dynamic sampling draws as it goes)
            self.ahead.wait()  # before the cursor and the RNG are read
        self.snapshots.save(
            self.state.step,
            self.stateful(),
            self.dir_stateful(),
            good=good,
            extra_files={**self.run.files_in_snapshot(self.cfg), **self._hf_files},
            meta={
                "metrics_offset": self.metrics.tell(),
                "tokens_seen": self.state.tokens_seen,
                **({"val": self.state.last_val} if self.state.last_val is not None else {}),
            },
        )
        self._snapshotted = self.state.step

    def request_stop(self, reason: str) -> None:
        """Finish the current step, snapshot it, and stop (SIGTERM / SIGUSR1, tools down past the budget)."""
        self.stop_signal = reason

    # -- the loop ------------------------------------------------------------------------------------
    def train(self) -> None:
        """Steps until total_steps; snapshots when the manager's schedule says, at the end of a run that
        snapshots, and when a stop is requested (then raises Preempted, saying whether that snapshot
        was committed). A run whose final snapshot was not committed raises StorageError: it is not
        complete, and a resume continues it."""
        total, self.metrics = self.cfg.trainer.total_steps, self._metrics_log()
        healthy, passed = True, True  # the last step's metrics are finite; it passed the policies
        try:
            fresh = self._snapshotted < 0 and self.state.step == 0
            if fresh and self.validator is not None and self.cfg.trainer.val_before_train:
                self._judge(self.validate({"step": 0, "timestamp": round(time.time(), 3)}))
            if self.guard is not None and self.guard.rolls_back and fresh:
                self.snapshot(good=True)  # step 0: a policy always has somewhere to roll back to
            while self.state.step < total and not self._stopping():
                row = self.train_step(self.state.step + 1)
                if self.validator is not None and self.validator.due(row["step"]):
                    row = self.validate(row)
                passed = self._judge(faulted(row))
                self._count_tool_outage(row)
                if passed:  # a step that fails a policy is never snapshotted
                    healthy = row_is_finite(row)
                    if self.snapshots is not None and self.snapshots.should_save(self.state.step):
                        self.snapshot(good=healthy)
                self._after_step(row["step"])
            self._finish(passed, healthy)
        finally:
            self.metrics.close()
            if self.ahead is not None:
                self.ahead.close()
            self.rollouts.close()
        if self.stop_signal is not None:
            raise Preempted(
                f"stopped by {self.stop_signal} after step {self.state.step}; {self._stop_outcome()}. "
                f"Resume with: rlctl resume {self.run.url} --from latest"
            )
        self._check_final_commit()

    def _count_tool_outage(self, row: dict[str, Any]) -> None:
        """rollout.multi_turn.tool_retry_budget: past it, the run stops after this step as a preemption
        (its snapshot committed, exit 75). The row is reduced: every rank decides alike."""
        budget = self.rollouts.budget
        if budget is not None and budget.stops(row, self.cfg.trainer.total_steps, self.emit):
            self.request_stop(names.TOOLS_UNAVAILABLE)

    def _after_step(self, step: int) -> None:
        """The drills of step ``step`` that act after it, whatever its verdict (a rollback may have taken
        the run back to an earlier step meanwhile)."""
        settle = self.snapshots.settle if self.snapshots is not None else None
        faults.after_step(step, self.dist.rank, lambda: self.stop_signal is not None, settle)

    def validate(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` with the validation of the current weights added (and its time); the trainer's state
        remembers it for the snapshots' manifests."""
        t0 = time.perf_counter()
        if self.ahead is not None:  # the reward function's recording is the generator's meanwhile
            self.ahead.wait()
        if self.shared_engine:  # it holds the weights the last batch started with: the current ones
            self.rollout.sync_weights()
        metrics = self.validator.run()
        self.state.last_val = {"step": row["step"], "metrics": metrics}
        took = self.dist.reduce_row({"timing_s/validation": time.perf_counter() - t0}, {"timing_s/validation": MAX})
        return {**row, **metrics, **took}

    def _stop_outcome(self) -> str:
        if self.snapshots is None:
            return "this run takes no snapshots; a resume starts over"
        return self.snapshots.outcome(self.state.step)

    def _judge(self, row: dict[str, Any]) -> bool:
        """Log the step's row, let the policies judge it and carry out their verdict; whether it passed."""
        verdict = self.guard.check(row["step"], row) if self.guard is not None else None
        self.metrics.write(row)
        if self.on_step is not None:
            self.on_step(row)
        if verdict is not None and verdict.firings:
            self.recovery.act_on(verdict, self.experience.drawn)  # may halt, roll back, adjust, skip
        return verdict is None or verdict.good

    def _finish(self, passed: bool, healthy: bool) -> None:
        """The last step is snapshotted by a run that snapshots at all (or was restored from one), and
        that snapshot finished. On a stop, snapshots failing over and over still end in Preempted: the
        previous snapshot is where a resume continues."""
        self._stopping()  # a stop that came during the last step: every rank takes it, or none
        if self.snapshots is None:
            return
        at_end = self.stop_signal is None  # the run's last state is committed even after a failed step (not good)
        wanted = (passed or at_end) and (not at_end or self.snapshots.every > 0 or self._snapshotted >= 0)
        try:
            if wanted and self.state.step > max(self._snapshotted, 0):
                self.snapshot(good=healthy and passed)
            self.snapshots.wait()
        except StorageError:
            if self.stop_signal is None:
                raise

    def _check_final_commit(self) -> None:
        """Raise StorageError on every rank when rank 0 could not commit the snapshot of the last step."""
        s, step = self.snapshots, self.state.step
        failed = s is not None and self._snapshotted == step and s.failed(step)
        if self.dist.any(failed):
            raise StorageError(f"the run is not complete: {s.outcome(step)}. Resume with: rlctl resume {self.run.url}")

    def _metrics_log(self):
        return self.run.metrics_log(self.fence) if self.dist.is_main else NullLog()

    @contextmanager
    def metrics_closed(self):
        """The metrics log closed meanwhile (rank 0 rewrites it when the run turns away), then reopened;
        nothing to close before training (a resume turns away before it)."""
        if self.metrics is None:
            yield
            return
        self.metrics.close()
        yield
        self.metrics = self._metrics_log()

    def _stopping(self) -> bool:
        """A stop requested on any rank stops every rank after the same step."""
        stop = self.dist.any(self.stop_signal is not None)
        if stop and self.stop_signal is None:
            self.stop_signal = "a stop on another rank"
        return stop

    # -- one step --------------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, Any]:
        """One step's phases (``rlctl.engine.step``), its row returned and the counters advanced."""
        return self.steps.run(step)
