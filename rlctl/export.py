"""Export a snapshot as a Hugging Face model directory (safetensors plus tokenizer).

The weights are consolidated in fp32 from the DeepSpeed files of any ZeRO stage with DeepSpeed's own
``zero_to_fp32`` reader (no engine, no process group), or at stage 0, which has no partitions to
consolidate (what a world of one writes, whatever stage its config names), from the model states file
(``stage0_fp32_state_dict``); the model's config and tokenizer come from the
snapshot's ``hf/`` copy, so the export needs nothing but the snapshot. Checksums are verified first.
A LoRA run's snapshot holds the adapter alone: its base weights come from the run's model directory
(``model.path``, or the built-in model in RUN_DIR/model), and the adapter is merged into them (a plain
Hugging Face model) or written as a PEFT adapter directory (``adapter_only``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from rlctl.checkpoint.catalog import SnapshotInfo
from rlctl.checkpoint.manifest import checksum_problem
from rlctl.errors import ConfigError, SnapshotError
from rlctl.rundir.directory import load_run_config
from rlctl.rundir.selection import select
from rlctl.rundir.snapshots import ACTOR_STAGE, snapshot_catalog
from rlctl.storage import Storage


def export_snapshot(
    run_dir: str,
    spec: str,
    out_dir: str,
    note: Callable[[str], None] | None = None,
    adapter_only: bool = False,
    timeout: float | None = None,
) -> SnapshotInfo:
    """Export the snapshot ``spec`` names (latest, last-good, best, step-N or N: the first usable
    candidate, each one skipped before it said to ``note``) to ``out_dir``, which must be new or empty.
    A LoRA run's snapshot is exported merged into its base (from the run's model directory), or with
    ``adapter_only`` as a PEFT adapter directory. ``timeout``: a read-only command's bound on storage
    that does not answer (``Storage.for_reading``). The snapshot exported."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"OUT_DIR {out_dir} is not empty; choose a new directory")
    run = Storage(run_dir) if timeout is None else Storage.for_reading(run_dir, timeout)
    cfg = load_run_config(run)
    lora = cfg.actor.lora.rank > 0
    if adapter_only and not lora:
        raise ConfigError(f"--adapter-only needs a LoRA run, but {run_dir} trains the full model (actor.lora.rank 0)")
    snapshots = snapshot_catalog(run, cfg)
    selection = select(snapshots, spec, "--step")
    info = selection.first()
    selection.skip(note or (lambda _: None), before=info)
    from rlctl.engine.runtime import quiet_libraries  # (the refusals above need none of the libraries)

    quiet_libraries()  # (imports DeepSpeed first, without MLflow)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoTokenizer

    from rlctl.engine.ds_module import stage0_fp32_state_dict

    local, cleanup = snapshots.storage.local_copy(info.name)
    try:
        problem = checksum_problem(local, info.manifest or {})
        if problem:
            raise SnapshotError(f"snapshot {info.name} is not usable: {problem}")
        hf = os.path.join(local, "hf")
        if (info.manifest or {}).get(ACTOR_STAGE) == 0:  # (a stage-2 run of one rank trains at stage 0)
            state = stage0_fp32_state_dict(os.path.join(local, "actor"))
        else:
            with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's reader prints progress to stdout
                state = get_fp32_state_dict_from_zero_checkpoint(local, tag="actor", exclude_frozen_parameters=lora)
        if lora:
            model = _lora_model(cfg, run, state, info.name)
            model = model if adapter_only else model.merge_and_unload()
        else:
            model = _full_model(cfg, hf, state, info.name)
        model.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(hf).save_pretrained(out)
    finally:
        cleanup()
    return info


def _full_model(cfg, hf: str, state: dict, name: str):
    """The causal LM of the snapshot's ``hf/`` config holding the snapshot's (fp32) weights ``state``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf, trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise SnapshotError(
            f"snapshot {name} does not fit its model config: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.tie_weights()
    return model


def _lora_model(cfg, run: Storage, state: dict, name: str):
    """The run's base model (fp32, from its model directory: a LoRA snapshot holds no base weights) with
    the run's adapter holding the snapshot's adapter weights ``state``: a peft model."""
    import torch

    from rlctl.engine.lora import apply_lora
    from rlctl.engine.model import load_causal_lm, prepare_model_dir
    from rlctl.rundir.handle import RunDir

    base = load_causal_lm(prepare_model_dir(cfg, RunDir(run)), torch.float32, cfg.model.trust_remote_code)
    model = apply_lora(base, cfg.actor.lora, cfg.seed)
    missing, unexpected = model.load_state_dict(state, strict=False)
    adapter_missing = [k for k in missing if ".lora_" in k]
    if unexpected or adapter_missing:
        raise SnapshotError(
            f"snapshot {name} does not fit the run's LoRA adapter (actor.lora): missing {sorted(adapter_missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    return model
