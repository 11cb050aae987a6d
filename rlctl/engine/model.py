"""The built-in tiny model and its character-level tokenizers, and loading of any HF causal LM.

The tiny model is a Llama- or Qwen2-style transformer with head_dim 32 (vLLM's CPU attention backend
needs it), built from a transformers config with seeded random weights and saved with
``save_pretrained`` into the run directory, so a run is self-contained and any HF tool can reload it.
It is never seen half-written there (``rlctl.rundir.model_store``, through the run's handle).

A model directory that does not load (no or a broken config.json, no weights, no tokenizer) is an
InputError naming the directory and the cause.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from rlctl.config import BuiltinModelConfig, RunConfig
from rlctl.engine.dist import Dist
from rlctl.errors import InputError
from rlctl.rundir.handle import RunDir

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.digits + " =+-*/:.,?!#")
HEAD_DIM = 32
# Positions the built-in model takes (its tokenizer's model_max_length too). RoPE has no weights, so
# the number changes no parameter: a model an earlier rlctl saved with 256 has the same weights.
BUILTIN_CONTEXT = 1024


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
        model_max_length=BUILTIN_CONTEXT,
    )


# The chat tokenizer: ChatML's markers, the Hermes tags (one token each, as in Qwen2.5's vocabulary) and a
# template in Qwen2.5's layout, shortened: the system message lists the tools inside <tools> by name and
# description, not as JSON schemas, which at one token per character would be most of a prompt.
CHAT_SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
HERMES_TAGS = ["<tools>", "</tools>", "<tool_response>", "</tool_response>"]
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n"
    "{% for t in tools %}{{ t.function.name }}: {{ t.function.get('description', '') }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_builtin_tokenizer(spec: BuiltinModelConfig) -> PreTrainedTokenizerFast:
    """The built-in model's tokenizer (``model.builtin.tokenizer``), holding ``model.builtin.added_tokens``."""
    tok = build_char_tokenizer() if spec.tokenizer == "chars" else build_chat_tokenizer()
    if spec.added_tokens:
        tok.add_tokens([AddedToken(text, special=False, normalized=False) for text in spec.added_tokens])
    return tok


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character and newline, ChatML's <|im_start|> and <|im_end|> (eos: the
    end of a turn), the Hermes tags as one token each, and a chat template that renders tools
    (``CHAT_TEMPLATE``)."""
    vocab = {tok: i for i, tok in enumerate(CHAT_SPECIALS + CHAT_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m:.)"), behavior="isolated")  # (?m: '.' takes a newline too
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=BUILTIN_CONTEXT,
    )
    fast.add_tokens([AddedToken(text, special=False, normalized=False) for text in HERMES_TAGS])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(spec: BuiltinModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.hidden_size // HEAD_DIM,
        num_key_value_heads=spec.hidden_size // HEAD_DIM,
        max_position_embeddings=BUILTIN_CONTEXT,
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


def prepare_model_dir_once(cfg: RunConfig, run: RunDir, dist: Dist) -> Path:
    """``prepare_model_dir`` on every rank, rank 0 first: it builds the built-in model into the run once;
    the others read it when it is complete."""
    if not dist.is_main:
        dist.barrier()
    model_dir = prepare_model_dir(cfg, run)
    if dist.is_main:
        dist.barrier()
    return model_dir


def prepare_model_dir(cfg: RunConfig, run: RunDir) -> Path:
    """A local directory the actor (and reference) load from: `model.path`, or the built-in model the run
    keeps (``RunDir.model_dir``: built once from the seed; a resumed run reuses it)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path).expanduser()
    return run.model_dir(lambda out: _save_builtin(cfg, out), builtin_problem)


def builtin_problem(model_dir: Path) -> str | None:
    """Why a model directory is not whole (its config, tokenizer or weights do not load), or None."""
    from safetensors import safe_open

    try:
        AutoConfig.from_pretrained(model_dir)
        AutoTokenizer.from_pretrained(model_dir)
        weights = sorted(model_dir.glob("*.safetensors"))
        if not weights:
            return "no model.safetensors"
        for path in weights:
            with safe_open(str(path), "pt"):  # checks the header covers the whole file
                pass
    except Exception as exc:  # any way a cut-off file fails to load
        return one_line(exc)
    return None


def _save_builtin(cfg: RunConfig, out: Path) -> None:
    tokenizer = build_builtin_tokenizer(cfg.model.builtin)
    model = build_tiny_model(cfg.model.builtin, tokenizer, cfg.seed)
    # (the built-in model's weights need no renaming back to a checkpoint layout: without transformers'
    # conversion step the same bytes are written, without compiling its thousands of patterns)
    model.save_pretrained(out, save_original_format=False)
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


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (transformers' span several), cut to ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_model_config(model_dir: Path, trust_remote_code: bool = False):
    """The transformers config of a model directory, without its weights; an InputError naming the
    directory when config.json is missing or broken."""
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # OSError, ValueError, JSONDecodeError, ...
        raise InputError(f"cannot read the model config in {model_dir}: {one_line(exc)}") from None


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json", "*.h5", "*.msgpack")
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def check_weights_present(model_dir: Path) -> None:
    """An InputError naming the directory when it holds no weight file transformers could load."""
    if not any(next(model_dir.glob(pattern), None) for pattern in WEIGHT_FILES):
        raise InputError(
            f"the model directory {model_dir} holds no weights (model.safetensors, pytorch_model.bin or a "
            "sharded index)"
        )


def context_length(config) -> tuple[str, int] | None:
    """(the config key, the number) of the positions a model takes, or None when it declares none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in CONTEXT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a bad directory
        raise InputError(f"cannot load a tokenizer from {model_dir}: {one_line(exc)}") from None
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
        raise InputError(f"cannot load a causal LM from {model_dir}: {one_line(exc)}") from None


def logits_to_keep(model, n: int) -> dict:
    """``{"logits_to_keep": n}`` when the causal LM under ``model`` (a DeepSpeed engine's module, a peft
    model's base, a LoRA reference's module) takes that argument, else ``{}``: its forward then computes
    the LM head over the last ``n`` positions only. The others' logits are (B, L, V), GBs in fp32 over a
    real vocabulary, and a prompt's are never used."""
    import inspect

    inner = model
    for attr in ("peft_model", "module"):  # (nn.Module defines no truth value of its own: test for None)
        if getattr(inner, attr, None) is not None:
            inner = getattr(inner, attr)
            break
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    try:
        return {"logits_to_keep": n} if "logits_to_keep" in inspect.signature(inner.forward).parameters else {}
    except (TypeError, ValueError, AttributeError):
        return {}
