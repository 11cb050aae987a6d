"""Rollouts with a Hugging Face model: batched sampling with a KV cache, on the actor's own weights.

Sampling is Gumbel-max: argmax(scaled logits + g), where the noise g of each sequence depends on its
seed (``sample_seed``) alone, which samples exactly softmax(logits / T) while making every sequence
reproducible on its own. rollout.sampler says where g comes from: ``counter`` (new runs) computes it on
the logits' device from (seed, position, vocabulary index) (``noise.CounterSampler``); ``generator``
(runs started before that key) draws it from one CPU generator per sequence (``SeededGumbelSampler``).
rollout.top_p/top_k/min_p set filtered tokens' scaled logits to -inf before the noise is added (the
same noise: a resume samples the same), so the truncated distribution is sampled; the log-probs
returned stay those of the untruncated softmax(logits / T), as the actor computes them. rollout.stop
ends a sequence at the first token completing a stop string, found on decoded text when the host
looks at the batch (every ``check_every`` tokens of the sampler's). The backend generates with the
actor's module (its weights are the actor's, so there is nothing to copy after an update; under ZeRO-3
the parameters are gathered for the whole generate).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LogitsProcessor

from rlctl.config import RolloutConfig, RunConfig
from rlctl.engine.actor import Actor
from rlctl.engine.batch import Sequences
from rlctl.engine.data import prompt_texts
from rlctl.engine.rollout.kv_cache import DynamicKV, decode_kv, prefill, static_fits
from rlctl.engine.rollout.noise import CounterSampler
from rlctl.engine.rollout.sampling import StopStrings, truncate
from rlctl.engine.rollout.seeds import sample_seed


class SeededGumbelSampler(LogitsProcessor):
    """Sampling at ``temperature`` as argmax(logits / T + Gumbel noise), one generator per sequence, so
    every sequence is reproducible on its own. Noise is drawn ``chunk`` tokens at a time per sequence
    (one call per sequence per chunk, not per token). ``top_p``, ``top_k`` and ``min_p`` truncate the
    scaled logits first (``sampling.truncate``; nothing is touched when all are off). Also usable as a
    transformers LogitsProcessor turning greedy decoding into this sampling. Its runs' decode looks at the
    batch after every token (``check_every``), as it always did, so that they resume bit for bit."""

    check_every = 1

    def __init__(
        self,
        seeds: list[int],
        temperature: float,
        chunk: int = 16,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
    ):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature
        self.filters = {"top_p": top_p, "top_k": top_k, "min_p": min_p}
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

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows (positions in the current batch), in this order: the sequences left
        after finished ones leave the batch go on with their own generators and noise."""
        idx = rows.tolist()
        self.generators = [self.generators[i] for i in idx]
        if self._noise is not None:
            self._noise = self._noise[rows.to(self._noise.device)]

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, V) logits of the next position -> ((B,) sampled tokens, (B, V) fp32 logits / T, untruncated,
        for the log-probs; the logits themselves when greedy)."""
        return self(None, logits).argmax(-1), logits.float() / (self.temperature or 1.0)

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.temperature == 0:  # greedy: the argmax of the logits, no noise drawn (no filter removes it)
            return scores.float()
        scaled = truncate(scores.float() / self.temperature, **self.filters)
        return scaled + self.gumbel(scores.shape[-1]).to(scores.device)


Sampler = CounterSampler | SeededGumbelSampler


def sampler_for(rollout: RolloutConfig, seeds: list[int], temperature: float) -> Sampler:
    """The run's sampler (``rollout.sampler``) for sequences with these seeds, at ``temperature`` (0:
    greedy), truncated by rollout.top_p/top_k/min_p."""
    kind = CounterSampler if rollout.sampler == "counter" else SeededGumbelSampler
    return kind(seeds, temperature, top_p=rollout.top_p, top_k=rollout.top_k, min_p=rollout.min_p)


@torch.no_grad()
def decode(
    model,
    input_ids,
    attention_mask,
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    sampler: Sampler,
    stops: StopStrings | None = None,
    check_every: int | None = None,
    *,
    static: bool | None = None,
    cuda_graphs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched sampling with a KV cache: (B, P) left-padded prompts -> (B, R) response ids, R <= max,
    pad after each sequence's eos or stop string, the (B, R) fp32 log-probs of the sampled tokens (of
    the untruncated logits / T; of the logits themselves when greedy, T = 0) and the (B,) number of
    tokens each sequence kept before a stop string ended it (R where none did).
    Position ids count real tokens only, as the actor's forward does. A lean loop: one forward per
    token, no generation-config machinery. The host looks at the batch every ``check_every`` tokens
    only (``Decoding.check``; the sampler's ``check_every`` by default): whether all rows are done, stop
    strings, and compaction (finished rows leave the batch, so a batch of mixed lengths costs its real
    tokens). The tokens are the same for every ``check_every`` (tokens after a row's end are padding
    either way); the log-probs too within rounding (the forward's batch differs).
    The KV cache (``kv_cache``): the generator sampler's decode is today's, a dynamic cache; the counter
    sampler's is static in batch-size buckets where ``static`` (None: on CUDA, for a model it serves),
    its steps replayed as CUDA graphs where ``cuda_graphs`` (ignored on the CPU and with a dynamic cache),
    else dynamic, its steps attending over grouped KV heads without repeating them."""
    if isinstance(sampler, SeededGumbelSampler):
        cache, logits, position = prefill(model, input_ids, attention_mask)
        kv = DynamicKV(model, cache, attention_mask, position)
    else:
        static = input_ids.is_cuda and static_fits(model) if static is None else static
        kv, logits = decode_kv(model, input_ids, attention_mask, max_new_tokens, static=static, graphs=cuda_graphs)
    state = Decoding(input_ids.shape[0], max_new_tokens, eos_ids, pad_id, input_ids.device)
    check_every = check_every or sampler.check_every
    for step in range(max_new_tokens):
        state.sample(logits, sampler)
        if (step + 1) % check_every == 0 or step + 1 == max_new_tokens:
            if state.check(stops):
                break
            keep = state.compact(kv.worth)
            if keep is not None:
                kv.keep(keep)
                sampler.keep(keep)
        if step + 1 == max_new_tokens:
            break
        logits = kv.forward(state.last)
    return state.result()


