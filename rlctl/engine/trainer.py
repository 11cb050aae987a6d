"""The RL loop: rollout, reward, advantages, log-probs, update, log. One readable step at a time."""

from __future__ import annotations

import math
import random
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import orjson
import torch

from rlctl import faults
from rlctl.stateful import check_version
from rlctl.checkpoint.rng import RNGState
from rlctl.checkpoint.snapshots import SnapshotManager
from rlctl.storage import Storage
from rlctl.config import RunConfig
from rlctl.engine import algos
from rlctl.engine.actor import Actor, Sequences, sequence_log_probs
from rlctl.engine.critic import Critic
from rlctl.engine.data import PromptCursor, load_rows
from rlctl.engine.dist import Dist
from rlctl.engine.model import hf_metadata_files, load_causal_lm, load_tokenizer, prepare_model_dir
from rlctl.engine.reward import load_reward_fn
from rlctl.engine.rollout import make_backend
from rlctl.engine.runtime import check_rollout_device, init_distributed, setup_runtime
from rlctl.policies import load_policies
from rlctl.policies.guard import PolicyGuard
from rlctl.errors import ConfigError, Halted, InputError, Preempted, SnapshotError
from rlctl.rundir.layout import CONFIG, METRICS, POLICY_STATE
from rlctl.metrics import JsonlLog, NullLog
from rlctl.rundir.history import abandon_rows_after

StepCallback = Callable[[dict[str, Any]], None]
EventCallback = Callable[[dict[str, Any]], None]


class TrainerState:
    """Counters of the run. Stateful."""

    VERSION = 1

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0
        self.prompts_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.VERSION, "step": self.step, "tokens_seen": self.tokens_seen,
                "prompts_seen": self.prompts_seen}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("trainer", state, self.VERSION)
        self.step, self.tokens_seen, self.prompts_seen = state["step"], state["tokens_seen"], state["prompts_seen"]


def is_healthy(row: dict[str, Any]) -> bool:
    """A step is good when every metric is finite and no non-finite value was counted anywhere. (The
    rollback policies refine this; a snapshot records the verdict.)"""
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if key.startswith("actor/nonfinite/") and value:
            return False
    return True


