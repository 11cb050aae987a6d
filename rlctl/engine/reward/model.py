"""A reward model: a Hugging Face sequence-classification model scoring prompt + completion.

``ModelReward(cfg, key, device)`` checks the directory at once (``reward.model.path`` or
``reward.sources[i].model.path``, named in every error): it must hold a ``*ForSequenceClassification``
config with one label (the score is ``logits[:, 0]``; a classifier with more labels has no one score to
use), its weights and a tokenizer. This costs no weights, so the preflight builds it too; the weights are
loaded on the first call, in ``dtype`` (auto: bf16 on CUDA/NPU with native bf16, fp32 on the CPU) on
``device`` (the rank's own), in eval mode (no dropout), frozen, and every forward runs under
``torch.inference_mode``. Each rank scores its own share of the completions with its own copy.

The text scored is the reward model's own chat template applied to ``[user: prompt, assistant:
completion]`` when its tokenizer has one (as TRL does for conversational data and verl when the reward
model's tokenizer differs from the policy's), else ``prompt + completion`` with the tokenizer's special
tokens. The prompt is the dataset's (without the policy's chat template or ``data.system_prompt``).

Texts are scored ``batch_size`` at a time, sorted by length, right-padded with the model's pad token
here (the tokenizer's padding side plays no part): a score does not depend on the other texts in its
batch beyond float rounding, and a resumed run, which forms the same batches, scores exactly the same.
A text longer than the model's context (the config's positions, or the tokenizer's ``model_max_length``
when smaller) keeps its last tokens: the completion's end, where the score is read. ``truncated`` counts
the texts cut so, for the per-source metric.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rlctl.config.reward import RewardModelConfig
from rlctl.engine.model import WEIGHT_FILES, context_length, one_line
from rlctl.engine.runtime import resolve_dtype
from rlctl.errors import InputError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
UNBOUNDED = 10**9  # a tokenizer's model_max_length above this means "no limit" (transformers' 1e30 default)


class ModelReward:
    """A reward function ``fn(prompts, completions, **columns) -> list[float]`` backed by a reward model."""

    def __init__(self, cfg: RewardModelConfig, key: str, device: torch.device | str = "cpu"):
        """``key``: the config key of the directory (``reward.model.path``), named by every error."""
        self.cfg, self.key, self.device = cfg, key, torch.device(device)
        self.path = Path(cfg.path).expanduser()
        self.config = self._check_config()
        self._check_weights()
        self.tokenizer = self._load_tokenizer()
        self.pad_id = self._pad_id()
        self.max_length = self._max_length()
        self.model: Any = None  # loaded on the first call
        self.truncated = 0  # texts cut to the context since the last reset

    # -- checks, without weights ---------------------------------------------------------------------

    def _fail(self, what: str) -> InputError:
        return InputError(f"'{self.key}' {self.path}: {what}")

    def _check_config(self) -> Any:
        """The model's config: a sequence classifier with one label, else an InputError naming the key."""
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(self.path)
        except Exception as exc:  # OSError, ValueError, JSONDecodeError, ...
            raise self._fail(f"cannot read the model config: {one_line(exc)}") from None
        arches = list(getattr(config, "architectures", None) or [])
        if not any(a.endswith("ForSequenceClassification") for a in arches):
            held = f"a {', '.join(arches)}" if arches else "a config that names no architecture"
            raise self._fail(
                f"holds {held}, not a sequence-classification model (AutoModelForSequenceClassification, "
                "e.g. LlamaForSequenceClassification): a reward model needs a trained score head"
            )
        if config.num_labels != 1:
            raise self._fail(
                f"the model has {config.num_labels} labels; a reward model has exactly one (its logit is the score)"
            )
        return config

    def _check_weights(self) -> None:
        if not any(next(self.path.glob(pattern), None) for pattern in WEIGHT_FILES):
            raise self._fail("holds no weights (model.safetensors, pytorch_model.bin or a sharded index)")

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise self._fail(f"cannot load its tokenizer: {one_line(exc)}") from None

    def _pad_id(self) -> int:
        """The id padded with: the model's own pad token (its pooling skips it), else the tokenizer's pad or
        eos token (then written into the model's config, which the pooling reads)."""
        for value in (self.config.pad_token_id, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                return value
        raise self._fail("neither the model config nor the tokenizer names a pad or eos token to pad batches with")

    def _max_length(self) -> int | None:
        """The most tokens a text may have: the config's positions, or the tokenizer's limit when smaller."""
        found = context_length(self.config)
        limits = [found[1]] if found else []
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_max, int) and 0 < tok_max < UNBOUNDED:
            limits.append(tok_max)
        return min(limits) if limits else None

    # -- scoring -------------------------------------------------------------------------------------

    def load(self) -> None:
        """The weights, frozen, in eval mode, on the device, in the configured dtype (once)."""
        if self.model is not None:
            return
        from transformers import AutoModelForSequenceClassification

        dtype = DTYPES.get(self.cfg.dtype) or resolve_dtype("auto", self.device.type)
        try:
            with torch.random.fork_rng(devices=[]):  # loading draws no number a resumed run would miss
                model, info = AutoModelForSequenceClassification.from_pretrained(
                    self.path, dtype=dtype, output_loading_info=True
                )
        except Exception as exc:
            raise self._fail(f"cannot load the model: {one_line(exc)}") from None
        missing = [k for k in info.get("missing_keys", ()) if k]
        if missing:
            raise self._fail(f"the weights lack {', '.join(sorted(missing)[:4])}: the score head is not trained")
        model.config.pad_token_id = self.pad_id
        model.requires_grad_(False)
        self.model = model.to(self.device).eval()

    def texts(self, prompts: list[str], completions: list[str]) -> list[list[int]]:
        """Each prompt + completion as the reward model's token ids (see the module's docstring), cut
        from the left to the context; ``truncated`` counts the cut ones."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            chats = [
                [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                for p, c in zip(prompts, completions)
            ]
            strings = [tok.apply_chat_template(chat, tokenize=False) for chat in chats]
            ids = tok(strings, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        else:
            strings = [p + c for p, c in zip(prompts, completions)]
            ids = tok(strings, add_special_tokens=True, return_attention_mask=False, verbose=False)["input_ids"]
        if self.max_length is not None:
            self.truncated += sum(len(row) > self.max_length for row in ids)
            ids = [row[-self.max_length :] for row in ids]
        return ids

    def __call__(self, prompts: list[str], completions: list[str], **columns: list) -> list[float]:
        """One score per completion: ``logits[:, 0]`` of prompt + completion, ``batch_size`` at a time."""
        self.load()
        ids = self.texts(prompts, completions)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores: list[float] = [0.0] * len(ids)
        size = self.cfg.batch_size
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            for i, score in zip(chunk, self._forward([ids[i] for i in chunk])):
                scores[i] = score
        return scores

    def _forward(self, rows: list[list[int]]) -> list[float]:
        """The scores of one batch of token rows, right-padded."""
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[b, : len(row)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits[:, 0].float().cpu().tolist()
