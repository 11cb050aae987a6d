"""The actor's default token budget per micro-batch on a GPU, from the device's free memory.

When a run sets neither ``actor.micro_batch_size`` nor ``actor.max_tokens_per_micro_batch``, a CUDA
actor cuts its micro-batches by a token budget (``rlctl.engine.microbatch``) sized here, after the engine
has placed its weights and optimizer state: half of what is free, less one chunk's fp32 temporaries of
the log-prob pass (``rlctl.algos.logprobs``), divided by what one token of a forward and backward holds:
its logits and their gradient (2 x V values of the model's dtype) and its activations (about 18 x
hidden values per layer without gradient checkpointing, Korthikanti et al.'s 34 bytes x hidden in 16-bit
with flash attention; the layer's input only with it). The budget is rounded down to a multiple of
``GRAIN`` so that a little more or less free memory at a resume gives the same cuts. On the CPU there
is no default: the whole share, as before.
"""

from __future__ import annotations

import torch

from rlctl.algos.logprobs import CHUNK_ELEMENTS

GRAIN = 256  # tokens: the budget is a multiple of this
FRACTION = 0.5  # of the free memory, the rest left to the allocator's fragmentation and the optimizer step
ACTIVATIONS_PER_LAYER = 18  # values of the model's dtype per token and hidden unit, without checkpointing
CHUNK_TEMPORARIES = 5  # fp32 (rows, positions, V) temporaries of a log-prob chunk's backward


def token_budget(
    free_bytes: int, *, vocab: int, hidden: int, layers: int, dtype_bytes: int, checkpointing: bool
) -> int:
    """Padded tokens one micro-batch may hold within ``FRACTION`` of ``free_bytes`` (a multiple of
    ``GRAIN``, at least ``GRAIN``)."""
    per_layer = hidden * (1 if checkpointing else ACTIVATIONS_PER_LAYER)
    per_token = (2 * vocab + layers * per_layer) * dtype_bytes
    usable = free_bytes * FRACTION - CHUNK_TEMPORARIES * CHUNK_ELEMENTS * 4
    return max(GRAIN, int(usable // per_token) // GRAIN * GRAIN)


def device_token_budget(device: torch.device, config, dtype: torch.dtype, checkpointing: bool) -> int | None:
    """``token_budget`` from a CUDA ``device``'s free memory now (``torch.cuda.mem_get_info``) and a
    transformers model ``config`` (vocab_size, hidden_size, num_hidden_layers); None on any other device."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return token_budget(
        free,
        vocab=config.vocab_size,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        dtype_bytes=torch.finfo(dtype).bits // 8,
        checkpointing=checkpointing,
    )
