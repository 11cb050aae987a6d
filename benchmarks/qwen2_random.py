"""A Qwen2-shaped causal LM with seeded random weights and a byte-level BPE tokenizer trained on the spot:
the model the GPU benchmarks run when no checkpoint can be fetched (the lent GPU machine reaches no
network). Sizes: Qwen2.5-0.5B-Instruct's (``QWEN_05B``) or a tiny one for CPU dry runs (``TINY_MODEL``).

    from qwen2_random import QWEN_05B, write_model_dir
    facts = write_model_dir(out, QWEN_05B, vocab=151643, words=150000, device="cuda")

benchmarks/grpo_vs_trl.py --device uses it; the model, tokenizer and bf16 peaks are those of
benchmarks/gpu_check.py (its check 2), kept here so that both can share one builder.
"""

from __future__ import annotations

from pathlib import Path

# Qwen2.5-0.5B-Instruct's shapes (its config.json): 494M parameters, 136M of them the tied embedding
QWEN_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY_MODEL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's datasheets, by a name's substring;
# the first that matches counts (more specific names first)
BF16_PEAK = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
]
CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bf16_peak(gpu_name: str) -> float | None:
    """The datasheet's dense bf16 peak of this GPU in TFLOP/s; None for a name not in BF16_PEAK."""
    return next((peak for key, peak in BF16_PEAK if key in gpu_name), None)


def corpus_words(words: int) -> list[str]:
    """The seeded random words the tokenizer is trained on (prompts built from them tokenize as trained)."""
    import random
    import string

    rng = random.Random(0)
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 10))) for _ in range(words)]


def train_tokenizer(vocab: int, words: int, max_positions: int):
    """A byte-level BPE tokenizer with ChatML's special tokens and a chat template, trained on ``words``
    random words (seeded) up to ``vocab`` tokens; eos <|im_end|>, pad and bos <|endoftext|>, left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    seen = corpus_words(words)
    corpus = [" ".join(seen[i : i + 100]) for i in range(0, len(seen), 100)]
    corpus += [f"{w}={w}" for w in seen[:200]]  # the built-in task's echo prompts and answers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
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
        model_max_length=max_positions,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(shape: dict, tok, device: str):
    """Qwen2ForCausalLM of ``shape`` (QWEN_05B, TINY_MODEL), weights seeded with 0, bf16, built on ``device``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        **shape,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        use_sliding_window=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def matmul_counts(model) -> tuple[int, int]:
    """(weights of the model's matrix products, the tied LM head included; the LM head's alone)."""
    import torch

    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return total, model.get_output_embeddings().weight.numel()


def write_model_dir(out: Path, shape: dict, *, vocab: int, words: int, device: str) -> dict:
    """Train the tokenizer, build the model on ``device`` and save both to ``out`` (a Hugging Face
    directory); returns the parameter counts (params, matmul_params, head_params)."""
    import torch

    tok = train_tokenizer(vocab, words, shape["max_position_embeddings"])
    model = build_model(shape, tok, device)
    matmul, head = matmul_counts(model)
    facts = {"params": sum(p.numel() for p in model.parameters()), "matmul_params": matmul, "head_params": head}
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return facts
