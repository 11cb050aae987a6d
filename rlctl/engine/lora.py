"""LoRA through peft, and gradient checkpointing: what the actor, the reference, the rollout backends and
the export need to know of an adapter on a frozen causal LM.

``apply_lora`` wraps the model in a peft ``PeftModel`` (task CAUSAL_LM) whose adapter is initialised from
the run's seed alone, so every rank and every resume builds the same one before a snapshot overwrites
it. The base weights stay frozen (``requires_grad`` False): the optimizer and the snapshots hold the
adapter only, and the base weights come from the model directory at every start. ``merged_weights`` gives
the weights a plain model would have (base + B @ A * alpha / r per targeted linear) under the base
model's parameter names: what vLLM is given, what ``weights_sha256`` hashes, what ``rlctl export`` writes.
``AdapterDisabled`` is the reference policy: the actor's own module with its adapter switched off.
"""

from __future__ import annotations

import contextlib

import torch

from rlctl.config.algorithm import LoraSettings
from rlctl.errors import ConfigError

ADAPTER = "default"  # peft's name for the one adapter
_PEFT_PREFIX = "base_model.model."


def apply_lora(model: torch.nn.Module, lora: LoraSettings, seed: int) -> torch.nn.Module:
    """``model`` (a causal LM) wrapped in a peft model with a fresh adapter of ``lora``, initialised
    from ``seed`` alone (the global RNG is left as it was). A module name of ``target_modules`` that
    matches no module of the model is a ConfigError naming ``actor.lora.target_modules``."""
    from peft import LoraConfig, TaskType, get_peft_model

    check_targets(model, lora.target_modules)
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def check_targets(model: torch.nn.Module, targets: str | list[str]) -> None:
    """Every name of ``targets`` names a module of ``model`` (peft's rule: the full name, or its last
    dotted parts); "all-linear" always does."""
    if isinstance(targets, str):
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(
            f"'actor.lora.target_modules' names {', '.join(map(repr, missing))}, which matches no module of the "
            f"model; its linear modules are {', '.join(leaves)}"
        )


def enable_gradient_checkpointing(model: torch.nn.Module, key: str) -> None:
    """Recompute each decoder layer's activations in the backward pass, through the model's own support
    (non-reentrant checkpointing, which needs no input that requires grad, so a frozen embedding under
    LoRA is fine). transformers checkpoints only a module in training mode: see ``training``. ``key``: the
    config key that asked for it, for the error of a model without that support."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"'{key}' is on, but {type(model).__name__} does not support it")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def training(module: torch.nn.Module, on: bool = True):
    """``module`` in training mode meanwhile (when ``on``), then back in the mode it was in. rlctl's
    models have no dropout by default (and LoRA's is 0 unless set), so the mode changes nothing but
    whether transformers checkpoints the layers."""
    was = module.training
    if on:
        module.train()
    try:
        yield
    finally:
        module.train(was)


def base_name(peft_name: str) -> str:
    """The base model's name of a parameter of the peft model: ``base_model.model.X.base_layer.weight``
    -> ``X.weight``."""
    name = peft_name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def merged_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of a plain model equal to the peft ``model`` with its adapter merged
    (base + the adapter's delta, peft's own ``get_delta_weight``), under the base model's names; untargeted
    weights are the live tensors themselves (nothing copied). Under ZeRO-3, call with the parameters gathered."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            deltas[f"{name}.base_layer.weight"] = module.get_delta_weight(ADAPTER)
    out = []
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        w = p.detach()
        if name in deltas:
            w = w + deltas[name].to(w.dtype)
        out.append((base_name(name), w))
    return out


class AdapterDisabled:
    """The reference policy of a LoRA run: the actor's own module called with its adapter disabled
    (peft's ``disable_adapter``), i.e. the frozen base: no second copy of the weights. Called as a model
    (keyword arguments of a causal LM's forward)."""

    def __init__(self, engine: torch.nn.Module, peft_model: torch.nn.Module):
        self.engine, self.peft_model = engine, peft_model

    def __call__(self, **kwargs):
        with self.peft_model.disable_adapter():
            return self.engine(**kwargs)