class Decoding:
    """The bookkeeping of ``decode`` over the whole batch (B rows) while the model computes only the
    rows still in it (``rows``: their indices in the batch, in order). Everything per token stays on the
    device; the host reads it in ``check``."""

    def __init__(self, batch: int, max_new_tokens: int, eos_ids: list[int], pad_id: int, device):
        self.pad_id, self.eos = pad_id, torch.tensor(eos_ids, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.max_new_tokens = max_new_tokens
        self.kept = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)  # before a stop string
        self.eos_at = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)  # max_new_tokens: none
        self.rows = torch.arange(batch, device=device)
        self.tokens: list[torch.Tensor] = []  # one (B,) tensor per step
        self.log_probs: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None  # the rows' tokens of the last step (after ``sample``)
        self.checked = 0  # the steps whose stop strings ``check`` has looked at

    def sample(self, logits: torch.Tensor, sampler: Sampler) -> None:
        """Sample the next token of every row in the batch from its (rows, V) logits (on the device)."""
        nxt, scaled = sampler.pick(logits)
        nxt = torch.where(self.done[self.rows], torch.full_like(nxt, self.pad_id), nxt)
        lp = scaled.gather(-1, nxt[:, None])[:, 0] - scaled.logsumexp(-1)  # log p, no (B, V) log-softmax
        self.tokens.append(torch.full_like(self.done, self.pad_id, dtype=nxt.dtype).index_copy_(0, self.rows, nxt))
        self.log_probs.append(torch.zeros_like(self.done, dtype=lp.dtype).index_copy_(0, self.rows, lp))
        ends = ~self.done & torch.isin(self.tokens[-1], self.eos)
        self.eos_at = torch.where(ends, len(self.tokens) - 1, self.eos_at)
        self.done |= ends
        self.last = nxt

    def check(self, stops: StopStrings | None) -> bool:
        """Look at the tokens since the last check: end the rows whose text now holds a stop string
        (``stop_ends``); whether every row is done."""
        if stops:
            first, self.checked = self.checked, len(self.tokens)
            alive = (self.eos_at > first) & (self.kept == self.max_new_tokens)
            for row, kept in stop_ends(stops, self.tokens, first, alive, self.eos_at).items():
                self.kept[row], self.done[row] = kept, True
        return bool(self.done.all())

    def compact(self, worth: Callable[[int, int], bool]) -> torch.Tensor | None:
        """The positions (in the current rows) of the rows still running, when ``worth(running, rows)`` says
        the cache is worth copying to drop the others (the dynamic cache: an eighth of the rows are done;
        the static one: the running rows fit a smaller bucket); else None and the rows stay."""
        running = ~self.done[self.rows]
        if not worth(int(running.sum()), len(self.rows)):
            return None
        keep = running.nonzero()[:, 0]
        self.rows, self.last = self.rows[keep], self.last[keep]
        return keep

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' tokens and log-probs up to the last row's end (pad and 0 after each row's own end,
        found at a check after it: the tokens a row sampled past its stop string are dropped here)."""
        lengths = torch.minimum(self.eos_at + 1, self.kept)
        width = int(lengths.max()) if len(lengths) else 0
        tokens, log_probs = torch.stack(self.tokens[:width], dim=1), torch.stack(self.log_probs[:width], dim=1)
        after = torch.arange(width, device=tokens.device) >= lengths[:, None]
        return (
            tokens.masked_fill(after, self.pad_id),
            log_probs.masked_fill(after, 0.0),
            self.kept.clamp(max=width),
        )


def stop_ends(
    stops: StopStrings, tokens: list[torch.Tensor], first: int, alive: torch.Tensor, eos_at: torch.Tensor
) -> dict[int, int]:
    """{row: tokens it keeps} for the rows (``alive``: (B,) bool, not yet ended before step ``first``)
    whose text now holds a stop string: the first step from ``first`` on (before the row's eos, at (B,)
    ``eos_at``) after which its last ``stops.window`` tokens' text holds one. Each row's new tokens are
    decoded once with the window before them; only a row whose text holds a stop string is looked at
    token by token (a window's text is part of the whole's: tokenizers decode a suffix of bytes alike)."""
    rows = alive.nonzero()[:, 0].tolist()
    if not rows:
        return {}
    start = max(0, first - stops.window + 1)
    block = torch.stack(tokens[start:], dim=1)[rows].tolist()
    ends = [min(len(tokens), e) for e in eos_at[rows].tolist()]  # eos tokens are never checked
    texts = stops.tokenizer.batch_decode([ids[: e - start] for ids, e in zip(block, ends)], skip_special_tokens=False)
    found = {}
    for row, ids, end, text in zip(rows, block, ends, texts):
        if any(s in text for s in stops.stops):
            hits = stops.hits([ids[: k - start + 1] for k in range(first, end)])
            at = next((k for k, hit in zip(range(first, end), hits) if hit), None)
            if at is not None:
                found[row] = at + 1
    return found


def response_mask_for(responses: torch.Tensor, eos_ids: list[int], kept: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) response ids -> (B, T) mask: 1 up to and including the first eos, 0 after it; and 0 from
    position ``kept`` on where (B,) ``kept`` is given (the tokens a stop string left)."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device)).long()
    seen_before = is_eos.cumsum(-1) - is_eos
    mask = (seen_before == 0).long()
    if kept is not None:
        mask = mask * (torch.arange(responses.shape[1], device=responses.device) < kept[:, None]).long()
    return mask


class HFRollout:
    def __init__(self, cfg: RunConfig, actor: Actor, tokenizer):
        self.cfg = cfg
        self.actor = actor
        self.tokenizer = tokenizer
        eos = actor.module.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_ids = sorted({tokenizer.eos_token_id, *eos})
        self.stops = StopStrings(tokenizer, cfg.rollout.stop)
        self.reductions: dict[str, str] = {}  # single-turn generation has no metrics of its own

    def sync_weights(self) -> None:
        """The backend generates with the actor's own module: its weights are always current."""

    def take_metrics(self) -> dict[str, float]:
        """None of its own: a completion's metrics are the batch's (``experience.batch_metrics``)."""
        return {}

    def turn_ends(self) -> None:
        """One turn per completion: no per-turn rewards (a multi-turn rollout's)."""
        return None

    def reward_columns(self) -> dict[str, list]:
        """Nothing besides the completions: the reward function gets the dataset's columns."""
        return {}

    def scored(self, step: int, scores: torch.Tensor) -> None:
        """Nothing to keep: a single-turn completion's text and score are in the batch."""

    def forget_cache(self) -> None:
        """Nothing is cached across calls (the KV cache lives for one generation)."""

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        tok.truncation_side = "left"
        enc = tok(
            prompt_texts(tok, self.cfg.data, prompts),
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.cfg.data.max_prompt_length,
            add_special_tokens=not self.cfg.data.apply_chat_template,
        )
        return {k: v.to(self.actor.runtime.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    def decode(self, seqs: Sequences) -> list[str]:
        """The text each completion holds up to its eos, and before its first stop string (which is left
        out, as vLLM's include_stop_str_in_output=False). Special tokens other than eos stay in the text
        (a model that emits padding mid-answer is not shown a cleaned-up version to the reward)."""
        responses = seqs.responses.cpu()
        keep = seqs.response_mask.cpu().bool() & ~torch.isin(responses, torch.tensor(self.eos_ids))
        texts = [self.tokenizer.decode(ids[k].tolist(), skip_special_tokens=False) for ids, k in zip(responses, keep)]
        return [self.stops.cut_text(t) for t in texts] if self.stops else texts

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        keys: list[tuple[int, int]],
        step: int,
        temperature: float | None = None,
        columns: dict[str, list] | None = None,
    ) -> Sequences:
        """Sample a completion per (prompt, key) at ``temperature`` (rollout.temperature; 0: greedy),
        truncated by rollout.top_p/top_k/min_p and ended by rollout.stop. (``columns``, the prompts'
        rows, matter to a multi-turn rollout only.)"""
        enc = self.encode(prompts)
        seeds = [sample_seed(self.cfg.seed, step, p, s) for p, s in keys]
        r = self.cfg.rollout
        t = r.temperature if temperature is None else temperature
        sampler = sampler_for(r, seeds, t)
        module = self.actor.module
        was_training = module.training
        module.eval()
        try:
            with self.actor.full_parameters():
                responses, log_probs, kept = decode(
                    module,
                    enc["input_ids"],
                    enc["attention_mask"],
                    r.max_new_tokens,
                    self.eos_ids,
                    self.tokenizer.pad_token_id,
                    sampler,
                    self.stops,
                    cuda_graphs=r.cuda_graphs,
                )
        finally:
            module.train(was_training)
        prompt_len = enc["input_ids"].shape[1]
        response_mask = response_mask_for(responses, self.eos_ids, kept if self.stops else None)
        responses = responses.masked_fill(response_mask == 0, self.tokenizer.pad_token_id)
        input_ids = torch.cat([enc["input_ids"], responses], dim=1)
        attention_mask = torch.cat([enc["attention_mask"], response_mask], dim=1)
        log_probs = log_probs.masked_fill(response_mask == 0, 0.0)
        return Sequences(input_ids, attention_mask, response_mask, prompt_len, log_probs)
