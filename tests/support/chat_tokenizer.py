"""A real byte-level BPE tokenizer with ChatML special tokens and a Hermes tool-calling chat template
(Qwen2.5's layout, shortened), trained in milliseconds on a few lines: merges that cross message
boundaries make drift possible, as with real models. ``tool_model_dir`` saves it with a tiny model as a
Hugging Face directory that a config can name as model.path."""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    '</tools>\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that renders the last assistant message apart from the earlier ones: not incremental.
NOT_INCREMENTAL = (
    "{%- for m in messages %}{% if loop.last %}[{{ m['role'] }}] {{ m['content'] }}{% else %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}"
)
CORPUS = [
    '<tool_call>{"name": "lookup", "arguments": {"country": "peru"}}</tool_call>',
    "<tool_response>\nlima\n</tool_response>",
    "the capital of peru is lima. the capital of france is paris. what is the capital of italy?",
    "user assistant system tools call one as name arguments country",
]


def build_chat_tokenizer(template: str = TEMPLATE, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        model_max_length=1024,
    )
    fast.chat_template = template
    return fast


def tool_model_dir(path: Path, seed: int = 0) -> Path:
    """The built-in tiny model's architecture over this tokenizer, saved as a model directory."""
    from rlctl.config import BuiltinModelConfig
    from rlctl.engine.model import build_tiny_model

    tok = build_chat_tokenizer()
    model = build_tiny_model(BuiltinModelConfig(), tok, seed)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tool_run_config(model_dir: Path, max_prompt_length: int = 400, **rollout):
    """A run of the tiny chat model at ``model_dir`` with the chat template, 2 prompts x 2 samples a step
    and ``rollout`` (its section, as keywords)."""
    from rlctl.config import RunConfig

    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "data": {"apply_chat_template": True, "max_prompt_length": max_prompt_length},
            "trainer": {"prompts_per_step": 2},
            "algorithm": {"group_size": 2},
            "rollout": rollout,
        }
    )
