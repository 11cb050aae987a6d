"""The DeepSpeed plumbing the actor and the critic share: a model in a ZeRO engine with a torch AdamW
and a warm-up schedule (``DSModule``), what it is built from (``EngineSpec``, ``ds_config``), the
checkpoint engine that hands serialization to the snapshot manager's background writer, and what a
snapshot needs to know of DeepSpeed's files: which rank alone reads each one. (That their layout is
the ZeRO stage's is a fact of the run's snapshots: ``rlctl.rundir.snapshots.zero_topology``.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from rlctl.checkpoint.collectives import Collectives, Local
from rlctl.checkpoint.layout import files_of_rank as snapshot_files_of_rank
from rlctl.config import RunConfig
from rlctl.engine import microbatch
from rlctl.engine.batch import Sequences
from rlctl.engine.microbatch import MicroBatch
from rlctl.engine.runtime import Runtime

# a ZeRO partition of one rank: DeepSpeed's zero_pp_rank_N_* (the model states file is shared)
_ZERO_PARTITION = re.compile(r"^(?:.*/)?zero_pp_rank_(\d+)_[^/]*$")


def zero_file_rank(rel: str) -> int | None:
    """The rank that alone reads a file of a DeepSpeed checkpoint: its ZeRO partition's; None for a
    shared file. (A world of the snapshot's size loads only its own partition; another world size reads
    every rank's: ``rlctl.checkpoint.elastic``.)"""
    m = _ZERO_PARTITION.match(rel)
    return int(m.group(1)) if m else None


def files_of_rank(files, rank: int) -> list[str]:
    """The files of a snapshot of DeepSpeed modules that rank ``rank`` reads to restore."""
    return snapshot_files_of_rank(files, rank, zero_file_rank)


def _deferring_engine_class():
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class _Deferring(CheckpointEngine):
        """DeepSpeed's checkpoint I/O with serialization moved off the training thread.

        ``save`` hands the state dict to ``defer(path, state_dict)``; the snapshot writer (a process of
        its own, or a thread) serializes it into a file that hashes and fsyncs as it goes. Without
        ``defer`` (a plain ``save_checkpoint``) it saves at once. ``preserves_storage_sharing`` is
        False, so DeepSpeed does not clone every tensor first: nothing is copied in the training thread."""

        def __init__(self):
            super().__init__()
            self.name = "rlctl-deferring"
            self.defer = None

        def create(self, info) -> None:
            pass

        def save(self, state_dict, path: str) -> None:
            if self.defer is None:
                torch.save(state_dict, path)
            else:
                self.defer(path, state_dict)

        def load(self, path: str, map_location=None):
            return torch.load(path, map_location=map_location, weights_only=False)

        def commit(self, info) -> bool:
            return True

        def preserves_storage_sharing(self) -> bool:
            return False

    return _Deferring


def DeferringCheckpointEngine():  # noqa: N802 - a factory: DeepSpeed is imported lazily
    return _deferring_engine_class()()


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A sha256 of tensors' bytes by name (sorted): equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda nt: nt[0]):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rank_mini_batch(cfg: RunConfig) -> int:
    """Each rank's share of a mini-batch (the config's mini-batch counts sequences over all ranks)."""
    batch = cfg.trainer.prompts_per_step * cfg.algorithm.group_size
    return (cfg.actor.mini_batch_size or batch) // cfg.world_size


@dataclass(frozen=True)
class EngineSpec:
    """What a DeepSpeed engine of rlctl is built from (the actor's or the critic's settings)."""

    lr: float
    zero_stage: int
    grad_clip: float
    mini_batch: int
    micro_batch: int
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_tokens: int | None = None  # micro-batches by token budget (actor.max_tokens_per_micro_batch)
    section: str = "actor"  # the config section it comes from, for refusals


# fp16's dynamic loss scaling (DeepSpeed's defaults, spelt out): start at 2**16; halve on every overflow
# from the ``hysteresis``-th since the start or the last raise; double after ``loss_scale_window``
# optimizer steps without one; never below ``min_loss_scale`` (DeepSpeed raises an error rather than go
# under it). A step whose gradients overflow is skipped (no update, no scheduler step) and counted in the
# engine's ``skipped_steps``.
FP16_LOSS_SCALING = {
    "loss_scale": 0,  # 0: dynamic
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def ds_config(spec: EngineSpec, dtype: torch.dtype) -> dict:
    """DeepSpeed's config for an engine of ``spec`` training in ``dtype``: bf16 and fp16 keep fp32 master
    weights and optimizer state in the ZeRO optimizer (at stage 0, bf16's in DeepSpeed's unfused
    FP16_Optimizer wrapper, saved whole in the model states file); fp16 adds dynamic loss scaling, which
    needs a ZeRO optimizer (stage 0's wrapper has no hysteresis): refused at stage 0."""
    fp16 = dtype == torch.float16
    if fp16 and spec.zero_stage == 0:
        from rlctl.errors import ConfigError

        raise ConfigError(
            f"model.dtype fp16 needs {spec.section}.zero_stage 1, 2 or 3: at stage 0 DeepSpeed's fp16 "
            "optimizer scales the loss without the hysteresis rlctl's fp16 runs rely on; use bf16 or fp32"
        )
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.mini_batch // spec.micro_batch,
        "gradient_clipping": spec.grad_clip,
        "zero_optimization": {"stage": spec.zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": True, **FP16_LOSS_SCALING} if fp16 else {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _keep_clip_norm(engine) -> None:
    """Make ``engine`` (DeepSpeed without a ZeRO or fp16 optimizer: stage 0 in fp32) keep the gradient
    norm it clips, as the wrappers do, so that ``get_global_grad_norm`` reports it (DeepSpeed drops it)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip() -> None:
        norm = clip_grad_norm_(engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        engine._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip


def stage0_fp32_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The fp32 weights of a stage-0 DeepSpeed checkpoint directory ``path`` (one tag's), which has no
    ZeRO partitions for ``zero_to_fp32`` to read: the model states file's module state (what it saved:
    without frozen parameters when they were excluded), its trainable parameters replaced by the fp32
    master weights where an fp16/bf16 wrapper kept them (``fp32_groups``, in parameter order; a tied
    parameter counts once)."""
    ckpt = torch.load(os.path.join(path, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False)
    state = dict(ckpt["module"])
    groups = (ckpt.get("optimizer") or {}).get("fp32_groups")
    if groups:
        buffers = set(ckpt.get("buffer_names") or ())
        params = [k for k in state if k not in buffers]
        ptrs = list(dict.fromkeys(state[k].data_ptr() for k in params))  # a tied parameter once
        masters = [p for group in groups for p in group]
        first = {ptr: next(k for k in params if state[k].data_ptr() == ptr) for ptr in ptrs}
        if len(masters) != len(ptrs) or any(state[first[q]].shape != m.shape for q, m in zip(ptrs, masters)):
            raise RuntimeError(f"the fp32 master weights of {path} do not match its module's parameters")
        by_ptr = dict(zip(ptrs, masters))
        state.update({k: by_ptr[state[k].data_ptr()] for k in params})
    return {k: v.float() for k, v in state.items()}


class DSModule:
    """A model inside a DeepSpeed ZeRO engine with a torch AdamW (nothing to JIT-build) and a warm-up
    LambdaLR, whose checkpoints the snapshot manager writes in the background. The actor and the
    critic are both one."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: EngineSpec,
        runtime: Runtime,
        *,
        collectives: Collectives | None = None,
        fence: Callable[[], None] | None = None,
    ):
        """``collectives``: the ranks' (every rank applies a micro-batch or none does; token counts are
        summed over them); ``fence``: called before every optimizer step, it waits for snapshot files
        still being written from the live weights (``SnapshotManager.wait_staged``)."""
        import deepspeed

        self.spec, self.runtime = spec, runtime
        self.mini_batch, self.micro_batch = spec.mini_batch, spec.micro_batch
        fused = runtime.device.type in ("cpu", "cuda")  # (torch_npu's AdamW has no fused kernel)
        trainable = [p for p in model.parameters() if p.requires_grad]  # (LoRA: the adapter only)
        self.frozen = len(trainable) < len(list(model.parameters()))
        optimizer = torch.optim.AdamW(
            trainable, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay, fused=fused or None
        )
        warmup = spec.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0
        )
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model.to(runtime.device),
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=ds_config(spec, runtime.dtype),
        )
        if self.engine.optimizer is optimizer:  # stage 0 in fp32: no wrapper keeps the clipped norm
            _keep_clip_norm(self.engine)
        if self.engine.zero_optimization_stage() == 0 and self.engine.dp_world_size == 1:
            # a world of one: DeepSpeed's reduction after each backward is the identity (the grads copied
            # into one flat buffer, all-reduced over one rank, divided by 1, copied back: about 0.1 s of
            # a 25M model's step on one CPU thread), so it is not run; stages 1-3 keep theirs
            self.engine.enable_backward_allreduce = False
        self._ckpt_engine = DeferringCheckpointEngine()
        self.engine.checkpoint_engine = self._ckpt_engine
        self.collectives = collectives or Local()
        self.fence = fence

    def step(self, loss: torch.Tensor, pieces: float = 1.0) -> None:
        """Backward of one micro-batch's weighted loss and, after the last of its mini-batch, the
        optimizer step, behind the fence. The loss is divided by the micro-batches its weights count
        (``MicroBatch.pieces``: DeepSpeed's ``gradient_accumulation_steps`` when their number is fixed;
        1 for a mini-batch in one piece)."""
        self.engine.backward(loss / pieces, scale_wrt_gas=False)
        if self.fence is not None:
            self.fence()
        self.engine.step()

    def apply(self, loss: torch.Tensor, mb: MicroBatch) -> bool:
        """Backward and step on the micro-batch's (weighted) loss when it is finite on every rank (backward
        and step are collectives: every rank applies its micro-batch, or none does). Whether it was applied.
        A non-finite loss is never applied: its micro-batch adds no gradient. DeepSpeed still counts the
        micro-step, and after the mini-batch's last the optimizer steps on the others' gradients (none left
        over for the next mini-batch); a mini-batch of one micro-batch is dropped. ZeRO-1/2 reduce the
        accumulated gradients in the backward of the last micro-step (a step without one fails on them),
        so that one backpropagates an exact zero through the parameters instead."""
        if self.collectives.all(bool(torch.isfinite(loss))):
            self.step(loss, mb.pieces)
            return True
        if mb.count == 1:
            self.engine.zero_grad()
        elif mb.last and self.zero_stage < 3:  # ZeRO-1/2 reduce what accumulated in the last micro-step's backward
            self.step(sum(p.sum() for p in self.module.parameters() if p.requires_grad) * 0.0)
        else:
            self.engine.step()
        return False

    def minibatches(self, seqs: Sequences) -> Iterator[MicroBatch]:
        """The micro-batches of the rank's ``seqs``, mini-batch by mini-batch (``microbatch.plan``: by
        sequence count, or by token budget with ``EngineSpec.max_tokens``), each weighted so that the mean
        of the weighted per-micro-batch losses over micro-batches and ranks (what DeepSpeed's accumulation
        and data-parallel averaging compute) is the mini-batch's loss in one piece. Before each one the
        engine is told whether the optimizer steps after it: a token budget gives mini-batches different
        micro-batch counts, so the count is never DeepSpeed's fixed ``gradient_accumulation_steps``."""
        world = self.engine.dp_world_size
        plans = microbatch.plan(
            seqs,
            self.mini_batch,
            micro_batch=self.micro_batch,
            max_tokens=self.spec.max_tokens,
            world=world,
            total=self.collectives.sum,
            most=self.collectives.max,
        )
        for micro_batches in plans:
            for mb in micro_batches:
                self.engine.set_gradient_accumulation_boundary(mb.last)
                yield mb

    def in_pieces(self, seqs: Sequences, forward: Callable[[Sequences], torch.Tensor]) -> torch.Tensor:
        """``forward``'s (B, T) result over the rank's batch, computed micro-batch by micro-batch under a
        token budget (no-grad passes: log-probs, values), else in one piece as before."""
        if self.spec.max_tokens is None:
            return forward(seqs)
        out = torch.zeros(seqs.response_mask.shape, dtype=torch.float32, device=seqs.response_mask.device)
        for micro_batches in microbatch.plan(
            seqs,
            len(seqs),
            micro_batch=None,
            max_tokens=self.spec.max_tokens,
            world=1,
            total=lambda n: n,
            most=self.collectives.max,  # ZeRO-3 gathers parameters in every forward: equal counts
        ):
            for mb in micro_batches:
                out[mb.rows, : mb.response_to] = forward(mb.seqs(seqs)).float()
        return out

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def full_parameters(self) -> contextlib.AbstractContextManager:
        """Context in which every parameter is materialised (ZeRO-3 partitions them), e.g. for generate."""
        if self.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    # -- DirStateful: the engine's own checkpoint format, ZeRO-aware for every stage and rank ----------
    def save_to_dir(self, path: str, defer=None) -> None:
        """DeepSpeed's save_checkpoint, with each file's serialization handed to ``defer`` (the snapshot
        manager's background writer) when given. The files then read the live tensors, so the next
        optimizer step waits at ``fence`` until they are written: the only thing that changes saved
        state is ``engine.step()``."""
        parent, tag = os.path.split(path.rstrip("/"))
        self._ckpt_engine.defer = defer
        try:
            # frozen parameters (a LoRA base) come from the model directory at every start, not the snapshot
            self.engine.save_checkpoint(parent, tag=tag, save_latest=False, exclude_frozen_parameters=self.frozen)
        finally:
            self._ckpt_engine.defer = None

    def file_rank(self, rel: str) -> int | None:
        """The rank that alone reads a file of this module's checkpoint directory (None: every rank)."""
        return zero_file_rank(rel)

    def load_resharded(self, path: str, saved_world: int) -> None:
        """Load the engine's state from its checkpoint directory ``path``, written by ``saved_world`` ranks,
        into this world of another size (an elastic resume: ``rlctl.checkpoint.elastic``): its ZeRO
        partitions through DeepSpeed's universal checkpoint (``rlctl.engine.universal``: weights and
        optimizer state bit-identical); a ZeRO-0 checkpoint, which has none, as ``load_from_dir`` does."""
        from rlctl.engine.universal import load_resharded, saved_partitions

        if saved_partitions(path) is None:
            self.load_from_dir(path)
        else:
            load_resharded(self.engine, path, strict=not self.frozen)

    def load_from_dir(self, path: str) -> None:
        """Load the engine's state from its checkpoint directory ``path``: DeepSpeed's own load, or for a
        stage-0 checkpoint (no ZeRO partitions: a world of one's) into a ZeRO-1/2 engine,
        ``rlctl.engine.stage0``. A partitioned checkpoint does not load into a stage-0 engine."""
        from rlctl.engine.universal import saved_partitions

        partitioned = saved_partitions(path) is not None
        if not partitioned and self.zero_stage in (1, 2):
            from rlctl.engine.stage0 import load_stage0

            return load_stage0(self.engine, path, strict=not self.frozen)
        if partitioned and self.zero_stage == 0:
            raise RuntimeError(f"{path} was written by a ZeRO-partitioned engine; this engine trains at stage 0")
        parent, tag = os.path.split(path.rstrip("/"))
        loaded, _ = self.engine.load_checkpoint(
            parent,
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=not self.frozen,  # a snapshot without the frozen base
        )
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state from {path}")

    def set_lr(self, lr: float) -> None:
        """Change the base learning rate (warm-up and schedule still apply on top of it)."""
        sched = self.scheduler
        sched.base_lrs = [lr for _ in sched.base_lrs]
        factor = sched.lr_lambdas[0](sched.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * factor
        sched._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def set_grad_clip(self, clip: float) -> None:
        """Change the gradient-norm clip from the next optimizer step on. DeepSpeed 0.19 reads it from
        the engine's config (``gradient_clipping()``: the clip of a step without a ZeRO optimizer) and,
        under ZeRO 1/2/3, from the ZeRO optimizer's ``clip_grad`` (``unscale_and_clip_grads``), which a
        checkpoint load of stage 1/2 also overwrites with the saved one: set both, after every restore."""
        self.engine._config.gradient_clipping = clip
        if hasattr(self.engine.optimizer, "clip_grad"):
            self.engine.optimizer.clip_grad = clip

    def set_weight_decay(self, weight_decay: float) -> None:
        """Change AdamW's weight decay from the next optimizer step on (every parameter group)."""
        for group in self.optimizer.param_groups:
            group["weight_decay"] = weight_decay

    def set_knobs(self, lr: float, grad_clip: float, weight_decay: float | None = None) -> None:
        """The optimizer's knobs, as the run's config now says (``weight_decay`` None: leave it)."""
        self.set_lr(lr)
        self.set_grad_clip(grad_clip)
        if weight_decay is not None:
            self.set_weight_decay(weight_decay)

    def weights_sha256(self) -> str:
        """A hash of every parameter's bytes, by name: equal hashes mean bit-identical weights."""
        with self.full_parameters():
            return weights_digest(self.module.named_parameters())

    # -- fp16 loss scaling (model.dtype: fp16), for the update's metrics ----------------------------------
    def loss_scale(self) -> float:
        """DeepSpeed's current fp16 loss scale (the ZeRO optimizer's ``cur_scale``, the same on every rank);
        1.0 for an engine that does not scale its loss (fp32, bf16). A snapshot restores it: the ZeRO
        optimizer's checkpoint holds its loss scaler whole (scale, hysteresis, steps since an overflow)."""
        if not self.engine.fp16_enabled():
            return 1.0
        return float(self.engine.optimizer.cur_scale)

    def overflow_skipped(self) -> int:
        """Optimizer steps DeepSpeed has skipped since the run began because fp16 gradients overflowed
        (the engine's ``skipped_steps``, saved in and restored from its snapshots); 0 without fp16."""
        return int(self.engine.skipped_steps) if self.engine.fp16_enabled() else 0

    def step_overflowed(self) -> bool:
        """Whether the optimizer step just taken (at a mini-batch boundary) was skipped because fp16
        gradients overflowed: the loss scaler's routine business, not a fault, so its gradient norm (inf)
        is not reported. Never without fp16."""
        return self.engine.fp16_enabled() and not self.engine.was_step_applied()
