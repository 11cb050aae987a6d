"""Loading a DeepSpeed checkpoint written by another number of ranks: DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds one partition of the optimizer state (stage 3: of the weights too) per rank, and
DeepSpeed loads it only into the world size that wrote it. ``ds_to_universal`` (DeepSpeed's converter)
joins the partitions into one file per parameter and state (fp32 master weight, Adam's ``exp_avg`` and
``exp_avg_sq``) plus the optimizer's common state; the engine then loads that with universal loading
(``"checkpoint": {"load_universal": true}``), each rank taking its new partition. Joining and cutting are
copies: what loads is bit-identical to what was saved. Verified on DeepSpeed 0.19.8 for ZeRO 1, 2 and 3,
2 ranks onto 1 and 3 and back. A ZeRO-0 checkpoint (a world of one's) holds its whole optimizer in the
model states file: it loads into a stage-0 engine of any world size as it is, and into a ZeRO-1/2 engine
through ``rlctl.engine.stage0``.

Each rank converts the snapshot's engine directory (its local copy) into a temporary directory of its own,
loads from it and removes it: a rank on another node needs no shared disk.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import shutil
import sys
import tempfile

import torch

# a ZeRO optimizer partition: DeepSpeed's [bf16_]zero_pp_rank_N_mp_rank_MM_optim_states.pt
_OPTIM_PARTITION = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def saved_partitions(path: str) -> int | None:
    """How many ranks partitioned the ZeRO checkpoint directory ``path`` (None: no ZeRO partitions, a
    ZeRO-0 checkpoint, which any world size loads)."""
    ranks = {int(m.group(1)) for name in os.listdir(path) if (m := _OPTIM_PARTITION.match(name))}
    return len(ranks) or None


def to_universal(src: str, dst: str) -> None:
    """Convert the DeepSpeed checkpoint directory ``src`` (one tag's) into a universal checkpoint in ``dst``
    (DeepSpeed's ``ds_to_universal``, in this process; what it prints is kept back unless it fails)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=src,
        output_folder=dst,
        num_extract_workers=1,  # in this process: a rank may not fork a pool
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # rlctl's engines record no universal_checkpoint_info of their own
    )
    chatter = io.StringIO()  # its progress bars and lines: shown only when it fails
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    except BaseException:
        sys.stderr.write(chatter.getvalue())
        raise


@contextlib.contextmanager
def universal_loading(engine):
    """The engine loads universal checkpoints within the block (its config's ``load_universal``, which
    DeepSpeed reads only while loading), ordinary ones after it."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


@contextlib.contextmanager
def _quiet_deepspeed():
    """DeepSpeed's logger holds back its warnings within the block (a universal load warns that no model
    parallel unit was given, which rlctl never uses)."""
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_resharded(engine, path: str, *, strict: bool) -> None:
    """Load the DeepSpeed checkpoint directory ``path``, written by another number of ranks, into
    ``engine``: converted to a universal checkpoint in a temporary directory, loaded, removed. ``strict``:
    as ``load_module_strict``."""
    tmp = tempfile.mkdtemp(prefix="rlctl-universal-")
    try:
        tag = os.path.basename(path.rstrip("/"))
        to_universal(path, os.path.join(tmp, tag))
        with universal_loading(engine), _quiet_deepspeed():
            loaded, _ = engine.load_checkpoint(
                tmp, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True, load_module_strict=strict
            )
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the universal checkpoint made from {path}")
        _steps_beside_their_parameters(getattr(engine.optimizer, "optimizer", engine.optimizer))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _steps_beside_their_parameters(optimizer) -> None:
    """DeepSpeed's universal loader sets each parameter's optimizer ``step`` as it read it: a CPU tensor.
    A fused (rlctl's AdamW on CUDA) or capturable AdamW keeps it on its parameter's device and hands it to
    its kernel unchecked; torch's own ``load_state_dict`` moves it there, as this does. (The state's keys
    are the parameters: ZeRO-3 empties its groups' parameter lists between optimizer steps.)"""
    if not any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups):
        return
    for param, state in optimizer.state.items():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor) and isinstance(param, torch.Tensor) and step.device != param.device:
            state["step"] = step.to(device=param.device, dtype=torch.float32)
