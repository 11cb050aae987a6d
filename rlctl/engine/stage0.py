"""Loading a ZeRO-0 checkpoint into a ZeRO-1/2 engine, of any world size.

A world of one trains at stage 0 (``rlctl.rundir.snapshots.trained_stage``): its checkpoint holds no ZeRO
partitions, only the model states file, with the whole optimizer in it (fp32: torch's AdamW state dict;
bf16: DeepSpeed's unfused wrapper, its fp32 master weights in ``fp32_groups`` and AdamW's state within).
DeepSpeed loads that file into a ZeRO-1/2 engine for everything but the optimizer (module weights, lr
scheduler, global_steps, skipped_steps, global_samples; the rest comes back as client state); the fp32
master weights and AdamW's moments and step are then set into each rank's partition through DeepSpeed's
tensor-fragment API (``safe_set_full_fp32_param``, ``safe_set_full_optimizer_state``), as its universal
loader does. Every value is copied: what loads is bit-identical to what was saved.
"""

from __future__ import annotations

import os

import torch


def load_stage0(engine, path: str, *, strict: bool) -> None:
    """Load the stage-0 DeepSpeed checkpoint directory ``path`` (one tag's) into ``engine``, a ZeRO-1/2
    engine of any world size. ``strict``: as ``load_module_strict`` (False: a snapshot without a LoRA run's
    frozen base)."""
    parent, tag = os.path.split(path.rstrip("/"))
    loaded, client = engine.load_checkpoint(
        parent, tag=tag, load_optimizer_states=False, load_lr_scheduler_states=True, load_module_strict=strict
    )  # (without optimizer states DeepSpeed reads no partition, and fills the masters from the module)
    if loaded is None:
        raise RuntimeError(f"DeepSpeed could not load the engine state from {path}")
    saved = (client or {}).get("optimizer")
    if saved is None:
        raise RuntimeError(f"{path} holds no optimizer state: not a stage-0 DeepSpeed checkpoint")
    set_optimizer_state(engine.optimizer, saved, path)


def set_optimizer_state(zero, saved: dict, path: str) -> None:
    """Set a stage-0 engine's optimizer state ``saved`` (torch's AdamW state dict, or DeepSpeed's unfused
    wrapper's holding it with the fp32 masters) into the ZeRO-1/2 optimizer ``zero``: each parameter group's
    fp32 masters (the module's own weights in fp32, where no wrapper kept them), AdamW's per-parameter
    tensors (``exp_avg``, ``exp_avg_sq``) and step, and the group's hyperparameters."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    inner = saved.get("optimizer_state_dict", saved)  # (bf16: the wrapper holds torch's state dict)
    masters = saved.get("fp32_groups")
    groups = zero.bit16_groups if hasattr(zero, "bit16_groups") else zero.bf16_groups  # (BF16_Optimizer: ZeRO-1)
    if len(inner["param_groups"]) != len(groups):
        raise RuntimeError(
            f"the optimizer of {path} has {len(inner['param_groups'])} parameter groups, not {len(groups)}"
        )
    for g, (group, saved_group) in enumerate(zip(zero.optimizer.param_groups, inner["param_groups"])):
        params, ids = groups[g], saved_group["params"]
        if len(ids) != len(params):
            raise RuntimeError(f"the optimizer of {path} has {len(ids)} parameters in group {g}, not {len(params)}")
        flat = group["params"][0]  # this rank's fp32 partition of the group
        states = [inner["state"].get(i, {}) for i in ids]
        if all(states):  # (none: the engine saved before its first optimizer step)
            zero.optimizer.state[flat] = _flat_state(flat, params[0], states, path)
            lazy_init_hp_params_optimizer_state(params, flat, zero.optimizer.state)
        for k, (param, state) in enumerate(zip(params, states)):
            safe_set_full_fp32_param(param, masters[g][k] if masters else param.detach().float())
            for key, value in state.items():
                if key != "step":
                    safe_set_full_optimizer_state(param, value, key)
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def _flat_state(flat: torch.Tensor, first: torch.Tensor, states: list[dict], path: str) -> dict:
    """The ZeRO partition ``flat``'s optimizer state for a group whose parameters' saved states are
    ``states`` (``first``: its first parameter): the step they share, zeros for each tensor they hold per
    parameter (set afterwards, fragment by fragment)."""
    steps = {float(s["step"]) for s in states}
    if len(steps) != 1:
        raise RuntimeError(f"the parameters of {path} were stepped {sorted(steps)} times: not one optimizer's steps")
    step = states[0]["step"]
    keys = [k for k, v in states[0].items() if k != "step" and torch.is_tensor(v) and v.shape == first.shape]
    return {
        "step": step.clone().to(flat.device) if torch.is_tensor(step) else step,  # (a fused AdamW: beside it)
        **{key: torch.zeros_like(flat) for key in keys},
    }
