"""Rollouts with a Hugging Face model: batched sampling with a KV cache, on the actor's own weights.

Sampling is Gumbel-max: argmax(logits / T + g) with g drawn from one generator per sequence seeded by
``sample_seed``, which samples exactly softmax(logits / T) while making every sequence reproducible
on its own. The backend generates with the actor's module (its weights are the actor's, so there is
nothing to copy after an update; under ZeRO-3 the parameters are gathered for the whole generate).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from rlctl.config import RunConfig
from rlctl.engine.actor import Actor
from rlctl.engine.batch import Sequences
from rlctl.engine.rollout.seeds import sample_seed


class SeededGumbelSampler(LogitsProcessor):
    """Sampling at ``temperature`` as argmax(logits / T + Gumbel noise), one generator per sequence, so
    every sequence is reproducible on its own. Noise is drawn ``chunk`` tokens at a time per sequence
    (one call per sequence per chunk, not per token). Also usable as a transformers LogitsProcessor
    turning greedy decoding into this sampling."""

    def __init__(self, seeds: list[int], temperature: float, chunk: int = 16):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature
        self.chunk = chunk
        self._noise: torch.Tensor | None = None  # (B, chunk, V)
        self._used = chunk

    def gumbel(self, vocab: int) -> torch.Tensor:
        """(B, V) Gumbel noise for the next token of every sequence."""
        if self._used >= self.chunk or self._noise is None or self._noise.shape[-1] != vocab:
            u = torch.stack([torch.rand(self.chunk, vocab, generator=g) for g in self.generators])
            self._noise = -torch.log(-torch.log(u.clamp_(1e-20, 1.0 - 1e-7)))
            self._used = 0
        noise = self._noise[:, self._used]
        self._used += 1
        return noise

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.temperature == 0:  # greedy: the argmax of the logits, no noise drawn
            return scores.float()
        return scores.float() / self.temperature + self.gumbel(scores.shape[-1]).to(scores.device)


@torch.no_grad()
def decode(
    model, input_ids, attention_mask, max_new_tokens: int, eos_ids: list[int], pad_id: int, sampler: SeededGumbelSampler
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched sampling with a KV cache: (B, P) left-padded prompts -> (B, R) response ids, R <= max,
    pad after each sequence's eos, and the (B, R) fp32 log-probs of the sampled tokens (of logits / T;
    of the logits themselves when greedy, T = 0).
    Position ids count real tokens only, as the actor's forward does. A lean loop: one forward per
    token, no generation-config machinery."""
    from transformers import DynamicCache

    cache = DynamicCache()
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(eos_ids, device=input_ids.device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    )
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    tokens, log_probs = [], []
    position = positions[:, -1:]
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1, :]
        nxt = sampler(None, logits).argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        tokens.append(nxt)
        scaled = logits.float() / (
            sampler.temperature or 1.0
        )  # log p of the sampled token, without a (B, V) log-softmax
        lp = scaled.gather(-1, nxt[:, None])[:, 0] - scaled.logsumexp(-1)
        log_probs.append(lp)
        done |= torch.isin(nxt, eos)
        if bool(done.all()):
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        position = position + 1
        out = model(
            input_ids=nxt[:, None],
            attention_mask=attention_mask,
            position_ids=position,
            past_key_values=cache,
            use_cache=True,
        )
    return torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1)


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

    def sync_weights(self) -> None:
        """The backend generates with the actor's own module: its weights are always current."""

    def forget_cache(self) -> None:
        """Nothing is cached across calls (the KV cache lives for one generation)."""

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
    def generate(
        self, prompts: list[str], keys: list[tuple[int, int]], step: int, temperature: float | None = None
    ) -> Sequences:
        """Sample a completion per (prompt, key) at ``temperature`` (rollout.temperature; 0: greedy)."""
        enc = self.encode(prompts)
        seeds = [sample_seed(self.cfg.seed, step, p, s) for p, s in keys]
        t = self.cfg.rollout.temperature if temperature is None else temperature
        sampler = SeededGumbelSampler(seeds, t)
        module = self.actor.module
        was_training = module.training
        module.eval()
        try:
            with self.actor.full_parameters():
                responses, log_probs = decode(
                    module,
                    enc["input_ids"],
                    enc["attention_mask"],
                    self.cfg.rollout.max_new_tokens,
                    self.eos_ids,
                    self.tokenizer.pad_token_id,
                    sampler,
                )
        finally:
            module.train(was_training)
        prompt_len = enc["input_ids"].shape[1]
        response_mask = response_mask_for(responses, self.eos_ids)
        responses = responses.masked_fill(response_mask == 0, self.tokenizer.pad_token_id)
        input_ids = torch.cat([enc["input_ids"], responses], dim=1)
        attention_mask = torch.cat([enc["attention_mask"], response_mask], dim=1)
        log_probs = log_probs.masked_fill(response_mask == 0, 0.0)
        return Sequences(input_ids, attention_mask, response_mask, prompt_len, log_probs)
