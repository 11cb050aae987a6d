"""Check 2: a Qwen2ForCausalLM of Qwen2.5-0.5B-Instruct's shapes with seeded random weights in bf16, and a
byte-level BPE tokenizer trained on the spot with ChatML's tokens and a chat template, saved as a Hugging
Face directory that the runs load (benchmarks/qwen2_random.py builds both, as for grpo_vs_trl.py); the
model stays on the device for the decode probe and the identity."""

from __future__ import annotations

import time

from qwen2_random import build_model, matmul_counts, train_tokenizer

from gpucheck.context import Ctx
from gpucheck.report import MIB, Clock, Fail

REWARDS = '''"""Rewards of the GPU check (benchmarks/gpu_check.py)."""


def varied(prompts, completions, **_):
    """A score that differs between the completions of one prompt, so every group has advantages."""
    return [(len(c) % 13) / 13.0 for c in completions]


def huge(prompts, completions, **_):
    """Rewards of 1e5 (RLOO does not normalise them away): fp16 gradients overflow and the loss scale moves."""
    return [1e5 * (len(c) % 3) for c in completions]
'''


def check_build(ctx: Ctx, fig: dict, clock: Clock) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = ctx.work / "qwen2-random"
    t = time.monotonic()
    tok = train_tokenizer(ctx.size.vocab, ctx.size.words, ctx.size.model["max_position_embeddings"])
    fig["tokenizer_s"], fig["tokenizer_vocab"] = round(time.monotonic() - t, 1), len(tok)
    t = time.monotonic()
    model = build_model(ctx.size.model, tok, ctx.device)
    fig["model_init_s"] = round(time.monotonic() - t, 1)
    fig["params"] = sum(p.numel() for p in model.parameters())
    ctx.matmul_params, ctx.head_params = matmul_counts(model)
    fig["matmul_params"] = ctx.matmul_params
    ctx.params = fig["params"]
    fig["logits_ok"] = first_forward(ctx, model, tok)
    t = time.monotonic()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    fig["save_s"] = round(time.monotonic() - t, 1)
    fig["bytes"] = sum(f.stat().st_size for f in out.iterdir())
    fig["config"] = dict(ctx.size.model)
    ctx.model, ctx.tokenizer = model, tok
    (ctx.work / "gpu_check_reward.py").write_text(REWARDS)
    ctx.model_dir = out
    fig["summary"] = (
        f"{fig['params'] / 1e6:.1f}M parameters ({ctx.matmul_params / 1e6:.1f}M in matrix products), "
        f"{ctx.size.model['num_hidden_layers']} layers, vocabulary {ctx.size.model['vocab_size']} "
        f"(tokenizer {len(tok)}, trained in {fig['tokenizer_s']} s), {fig['bytes'] / MIB:.0f} MiB on disk"
    )
    if not fig["logits_ok"]:
        raise Fail("the model's first forward pass gave logits that are not finite, or of the wrong shape")


def first_forward(ctx: Ctx, model, tok) -> bool:
    """Whether a chat-templated prompt gives finite logits of shape (1, length, vocabulary)."""
    import torch

    text = tok.apply_chat_template([{"role": "user", "content": "abc="}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids.to(ctx.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits.shape == (1, ids.shape[1], ctx.size.model["vocab_size"]) and bool(torch.isfinite(logits).all())