@contextmanager
def timed(timings: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    timings[f"timing_s/{name}"] = time.perf_counter() - start


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(
        self, cfg: RunConfig, run: Storage, *, snapshots: SnapshotManager | None = None,
        on_step: StepCallback | None = None, on_event: EventCallback | None = None,
    ):  # fmt: skip
        self.cfg, self.run, self.snapshots, self.on_step = cfg, run, snapshots, on_step
        self.emit = on_event or (lambda event: None)
        self.guard = PolicyGuard(load_policies(cfg.policies)) if cfg.policies else None
        if self.guard is not None and self.guard.rolls_back and (snapshots is None or not cfg.checkpoint.every):
            raise ConfigError(
                "a policy rolls back, but 'checkpoint.every' is 0: there would be no snapshot to roll back to"
            )
        self.runtime = setup_runtime(cfg.device, cfg.model.dtype, cfg.trainer.num_threads)
        check_rollout_device(self.runtime.kind, cfg.rollout.backend)
        seed_everything(cfg.seed)
        self.reward_fn = load_reward_fn(cfg.reward.function)
        self.data = PromptCursor(load_rows(cfg.data, cfg.seed), cfg.seed, cfg.data.shuffle)
        init_distributed(self.runtime.backend)
        self.dist = Dist(self.runtime.device)  # every rank runs this loop on its share of the prompts
        # rank 0 builds the built-in model into the run once; the others read it when it is complete
        if not self.dist.is_main:
            self.dist.barrier()
        self.model_dir = prepare_model_dir(cfg, run)
        if self.dist.is_main:
            self.dist.barrier()
        self.tokenizer = load_tokenizer(self.model_dir, cfg.model.trust_remote_code)
        if snapshots is not None:
            snapshots.barrier, snapshots.agree = self.dist.barrier, self.dist.all
        self.actor = Actor(cfg, self.model_dir, self.runtime)
        self.actor.agree, self.actor.total = self.dist.all, self.dist.sum
        if snapshots is not None:
            self.actor.fence = snapshots.wait_staged  # no optimizer step while a snapshot reads the weights
        self.ref = None
        if cfg.algorithm.kl_coef > 0:
            self.ensure_reference()
        self.critic = Critic(cfg, self.model_dir, self.runtime) if cfg.algorithm.name == "ppo" else None
        if self.critic is not None:
            self.critic.agree, self.critic.total = self.dist.all, self.dist.sum
        if snapshots is not None and self.critic is not None:
            self.critic.fence = snapshots.wait_staged
        self.rollout = make_backend(cfg.rollout.backend, cfg=cfg, actor=self.actor, tokenizer=self.tokenizer,
                                    model_dir=self.model_dir)
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algos.make_kl_controller(k.type, cfg.algorithm.kl_coef, k.target_kl, k.horizon)
        self.state = TrainerState()
        self.rng = RNGState()
        batch = cfg.trainer.prompts_per_step * cfg.algorithm.group_size
        # One epoch over one mini-batch is exactly on-policy: old log-probs come from the update's forward.
        self.on_policy = (cfg.algorithm.ppo_epochs == 1 and self.actor.mini_batch * self.dist.world == batch
                          and not cfg.algorithm.kl_in_reward)  # fmt: skip
        self.stop_signal: str | None = None
        self.metrics: JsonlLog | None = None
        self._hf_files = hf_metadata_files(self.model_dir)
        self._snapshotted = -1
        self._drawn: list[int] = []  # dataset indices of the prompts of the current step

    def ensure_reference(self) -> None:
        """The frozen reference model (the initial weights), loaded the first time a KL term needs it."""
        if self.ref is None:
            ref = load_causal_lm(self.model_dir, self.runtime.dtype, self.cfg.model.trust_remote_code)
            self.ref = ref.to(self.runtime.device).eval().requires_grad_(False)

    def apply_knobs(self) -> None:
        """Make the engine follow the config's knobs (after a restore, a resume --set or a policy's
        adjust): the config is where adjustments persist, the snapshot may predate them."""
        self.actor.set_lr(self.cfg.actor.lr)
        if self.cfg.algorithm.kl_ctrl.type == "fixed":  # an adaptive coefficient is state, restored as is
            self.kl_ctrl.value = self.cfg.algorithm.kl_coef
        if self.kl_ctrl.value > 0:
            self.ensure_reference()

    # -- state ---------------------------------------------------------------------------------------
    def stateful(self) -> dict[str, Any]:
        """Everything a snapshot restores besides the engine, by name."""
        states = {"trainer": self.state, "data": self.data, "kl_ctrl": self.kl_ctrl, "rng": self.rng}
        if self.guard is not None:
            states["policy"] = self.guard
        return states

    def dir_stateful(self) -> dict[str, Any]:
        """The engines, saved in their own checkpoint format."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def restore(self, info, rollback: bool = False) -> None:
        """Load a snapshot into every Stateful and the engine, then re-apply the config's knobs and
        re-sync the rollout weights. A rollback keeps the live policy state (its trigger counts must
        survive); a resume takes the newest policy state, RUN_DIR/policy_state.json, over the snapshot's."""
        states = self.stateful()
        if rollback:
            states.pop("policy", None)
        self.snapshots.restore(info, states, self.dir_stateful())
        if self.guard is not None:
            if not rollback and self.run.exists(POLICY_STATE):
                self.guard.load_state_dict(orjson.loads(self.run.read_bytes(POLICY_STATE)))
            self.guard.rewind(info.step)
            self.data.exclude = self.guard.skipped_prompts
        self._snapshotted = self.state.step
        self.apply_knobs()
        self.rollout.sync_weights()

    def snapshot(self, good: bool) -> None:
        if self.guard is not None and self.guard.max_steps_back:
            # retention keeps the snapshot a `steps_back` rollback would need
            horizon = self.state.step - self.guard.max_steps_back
            needed = [i.step for i in self.snapshots.scan() if i.good and i.step <= horizon]
            self.snapshots.retention.protected = set(needed[-1:])
        self.metrics.flush()  # the rows the snapshot claims are on storage before it commits (rank 0)
        self.snapshots.save(
            self.state.step, self.stateful(), self.dir_stateful(), good=good,
            extra_files={"config.yaml": self.cfg.to_yaml().encode(), **self._hf_files},
            meta={"metrics_offset": self.metrics.tell(), "tokens_seen": self.state.tokens_seen},
        )  # fmt: skip
        self._snapshotted = self.state.step

    def request_stop(self, reason: str) -> None:
        """Finish the current step, snapshot it, and stop (SIGTERM / SIGUSR1 land here)."""
        self.stop_signal = reason

    # -- the loop ------------------------------------------------------------------------------------
    def train(self) -> None:
        """Steps until total_steps; snapshots every `checkpoint.every` steps, at the end of a run that
        snapshots, and when a stop is requested (then raises Preempted once the snapshot is committed)."""
        total, every = self.cfg.trainer.total_steps, self.cfg.checkpoint.every
        self.metrics = self._metrics_log()
        healthy, passed = True, True  # the last step's metrics are finite; it passed the policies
        try:
            if self.guard is not None and self.guard.rolls_back and self._snapshotted < 0 and self.state.step == 0:
                self.snapshot(good=True)  # step 0: a policy always has somewhere to roll back to
            while self.state.step < total and not self._stopping():
                row = self.train_step(self.state.step + 1)
                verdict = self.guard.check(row["step"], row) if self.guard is not None else None
                self.metrics.write(row)
                if self.on_step is not None:
                    self.on_step(row)
                passed = verdict is None or verdict.good
                if verdict is not None and verdict.firings:
                    self.act_on(verdict)  # may halt, roll back, adjust, skip
                    if not passed:
                        continue  # a step that fails a policy is never snapshotted
                healthy = is_healthy(row)
                if self.snapshots is not None and every and self.state.step % every == 0:
                    self.snapshot(good=healthy)
                if (pause := faults.value("sleep", self.state.step)) is not None:
                    self._drill_sleep(float(pause or 1))
                if (rank := faults.value("crash", self.state.step)) is not None and int(rank or 0) == self.dist.rank:
                    raise RuntimeError(f"fault drill: rank {self.dist.rank} crashed after step {self.state.step}")
            self._stopping()  # a stop that came during the last step: every rank takes it, or none
            # the last step is snapshotted by a run that snapshots at all (or was restored from one)
            wanted = passed and (self.stop_signal is not None or every > 0 or self._snapshotted >= 0)
            if self.snapshots is not None and wanted and self.state.step > max(self._snapshotted, 0):
                self.snapshot(good=healthy)
            committed = self.snapshots.wait() if self.snapshots is not None else None
        finally:
            self.metrics.close()
        if self.stop_signal is not None:
            where = (f"snapshot of step {self.state.step} committed" if committed
                     else "no new snapshot was committed; the previous one stands")  # fmt: skip
            raise Preempted(f"stopped by {self.stop_signal} after step {self.state.step}; {where}. "
                            f"Resume with: rlctl resume {self.run.url} --from latest")  # fmt: skip

    def _metrics_log(self):
        return JsonlLog(self.run, METRICS) if self.dist.is_main else NullLog()

    def _stopping(self) -> bool:
        """A stop requested on any rank stops every rank after the same step."""
        stop = self.dist.any(self.stop_signal is not None)
        if stop and self.stop_signal is None:
            self.stop_signal = "a stop on another rank"
        return stop

    def _drill_sleep(self, seconds: float) -> None:
        """A fault drill's pause, cut short by a stop request (signal handlers do not end time.sleep)."""
        deadline = time.monotonic() + seconds
        while self.stop_signal is None and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- what the rollback policies ask for -----------------------------------------------------------
    def act_on(self, verdict) -> None:
        """Carry out a step's policy verdict: log every firing, then halt, or adjust, roll back and skip."""
        for firing in verdict.firings:
            self.emit(firing.as_event())
        if verdict.halt is not None:
            self._persist_policy_state()
            self._halt(verdict.halt)
        if verdict.skip_offending:
            self.guard.skipped_prompts |= set(self._drawn)
        if verdict.adjust:
            self._adjust(verdict)
        if verdict.rollback is not None:
            self._rollback(verdict)
        for _ in range(verdict.skip_batches):
            self.data.next_batch(self.cfg.trainer.prompts_per_step)
        self.data.exclude = self.guard.skipped_prompts
        if verdict.skip_offending or verdict.skip_batches:
            self.emit({"event": "skip", "step": verdict.step, "prompts": sorted(self._drawn) if verdict.skip_offending
                       else [], "batches": verdict.skip_batches})  # fmt: skip
        self._persist_policy_state()

    def _persist_policy_state(self) -> None:
        if self.dist.is_main:
            self.run.write_bytes(POLICY_STATE, orjson.dumps(self.guard.state_dict()))

    def _halt(self, firing) -> None:
        good = [i.step for i in self.snapshots.scan() if i.usable and i.good] if self.snapshots else []
        where = f"the last good snapshot is step {good[-1]}" if good else "there is no good snapshot"
        self.emit({"event": "halted", "step": firing.step, "rule": firing.rule, "last_good": good[-1] if good else None})
        raise Halted(
            f"policy rule '{firing.rule}' halted the run at step {firing.step} ({firing.trigger}); {where}. "
            f"After fixing the cause: rlctl resume {self.run.url} --from last-good"
        )

    def _adjust(self, verdict) -> None:
        changes = {}
        for key, op, value in verdict.adjust:
            section, name = key.split(".")
            model = getattr(self.cfg, section)
            before = getattr(model, name)
            setattr(model, name, value if op == "set" else before * value)
            changes[key] = {"from": before, "to": getattr(model, name)}
        if "algorithm.kl_coef" in changes:
            self.kl_ctrl.value = self.cfg.algorithm.kl_coef
        self.guard.adjustments.append({"step": verdict.step, "changes": changes})
        if self.dist.is_main:
            self.run.write_bytes(CONFIG, self.cfg.to_yaml().encode())  # adjustments persist across resumes
        self.apply_knobs()
        self.emit({"event": "adjust", "step": verdict.step, "changes": changes})

    def _rollback(self, verdict) -> None:
        action, step = verdict.rollback, verdict.step
        horizon = step - (action.min_steps_back or 0)
        self.snapshots.wait()  # rank 0's commit (and its retention) done before any rank looks
        self.dist.barrier()
        candidates = [i for i in reversed(self.snapshots.scan()) if i.usable and i.good and i.step <= horizon]
        for info in candidates:
            try:
                self.restore(info, rollback=True)
                break
            except SnapshotError as exc:
                self.emit({"event": "snapshot_unusable", "step": info.step, "error": exc.message})
        else:
            self._halt_no_target(verdict)
        tag = {"event": "rollback", "rule": verdict.rollback_rule, "from_step": step, "to_step": self.state.step,
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        self.metrics.close()
        moved, later = [], []
        if self.dist.is_main:
            moved = abandon_rows_after(self.run, self.state.step, tag)
            later = self.snapshots.abandon_after(self.state.step, tag["time"].replace(":", ""))
        self.dist.barrier()
        self.metrics = self._metrics_log()
        self.emit({**tag, "abandoned_metric_rows": moved, "abandoned_snapshots": later})

    def _halt_no_target(self, verdict) -> None:
        self.emit({"event": "halted", "step": verdict.step, "rule": verdict.rollback_rule, "last_good": None})
        raise Halted(
            f"policy rule '{verdict.rollback_rule}' asked for a rollback at step {verdict.step}, but no good "
            "snapshot is old enough to roll back to"
        )

    def train_step(self, step: int) -> dict[str, Any]:
        cfg, a, t = self.cfg, self.cfg.algorithm, {}
        with timed(t, "step"):
            with timed(t, "gen"):
                seqs, scores, sampling = self.rollout_batch(step)
            with timed(t, "old_log_prob"), torch.no_grad():
                old = None if self.on_policy else self.actor.log_probs(seqs, cfg.rollout.temperature)[0]
            drift = {}
            if seqs.rollout_log_probs is not None and old is not None:
                drift["rollout/logprob_diff"] = algos.masked_mean((old - seqs.rollout_log_probs).abs(), seqs.response_mask).item()
            with timed(t, "ref"), torch.no_grad():
                ref = None if self.ref is None else sequence_log_probs(self.ref, seqs, cfg.rollout.temperature)[0]
            with timed(t, "values"), torch.no_grad():
                values = self.critic.values(seqs) if self.critic is not None else None
            mask = seqs.response_mask
            rewards = algos.scores_to_token_rewards(scores, mask)  # (B, T): the score on the last token
            current_kl = None
            if a.kl_in_reward and ref is not None:
                rewards, current_kl = algos.apply_kl_penalty(rewards, old, ref, mask, self.kl_ctrl.value, a.kl_estimator)
            advantages, returns = algos.ADVANTAGES[a.estimator](algos.AdvantageInputs(
                token_rewards=rewards, mask=mask, group_size=a.group_size, values=values, gamma=a.gamma,
                lam=a.lam, eps=a.adv_eps,
            ))  # fmt: skip
            stats: dict[str, float] = {}
            if self.critic is not None:
                with timed(t, "update_critic"):
                    stats.update(self.critic.update(seqs, values, returns))
            if self.critic is None or step > cfg.critic.warmup_steps:
                with timed(t, "update_actor"):
                    drill = faults.once("nan_log_prob", step)  # (a value: only that rank's batch)
                    poison = drill is not None and (drill == "" or int(drill) == self.dist.rank)
                    stats.update(self.actor.update(seqs, advantages, old, ref, self.kl_ctrl.value, poison=poison,
                                                   rollout_log_prob=seqs.rollout_log_probs if old is None else None))  # fmt: skip
            kl_used = self.kl_ctrl.value
            if current_kl is not None:
                stats["actor/reward_kl_penalty"] = current_kl
            stats = self.dist.reduce_row(stats)  # every rank's KL controller sees the same measurement
            if ref is not None:
                measured = stats.get("actor/reward_kl_penalty", stats.get("actor/kl_loss"))
                if measured is not None and math.isfinite(measured):
                    self.kl_ctrl.update(measured, n_steps=len(seqs) * self.dist.world)
            if faults.value("stale_rollout") is None:
                self.rollout.sync_weights()
        tokens = int(seqs.attention_mask.sum())
        rest = {  # stats are reduced already
            **drift,
            **self.batch_metrics(seqs, scores, rewards, advantages, returns, values, old, ref),
            **sampling,
            "actor/kl_coef": kl_used,
            **t,
            "perf/tokens": float(tokens),
            "perf/throughput": tokens / t["timing_s/step"],
        }
        # identical on every rank: the policies decide the same everywhere
        row = {"step": step, "timestamp": round(time.time(), 3), **stats, **self.dist.reduce_row(rest)}
        self.state.step = step
        self.state.prompts_seen += cfg.trainer.prompts_per_step
        self.state.tokens_seen += int(row.pop("perf/tokens"))
        row["perf/tokens_seen"] = self.state.tokens_seen
        if (spec := faults.once("metric", step)) is not None:
            key, _, value = spec.rpartition(":")
            row[key] = float(value)
        return row

    def rollout_batch(self, step: int):
        """Generate and score one batch. With DAPO's dynamic sampling, groups whose rewards all tie (no
        signal) are dropped and more prompts are sampled, up to ``max_gen_batches`` rounds; the batch is
        then cut to ``prompts_per_step`` groups. The overlong penalty is added to the scores."""
        cfg, a = self.cfg, self.cfg.algorithm
        G, want = a.group_size, cfg.trainer.prompts_per_step // self.dist.world
        parts, part_scores, drawn, rounds = [], [], [], 0
        kept = 0
        filler: list[tuple[Sequences, torch.Tensor]] = []  # tied groups, to top up a short batch
        while True:
            keys, prompts, columns = self.draw_prompts()
            drawn += self._drawn
            seqs = self.rollout.generate(prompts, keys, step)  # seeds differ by prompt index
            scores = self.score(prompts, self.rollout.decode(seqs), columns)
            if a.overlong.enabled:
                lengths = seqs.response_mask.sum(-1)
                scores = scores + algos.overlong_penalty(
                    lengths, cfg.rollout.max_new_tokens, a.overlong.buffer_len, a.overlong.penalty_factor
                )
            rounds += 1
            if a.dynamic_sampling.enabled:
                live = ~algos.tied_groups(scores, G)
                rows = live.repeat_interleave(G)
                if live.any():
                    parts.append(seqs.select(rows))
                    part_scores.append(scores[rows])
                if (~live).any():
                    filler.append((seqs.select(~rows), scores[~rows]))
                kept += int(live.sum())
                # every rank draws the same prompts each round, so all stop after the same round
                if self.dist.all(kept >= want or rounds >= a.dynamic_sampling.max_gen_batches):
                    break
            else:
                parts, part_scores = [seqs], [scores]
                break
        self._drawn = drawn
        # Too few informative groups after the last round: top up with tied ones (zero advantage, no
        # gradient), so every step trains on a full batch and gradient accumulation stays aligned.
        for seqs_tied, scores_tied in filler:
            if kept >= want:
                break
            parts.append(seqs_tied)
            part_scores.append(scores_tied)
            kept += len(seqs_tied) // G
        seqs = Sequences.concat(parts, self.tokenizer.pad_token_id).select(slice(0, want * G))
        scores = torch.cat(part_scores)[: want * G]
        informative = int((~algos.tied_groups(scores, G)).sum()) if a.dynamic_sampling.enabled else 0
        sampling = ({"dynamic_sampling/rounds": rounds, "dynamic_sampling/kept_groups": informative}
                    if a.dynamic_sampling.enabled else {})  # fmt: skip
        return seqs, scores, sampling

    def draw_prompts(self) -> tuple[list[tuple[int, int]], list[str], dict[str, list]]:
        """Each drawn prompt repeated group_size times, with (prompt index, sample index) keys and the
        dataset's other columns aligned for the reward function."""
        g, key = self.cfg.algorithm.group_size, self.cfg.data.prompt_key
        rows = self.data.next_batch(self.cfg.trainer.prompts_per_step)
        self._drawn = [idx for idx, _ in rows]  # every rank draws the whole batch and keeps its share
        rows = rows[self.dist.shard(len(rows))]
        keys = [(idx, s) for idx, _ in rows for s in range(g)]
        expanded = [row for _, row in rows for _ in range(g)]
        columns = {c: [r.get(c) for r in expanded] for c in expanded[0] if c != key}
        return keys, [r[key] for r in expanded], columns

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> torch.Tensor:
        spec = self.cfg.reward.function
        try:
            scores = self.reward_fn(prompts, completions, **columns, **self.cfg.reward.kwargs)
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            raise InputError(
                f"reward function '{spec}' raised {type(exc).__name__}: {exc} "
                f"({frame.filename}:{frame.lineno})"
            ) from None
        if scores is None or len(scores) != len(completions):
            got = "None" if scores is None else f"{len(scores)} scores"
            raise InputError(f"reward function '{spec}' returned {got} for {len(completions)} completions")
        return torch.as_tensor([float(s) for s in scores], dtype=torch.float32)

    def batch_metrics(
        self, seqs: Sequences, scores: torch.Tensor, rewards: torch.Tensor, adv: torch.Tensor,
        returns: torch.Tensor, values: torch.Tensor | None, old: torch.Tensor | None, ref: torch.Tensor | None,
    ) -> dict[str, float]:  # fmt: skip
        """verl's batch metrics. (B,) scores; (B, T) token rewards, advantages, returns, values."""
        mask = seqs.response_mask
        lengths = mask.sum(-1).float()
        prompt_lengths = seqs.attention_mask[:, : seqs.prompt_len].sum(-1).float()
        real = mask.bool()
        out = {
            "critic/score/mean": scores.mean().item(),
            "critic/score/max": scores.max().item(),
            "critic/score/min": scores.min().item(),
            "critic/rewards/mean": rewards.sum(-1).mean().item(),
            "critic/advantages/mean": algos.masked_mean(adv, mask).item(),
            "critic/advantages/max": adv[real].max().item() if real.any() else 0.0,
            "critic/advantages/min": adv[real].min().item() if real.any() else 0.0,
            "critic/returns/mean": algos.masked_mean(returns, mask).item(),
            "response_length/mean": lengths.mean().item(),
            "response_length/max": lengths.max().item(),
            "response_length/min": lengths.min().item(),
            "response_length/clip_ratio": (lengths >= self.cfg.rollout.max_new_tokens).float().mean().item(),
            "prompt_length/mean": prompt_lengths.mean().item(),
            "actor/nonfinite/ref_log_prob": 0.0 if ref is None else algos.count_nonfinite(ref, mask),
        }
        if values is not None:
            out["critic/values/mean"] = algos.masked_mean(values, mask).item()
        if old is not None:  # else the update counted them on its own forward
            out["actor/nonfinite/old_log_prob"] = algos.count_nonfinite(old, mask)
        return out

