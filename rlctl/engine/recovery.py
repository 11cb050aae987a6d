"""Carrying out a step's policy verdict: log every firing, then halt, or adjust knobs, roll back to a
good snapshot and skip prompts or batches; and a resume's restore.

A rollback and a resume are one turn (``Recovery.turn_to``): restore the first of the candidates
``rlctl.rundir.selection`` chose that loads (a rollback: the newest usable good snapshot old enough, or
the best), then turn the run away from the later steps (``rlctl.rundir.history``): their metric rows
and snapshots move aside, tagged.

The policy state outlives a turn: a rollback keeps the live trigger counts (so ``max_triggers`` runs
out), and so does a resume after a rollback or a halt. For that, every rollback and every halt writes
the policy state to RUN_DIR/policy_state.json with the step it belongs to (the step rolled back to, or
the halted one). A resume restores the snapshot's own policy state, which holds every firing up to its
step; it takes the file instead only when the file is of that very step (a rollback to it, then a
kill before the next snapshot), and carries the file's counts back to it when the file is of a later
step (a resume from before a halt or a rollback), as a rollback would. Firings that turn nothing are
not written: a resume replays their steps and they fire again. The policy state carries the knob
settings too (refreshed from the config before every snapshot and every write of the file), and a
resume sets the config's knobs from it (except those ``resume --set`` changes): an adjustment that no
snapshot recorded is not applied twice. A rollback keeps the live knobs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import orjson

from rlctl import events
from rlctl.checkpoint.catalog import SnapshotInfo
from rlctl.checkpoint.snapshots import SnapshotManager
from rlctl.config import RunConfig
from rlctl.config.knob_values import adjust_knob, apply_knob_settings, get_knob, knob_settings
from rlctl.engine.data import PromptCursor
from rlctl.engine.dist import Dist
from rlctl.errors import Halted, SnapshotError, StorageError
from rlctl.policies.guard import PolicyGuard
from rlctl.rundir.handle import ResumePlan, RunDir, rollback_candidates, turn_tag


class Host(Protocol):
    """What recovery needs of the trainer it acts on."""

    cfg: RunConfig
    run: RunDir
    guard: PolicyGuard
    snapshots: SnapshotManager | None
    dist: Dist
    data: PromptCursor
    kl_ctrl: Any
    actor: Any  # .weights_sha256(): what an elastic resume loaded
    state: Any  # .step: where the restore left the run
    emit: Callable[[dict[str, Any]], None]

    def restore(self, info: SnapshotInfo, rollback: bool = False, keep_knobs: Collection[str] = ()) -> None: ...

    def apply_knobs(self) -> None: ...

    def metrics_closed(self) -> AbstractContextManager: ...


class Recovery:
    def __init__(self, host: Host):
        self.host = host

    def act_on(self, verdict, drawn: list[int]) -> None:
        """Carry out a step's policy verdict: log every firing, then halt, or roll back, adjust and skip
        (the rollback first: the restore would undo an adjustment of the state it loads, an adaptive KL
        controller's coefficient). ``drawn``: the dataset indices of the step's prompts (what
        ``skip_offending`` skips)."""
        h = self.host
        for firing in verdict.firings:
            h.emit(firing.as_event())
        if verdict.halt is not None:
            self.persist_policy_state()
            self.halt(verdict.halt)
        if verdict.skip_offending:
            h.guard.skipped_prompts |= set(drawn)
        if verdict.rollback is not None:
            self.rollback(verdict)
        if verdict.adjust:
            self.adjust(verdict)
        for _ in range(verdict.skip_batches):
            h.data.next_batch(h.cfg.trainer.prompts_per_step)
        h.data.exclude = h.guard.skipped_prompts
        if verdict.skip_offending or verdict.skip_batches:
            h.emit(
                {
                    "event": events.SKIP,
                    "step": verdict.step,
                    "prompts": sorted(drawn) if verdict.skip_offending else [],
                    "batches": verdict.skip_batches,
                }
            )
        if verdict.rollback is not None:
            self.persist_policy_state()

    def persist_policy_state(self) -> None:
        """Write the policy state, as of the trainer's step and with the config's knobs, to
        RUN_DIR/policy_state.json (rank 0)."""
        h = self.host
        h.guard.knobs = knob_settings(h.cfg)
        if h.dist.is_main:
            h.run.write_policy_state(h.state.step, h.guard.state_dict())

    def carry_policy_state(self, step: int, keep_knobs: Collection[str] = ()) -> None:
        """After a resume restored the snapshot of ``step`` (and its policy state): take the state of
        RUN_DIR/policy_state.json when it is of ``step``; when it is of a later step, take its counts
        and rewind its history to ``step`` (then write it as of ``step``); when it is older, keep the
        snapshot's. A file that cannot be read is a warning, and the snapshot's state stays. Then the
        config's knobs follow the state's settings, except ``keep_knobs`` (changed by resume --set)."""
        h = self.host
        saved = self._read_policy_state()
        at, own = -1, h.guard.state_dict()
        if saved is not None and saved[0] >= step:
            at, state = saved
            try:
                h.guard.load_state_dict(state)
            except (ValueError, LookupError, TypeError, AttributeError) as exc:
                h.guard.load_state_dict(own)
                self._ignore_policy_state(f"it does not fit this run's policies ({exc})")
                at = -1
        self._take_knobs(keep_knobs)
        if at > step:
            h.guard.rewind(step)
            self.persist_policy_state()

    def _take_knobs(self, keep: Collection[str]) -> None:
        """Set the config's knobs from the policy state's settings (none recorded: the config's stand);
        settings that do not fit the config are a warning, and the config's stand."""
        h = self.host
        if h.guard.knobs is None:
            return
        try:
            apply_knob_settings(h.cfg, h.guard.knobs, keep)
        except (ValueError, TypeError) as exc:
            reason = f"its knob settings do not fit this run ({exc}); the config's knobs stand"
            h.emit({"event": events.POLICY_STATE_IGNORED, "reason": reason})
            if h.dist.is_main:
                print(f"warning: policy state: {reason}", file=sys.stderr)

    def _read_policy_state(self) -> tuple[int, dict[str, Any]] | None:
        """(the step it belongs to, the policy state) from RUN_DIR/policy_state.json; None when there is
        none or it cannot be read (said)."""
        raw = self.host.run.read_policy_state()
        if raw is None:
            return None
        try:
            saved = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return self._ignore_policy_state("it is not valid JSON")
        if not isinstance(saved, dict):
            return self._ignore_policy_state("it is not a JSON object")
        at = saved.pop("step", None)
        if not isinstance(at, int) or isinstance(at, bool):
            return self._ignore_policy_state(f"it names no step it belongs to (step: {at!r})")
        return at, saved

    def _ignore_policy_state(self, reason: str) -> None:
        h = self.host
        url = h.run.policy_state_url
        h.emit({"event": events.POLICY_STATE_IGNORED, "file": url, "reason": reason})
        if h.dist.is_main:
            print(f"warning: ignoring {url}: {reason}; the snapshot's policy state is used", file=sys.stderr)

    def halt(self, firing) -> None:
        h = self.host
        if h.snapshots is not None:
            with contextlib.suppress(StorageError):  # (failed snapshots were reported; the halt says more)
                h.snapshots.wait()  # the snapshot in flight is committed, or not, before the last good is named
        good = [i.step for i in h.snapshots.catalog.scan() if i.usable and i.good] if h.snapshots else []
        where = f"the last good snapshot is step {good[-1]}" if good else "there is no good snapshot"
        h.emit(
            {"event": events.HALTED, "step": firing.step, "rule": firing.rule, "last_good": good[-1] if good else None}
        )
        raise Halted(
            f"policy rule '{firing.rule}' halted the run at step {firing.step} ({firing.trigger}); {where}. "
            f"After fixing the cause: rlctl resume {h.run.url} --from last-good"
        )

    def adjust(self, verdict) -> None:
        """Change knobs as the verdict's adjustments say, in order (``rlctl.config.knob_values.adjust_knob``: a
        scheduled knob's schedule composes them; a value outside the knob's legal domain is held at the
        nearest legal one, and the event says so). The run's config records them (they persist across
        rollbacks and resumes) and the engine follows them at once. An adaptive controller's KL
        coefficient is adjusted from its current value."""
        h = self.host
        changes: dict[str, dict[str, Any]] = {}
        for adj in verdict.adjust:
            before = self._knob_now(adj.key)
            after, note = adjust_knob(h.cfg, adj.key, before, adj.op, adj.value, adj.min, adj.max, verdict.step)
            if adj.key == "algorithm.kl_coef":
                h.kl_ctrl.value = after
            first = changes.get(adj.key, {}).get("from", before)
            changes[adj.key] = {"from": first, "to": after, **({"held": note} if note else {})}
        h.guard.adjustments.append({"step": verdict.step, "changes": changes})
        if h.dist.is_main:
            h.run.write_config(h.cfg)
        h.apply_knobs()
        h.emit({"event": events.ADJUST, "step": verdict.step, "changes": changes})

    def _knob_now(self, key: str) -> float | None:
        """A knob's value now: the config's, or an adaptive controller's current KL coefficient."""
        h = self.host
        if key == "algorithm.kl_coef" and h.cfg.algorithm.kl_ctrl.type != "fixed":
            return h.kl_ctrl.value
        return get_knob(h.cfg, key)

    def rollback(self, verdict) -> None:
        """Restore the snapshot the verdict asks for (halting when there is none), then turn the run away
        from the steps after it."""
        h, step = self.host, verdict.step
        h.snapshots.wait()  # rank 0's commit (and its retention) done before any rank looks
        h.dist.barrier()
        back = verdict.rollback.min_steps_back or 0
        candidates = rollback_candidates(h.snapshots.catalog, step, back, verdict.rollback_best)

        def unusable(info: SnapshotInfo, exc: SnapshotError) -> None:
            h.emit({"event": events.SNAPSHOT_UNUSABLE, "step": info.step, "error": exc.message})

        def tag_of(to_step: int) -> dict[str, Any]:
            return turn_tag(events.ROLLBACK, rule=verdict.rollback_rule, from_step=step, to_step=to_step)

        info, tag, moved = self.turn_to(candidates, tag_of, unusable, rollback=True)
        if info is None:
            self.halt_no_target(verdict)
        ahead = getattr(h, "ahead", None)  # rollout.mode one_step_off: the batch in flight, sampled by undone weights
        dropped = {"dropped_trajectories": ahead.take_dropped()} if ahead is not None else {}
        h.emit({**tag, **moved, **dropped})

    def resume(self, plan: ResumePlan, note: Callable[[str], None]) -> None:
        """Restore the first snapshot of ``plan`` that loads (with the knobs its policy state records, but
        the ones resume --set changed; none planned: the run starts over), make the engine follow the
        changed knobs, and turn the run away from the steps after the snapshot; rank 0 then records the
        config (its knobs now the restored ones) and the resume. ``note``: what a fallback to an older
        snapshot is said to."""
        h = self.host
        infos = plan.snapshots(h.snapshots.catalog)

        def unusable(info: SnapshotInfo, exc: SnapshotError) -> None:
            if len(infos) == 1:
                raise exc
            note(f"warning: {exc.message}; trying an older snapshot")

        def tag_of(step: int) -> dict[str, Any]:
            return turn_tag(events.RESUME, from_step=step)

        if infos:
            info, _, moved = self.turn_to(infos, tag_of, unusable, keep_knobs=set(plan.changes))
            if info is None:
                raise SnapshotError(
                    f"no usable snapshot in {h.snapshots.storage.url}: every candidate failed its checks"
                )
        else:  # the run never trained: it starts over, and keeps no row (not even a validation before training)
            info, moved = None, self.turn_away(-1, tag_of(0))
        self._take_changes(plan.changes)
        step = info.step if info is not None else 0
        resharded = self._resharded(info)
        if h.dist.is_main:
            h.run.write_config(h.cfg)  # only once the restore has succeeded
            h.emit(
                {
                    "event": events.RESUME,
                    "from": plan.wanted,
                    "step": step,
                    "replays_exactly": not plan.changes and not h.run.policy_acted_after(step),
                    "snapshot": info.name if info else None,
                    "location": h.snapshots.storage.url_of(info.name) if info else None,
                    "changes": plan.changes,
                    **resharded,
                    **moved,
                }
            )

    def _resharded(self, info: SnapshotInfo | None) -> dict[str, Any]:
        """For a resume from a snapshot of another world size (an elastic one), the fields of its event:
        the ranks before and now, and the hash of the weights loaded (every rank computes it: a collective
        under ZeRO-3), which equals the snapshot's; nothing otherwise."""
        h = self.host
        saved = (info.manifest or {}).get("world_size") if info is not None else None
        if saved is None or saved == h.dist.world:
            return {}
        return {"ranks": {"from": saved, "to": h.dist.world}, "weights_sha256": h.actor.weights_sha256()}

    def _take_changes(self, changes: dict[str, Any]) -> None:
        """The knobs resume --set changed keep their new values (the restore kept them); the KL
        coefficient also where an adaptive controller restored its own: the user said so."""
        h = self.host
        if "algorithm.kl_coef" in changes:
            h.kl_ctrl.value = h.cfg.algorithm.kl_coef
            h.apply_knobs()

    def turn_to(
        self,
        candidates: Sequence[SnapshotInfo],
        tag_of: Callable[[int], dict[str, Any]],
        unusable: Callable[[SnapshotInfo, SnapshotError], None],
        *,
        rollback: bool = False,
        keep_knobs: Collection[str] = (),
    ) -> tuple[SnapshotInfo | None, dict[str, Any], dict[str, Any]]:
        """Restore the first of ``candidates`` that loads (``Trainer.restore``: a rollback's keeps the live
        policy state and knobs, a resume's takes the snapshot's but ``keep_knobs``); each one that does
        not goes to ``unusable`` with its error (which may raise). Then turn the run away from the steps
        after the one restored, tagged ``tag_of(its step)``. The snapshot restored (None: none loaded,
        and nothing turned), the tag, and what moved."""
        for info in candidates:
            try:
                self.host.restore(info, rollback=rollback, keep_knobs=keep_knobs)
            except SnapshotError as exc:
                unusable(info, exc)
                continue
            tag = tag_of(info.step)
            return info, tag, self.turn_away(info.step, tag)
        return None, {}, {}

    def turn_away(self, step: int, tag: dict[str, Any]) -> dict[str, Any]:
        """Once every rank has restored, rank 0 moves the metric rows and snapshots of the steps after
        ``step`` aside, tagged ``tag`` (``rlctl.rundir.history``), its metrics log closed meanwhile, while
        the other ranks wait. What moved: the fields of the event that reports the turn."""
        h = self.host
        moved: dict[str, Any] = {"abandoned_metric_rows": [], "abandoned_snapshots": []}
        h.dist.barrier()
        with h.metrics_closed():
            if h.dist.is_main:
                moved = h.run.turn_away_after(h.snapshots, step, tag)
            h.dist.barrier()
        return moved

    def halt_no_target(self, verdict) -> None:
        self.host.emit({"event": events.HALTED, "step": verdict.step, "rule": verdict.rollback_rule, "last_good": None})
        raise Halted(
            f"policy rule '{verdict.rollback_rule}' asked for a rollback at step {verdict.step}, but no good "
            "snapshot is old enough to roll back to"
        )
