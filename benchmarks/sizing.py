"""The estimated sizing table of docs/gpu.md: the update's memory per rank for Qwen2.5 models in bf16 with
AdamW, by the formula that page states (nothing is measured here; no GPU is needed).

    python3 benchmarks/sizing.py

Weights, gradients and optimizer: 20 bytes per parameter (bf16 weights 2 and gradients 2; DeepSpeed's fp32
gradients 4, fp32 masters 4, Adam's two moments 8), the last 16 divided by the GPUs at stage 1, the bf16
gradients too at stage 2, all 20 at stage 3. The reference: 2 bytes per parameter on every rank.
Activations per layer and token: 2(4h + 2 kv d) in attention and 2(2h + 4I) in the MLP; with gradient
checkpointing each layer keeps its input (2h) and one layer's worth is recomputed at a time. Logits: 2
bytes x vocabulary per token of the micro-batch.
"""

from __future__ import annotations

GIB = 2**30
MODELS = {  # parameters, hidden h, layers, KV heads, head dim d, MLP width I, vocabulary (the models' configs)
    "Qwen2.5-0.5B": (0.494e9, 896, 24, 2, 64, 4864, 151936),
    "Qwen2.5-1.5B": (1.54e9, 1536, 28, 2, 128, 8960, 151936),
    "Qwen2.5-3B": (3.09e9, 2048, 36, 2, 128, 11008, 151936),
    "Qwen2.5-7B": (7.62e9, 3584, 28, 4, 128, 18944, 152064),
}
ROWS = [  # model, GPUs, ZeRO stage trained, micro-batch token budget, gradient checkpointing
    ("Qwen2.5-0.5B", 1, 0, 8192, False),
    ("Qwen2.5-0.5B", 1, 0, 8192, True),
    ("Qwen2.5-1.5B", 1, 0, 8192, True),
    ("Qwen2.5-1.5B", 2, 2, 8192, True),
    ("Qwen2.5-3B", 1, 0, 4096, True),
    ("Qwen2.5-3B", 4, 2, 8192, True),
    ("Qwen2.5-7B", 4, 3, 4096, True),
    ("Qwen2.5-7B", 8, 3, 8192, True),
]


def states(params: float, stage: int, gpus: int) -> float:
    """Bytes per rank of weights, gradients and optimizer state."""
    weights, grads, optimizer = 2 * params, 2 * params, 16 * params
    return {
        0: weights + grads + optimizer,
        1: weights + grads + optimizer / gpus,
        2: weights + (grads + optimizer) / gpus,
        3: (weights + grads + optimizer) / gpus,
    }[stage]


def activations(h: int, layers: int, kv: int, d: int, mlp: int, tokens: int, checkpointing: bool) -> float:
    layer = 2 * (4 * h + 2 * kv * d) + 2 * (2 * h + 4 * mlp)
    return tokens * (2 * h * layers + layer if checkpointing else layer * layers)


def main() -> None:
    print(
        "| model | GPUs | ZeRO stage trained | micro-batch token budget | gradient checkpointing | weights, grads, "
        "optimizer GiB | reference GiB | activations GiB | logits GiB | total GiB (estimated) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, gpus, stage, tokens, ckpt in ROWS:
        params, h, layers, kv, d, mlp, vocab = MODELS[name]
        parts = [
            states(params, stage, gpus),
            2 * params,
            activations(h, layers, kv, d, mlp, tokens, ckpt),
            2 * vocab * tokens,
        ]
        cells = [f"{p / GIB:.1f}" for p in parts]
        print(
            f"| {name} | {gpus} | {stage} | {tokens:,} | {'on' if ckpt else 'off'} | {' | '.join(cells)} | "
            f"{sum(parts) / GIB:.0f} |"
        )
    for name, (_, _, layers, kv, d, _, _) in MODELS.items():
        print(f"KV cache, {name}: {2 * layers * kv * d * 2 / 1024:.0f} KiB per token")


if __name__ == "__main__":
    main()
