"""Check 2: a Qwen2ForCausalLM of Qwen2.5-0.5B-Instruct's shapes with seeded random weights in bf16, and a
byte-level BPE tokenizer trained on the spot with ChatML's tokens and a chat template, saved as a Hugging
Face directory that the runs load; the model stays on the device for the decode probe and the identity."""

from __future__ import annotations

import time

from gpucheck.context import Ctx, Size
from gpucheck.report import MIB, Clock, Fail

REWARDS = '''"""Rewards of the GPU check (benchmarks/gpu_check.py)."""


def varied(prompts, completions, **_):
    """A score that differs between the completions of one prompt, so every group has advantages."""
    return [(len(c) % 13) / 13.0 for c in completions]


def huge(prompts, completions, **_):
    """Rewards of 1e5 (RLOO does not normalise them away): fp16 gradients overflow and the loss scale moves."""
    return [1e5 * (len(c) % 3) for c in completions]
'''
CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def check_build(ctx: Ctx, fig: dict, clock: Clock) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = ctx.work / "qwen2-random"
    t = time.monotonic()
    tok = train_tokenizer(ctx.size)
    fig["tokenizer_s"], fig["tokenizer_vocab"] = round(time.monotonic() - t, 1), len(tok)
    t = time.monotonic()
    model = build_model(ctx, tok)
    fig["model_init_s"] = round(time.monotonic() - t, 1)
    fig["params"] = sum(p.numel() for p in model.parameters())
    ctx.matmul_params = fig["matmul_params"] = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    ctx.head_params = model.get_output_embeddings().weight.numel()
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


def train_tokenizer(size: Size):
    """A byte-level BPE tokenizer with ChatML's special tokens and a chat template, trained on a corpus of
    random words (seeded) up to ``size.vocab`` tokens."""
    import random
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 10))) for _ in range(size.words)]
    corpus = [" ".join(words[i : i + 100]) for i in range(0, len(words), 100)]
    corpus += [f"{w}={w}" for w in words[:200]]  # the built-in task's echo prompts and answers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size.vocab,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        model_max_length=size.model["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(ctx: Ctx, tok):
    """Qwen2ForCausalLM of ``ctx.size.model``'s shapes, seeded random weights, bf16, built on the device."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        **ctx.size.model,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        use_sliding_window=False,
    )
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def first_forward(ctx: Ctx, model, tok) -> bool:
    """Whether a chat-templated prompt gives finite logits of shape (1, length, vocabulary)."""
    import torch

    text = tok.apply_chat_template([{"role": "user", "content": "abc="}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids.to(ctx.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits.shape == (1, ids.shape[1], ctx.size.model["vocab_size"]) and bool(torch.isfinite(logits).all())
