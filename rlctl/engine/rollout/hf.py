"""Rollouts with Hugging Face ``generate``: batched, KV cache, on the actor's own weights.

Sampling is Gumbel-max: argmax(logits / T + g) with g drawn from one generator per sequence seeded by
``sample_seed``, which samples exactly softmax(logits / T) while making every sequence reproducible
on its own. The backend generates with the actor's module (its weights are the actor's, so there is
nothing to copy after an update; under ZeRO-3 the parameters are gathered for the whole generate).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from rlctl.config import RunConfig
from rlctl.engine.actor import Actor, Sequences
from rlctl.engine.rollout import sample_seed


class SeededGumbelSampler(LogitsProcessor):
    """Turns greedy decoding into sampling at ``temperature`` with per-sequence seeds."""

    def __init__(self, seeds: list[int], temperature: float):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        u = torch.stack([torch.rand(vocab, generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(u.clamp_(1e-20, 1.0 - 1e-7)))
        return scores.float() / self.temperature + gumbel.to(scores.device)


def response_mask_for(responses: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """(B, T) response ids -> (B, T) mask: 1 up to and including the first eos, 0 after it."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device)).long()
    seen_before = is_eos.cumsum(-1) - is_eos
    return (seen_before == 0).long()


class HFRollout:
    def __init__(self, cfg: RunConfig, actor: Actor, tokenizer):
        self.cfg = cfg
        self.actor = actor
        self.tokenizer = tokenizer
        eos = actor.module.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_ids = sorted({tokenizer.eos_token_id, *eos})
        self.gen_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=cfg.rollout.max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=tokenizer.pad_token_id,
        )

    def sync_weights(self) -> None:
        """The backend generates with the actor's own module: its weights are always current."""

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        if self.cfg.data.apply_chat_template:
            prompts = [
                tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                for p in prompts
            ]
        tok.truncation_side = "left"
        enc = tok(
            prompts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.cfg.data.max_prompt_length,
            add_special_tokens=not self.cfg.data.apply_chat_template,
        )
        return {k: v.to(self.actor.runtime.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    def decode(self, seqs: Sequences) -> list[str]:
        """The text each completion holds up to its eos. Special tokens other than eos stay in the text
        (a model that emits padding mid-answer is not shown a cleaned-up version to the reward)."""
        keep = seqs.response_mask.bool() & ~torch.isin(seqs.responses, torch.tensor(self.eos_ids))
        return [
            self.tokenizer.decode(ids[k].tolist(), skip_special_tokens=False)
            for ids, k in zip(seqs.responses.cpu(), keep.cpu())
        ]

    @torch.no_grad()
    def generate(self, prompts: list[str], keys: list[tuple[int, int]], step: int) -> Sequences:
        enc = self.encode(prompts)
        seeds = [sample_seed(self.cfg.seed, step, p, s) for p, s in keys]
        sampler = SeededGumbelSampler(seeds, self.cfg.rollout.temperature)
        module = self.actor.module
        was_training = module.training
        module.eval()
        try:
            with self.actor.full_parameters():
                out = module.generate(
                    **enc, generation_config=self.gen_config, logits_processor=LogitsProcessorList([sampler])
                )
        finally:
            module.train(was_training)
        prompt_len = enc["input_ids"].shape[1]
        responses = out[:, prompt_len:]
        response_mask = response_mask_for(responses, self.eos_ids)
        responses = responses.masked_fill(response_mask == 0, self.tokenizer.pad_token_id)
        input_ids = torch.cat([enc["input_ids"], responses], dim=1)
        attention_mask = torch.cat([enc["attention_mask"], response_mask], dim=1)
        return Sequences(input_ids, attention_mask, response_mask, prompt_len)
