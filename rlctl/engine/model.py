"""The built-in tiny model and its character-level tokenizer, and loading of any HF causal LM.

The tiny model is a Llama- or Qwen2-style transformer with head_dim 32 (vLLM's CPU attention backend
needs it), built from a transformers config with seeded random weights and saved with
``save_pretrained`` into the run directory, so a run is self-contained and any HF tool can reload it.
"""

from __future__ import annotations

import atexit
import shutil
import string
import tempfile
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from rlctl.config import BuiltinModelConfig, RunConfig
from rlctl.engine.dist import Dist
from rlctl.errors import InputError
from rlctl.storage import Storage

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.digits + " =+-*/:.,?!#")
HEAD_DIM = 32


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, a <bos> in front of every encoded text, <eos> to stop."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=1024,
    )


def build_tiny_model(spec: BuiltinModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.hidden_size // HEAD_DIM,
        num_key_value_heads=spec.hidden_size // HEAD_DIM,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    if spec.arch == "llama":
        cls, cfg = LlamaForCausalLM, LlamaConfig(head_dim=HEAD_DIM, **common)
    else:
        cls, cfg = Qwen2ForCausalLM, Qwen2Config(**common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    return model


def prepare_model_dir_once(cfg: RunConfig, run: Storage, dist: Dist) -> Path:
    """``prepare_model_dir`` on every rank, rank 0 first: it builds the built-in model into the run once;
    the others read it when it is complete."""
    if not dist.is_main:
        dist.barrier()
    model_dir = prepare_model_dir(cfg, run)
    if dist.is_main:
        dist.barrier()
    return model_dir


def prepare_model_dir(cfg: RunConfig, run: Storage) -> Path:
    """A local directory the actor (and reference) load from: `model.path`, or the built-in model kept in
    RUN_DIR/model (created once; a resumed run reuses it). For a remote run directory the built-in model
    is built or fetched into a local temporary directory."""
    if cfg.model.path is not None:
        return Path(cfg.model.path).expanduser()
    if run.is_local:
        out = Path(run.path("model"))
        if not (out / "config.json").exists():
            _save_builtin(cfg, out)
        return out
    out = Path(tempfile.mkdtemp(prefix="rlctl-model-"))
    atexit.register(shutil.rmtree, out, True)
    if run.exists("model", "config.json"):
        run.get_dir(str(out), "model")
    else:
        _save_builtin(cfg, out)
        run.put_dir(str(out), "model")
    return out


def _save_builtin(cfg: RunConfig, out: Path) -> None:
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg.model.builtin, tokenizer, cfg.seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


HF_METADATA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")


def hf_metadata_files(model_dir: Path) -> dict[str, bytes]:
    """The small files that describe a model directory (configs, tokenizer), without weights: kept in
    every snapshot so `rlctl export` can rebuild a Hugging Face directory from it alone."""
    out = {}
    for f in sorted(model_dir.iterdir()):
        small = f.is_file() and f.stat().st_size < 64 << 20
        if small and f.suffix in HF_METADATA_SUFFIXES and not f.name.endswith(".index.json"):
            out[f"hf/{f.name}"] = f.read_bytes()
    return out


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a bad directory
        raise InputError(f"cannot load a tokenizer from 'model.path' {model_dir}: {exc}") from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise InputError(f"the tokenizer in {model_dir} has no eos token; rlctl needs one to stop generation")
    return tok


def load_causal_lm(model_dir: Path, dtype: torch.dtype, trust_remote_code: bool = False):
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise InputError(f"cannot load a causal LM from 'model.path' {model_dir}: {exc}") from None
