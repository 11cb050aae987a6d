"""What both sides and the parent share: the job a worker runs, the shapes of --device, a run's result, and
the model directory both sides load (benchmarks/grpo_vs_trl.py)."""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import sys
from pathlib import Path

PROMPTS_PER_STEP = 8
GROUP = 4
LR = 1e-5
SEED = 0
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Job:
    model_dir: str
    data: str  # the JSONL prompts file (both sides read it)
    max_new_tokens: int
    steps: int
    kl_coef: float
    out: str  # a fresh run directory (rlctl) / output_dir (TRL)
    grad_ckpt: bool = False  # TRL only
    describe: bool = False  # TRL only: return the settings the trainer ended up with
    dtype: str = "fp32"  # fp32, or bf16: rlctl model.dtype=bf16, TRL bf16=True (its default)
    max_tokens: int | None = None  # rlctl only: actor.max_tokens_per_micro_batch (dynamic batching)
    mode: str = "sync"  # rlctl only: rollout.mode (--one-step-off adds one_step_off runs)
    device: str = "cpu"  # cpu, or cuda (--device cuda: the model of the GPU check, bf16)
    prompts_per_step: int = PROMPTS_PER_STEP
    group: int = GROUP
    max_prompt_length: int = 64  # rlctl's data.max_prompt_length (TRL 1.x truncates no prompt)
    micro_batch: int | None = None  # sequences per forward/backward of the update (None: the whole batch)
    continuous_batching: bool = False  # TRL only: use_transformers_continuous_batching
    cb_config: dict | None = None  # TRL only: its transformers_continuous_batching_config (None: TRL's sizing)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One workload of --device: the batch, the lengths and the update's micro-batches."""

    name: str
    prompts: int  # per step
    group: int  # samples per prompt
    new_tokens: int
    prompt_tokens: int | None  # about this many tokens per prompt (random words); None: the echo task's prompts
    micro_batch: int | None  # sequences per micro-batch of the update (None: the whole batch)
    steps: int  # per run at most (the budget may take fewer)
    warmup: int  # leading steps of each run left out


@dataclasses.dataclass
class RunResult:
    side: str
    step_s: list[float]  # per step, all steps
    tokens: list[float]  # generated tokens per step (completions up to and including eos)
    mean_len: list[float]  # mean completion length per step
    gen_s: list[float]  # generation seconds per step
    ref_s: list[float]  # scoring + reference forward (+ advantages) per step, outside generation
    padding: list[float]  # per step, the share of the token positions the update computed that were padding
    max_len: list[float]  # longest completion per step
    wall_s: float  # the whole run, setup included
    threads: int  # torch intra-op threads seen during the run
    describe: dict | None = None
    update_tokens: list[float] | None = None  # real (unpadded) prompt + completion tokens the update trained on
    peak_memory: int | None = None  # torch.cuda.max_memory_allocated over the run, reset at its start (CUDA)
    memory_after: int | None = None  # torch.cuda.memory_reserved once the run is freed (CUDA)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the shared inputs (parent) ---------------------------------------------------------------------
def build_model_dir(key: str, out: Path) -> int:
    """Write model + tokenizer with rlctl's own pieces; returns the parameter count."""
    from rlctl.config import RunConfig
    from rlctl.engine.model import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    if key == "tiny":
        model = build_tiny_model(RunConfig().model.builtin, tok, SEED)
    else:
        model = llama(tok, hidden=512, layers=8, mlp=1408, heads=8)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def llama(tok, hidden: int, layers: int, mlp: int, heads: int):
    """A Llama of these sizes for the tokenizer ``tok`` (head_dim hidden / heads, untied embeddings),
    initialised from SEED without touching the caller's RNG."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return LlamaForCausalLM(cfg)


def versions() -> str:
    out = []
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "deepspeed", "rlctl"):
        try:
            out.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)
