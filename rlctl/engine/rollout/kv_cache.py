"""The KV caches of the HF rollout's decode loop (``hf.decode``): the dynamic one, and a static one in
batch-size buckets whose step CUDA may replay as a graph; and attention over grouped KV heads that does not
repeat them.

``DynamicKV`` is transformers' ``DynamicCache``, grown by a concatenation every token, finished rows dropped
once an eighth of the rows are done: the generator sampler's decode (always: its runs resume bit for bit)
and the counter sampler's on the CPU.

``StaticKV`` is preallocated to the prompt + max_new_tokens columns (transformers' ``StaticCache``, filled
from the prompt's dynamic cache after the prefill). It holds a bucket of rows: the running rows first, then
filler rows (copies of the first running row, whose logits are never read). Compaction moves the running
rows to the smallest bucket that holds them (``bucket_for``: the batch, then 2^k or 3 * 2^(k-1) rows) once
that bucket is smaller, so compaction still saves compute and a decode has few shapes. Its step is device
work only, on its own buffers: the (b, 1) positions advance, the cache's cursor column joins the
(b, 1, 1, L) boolean mask, and the model writes that column's keys and values. On CUDA with
rollout.cuda_graphs, each bucket's step is captured as a CUDA graph after two eager steps on a side stream
(the steps' real work: nothing is computed twice) and replayed for the rest of the bucket's steps: the same
kernels on the same buffers, so the same bits.

``grouped_attention`` (on during the counter sampler's decode steps): transformers' SDPA path repeats the KV
heads (``repeat_kv``) whenever it is given a mask, because torch's ``enable_gqa`` runs on CUDA only in the
flash and math kernels and flash takes no mask. Here a one-token query's heads that share a KV head become
the query rows of that KV head, (B, H, 1, D) -> (B, H_kv, H / H_kv, D), which every SDPA backend computes
with the (B, 1, 1, L) mask broadcast over them: the same attention without the copy, equal to transformers'
within rounding (tests/unit/test_static_kv.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlctl.engine.model import logits_to_keep

GROUPED = "rlctl_grouped_sdpa"  # the attention implementation's name while a decode steps
ALIGN = 16  # a static cache's columns, rounded up (the mask's last dimension for CUDA's memory-efficient kernel)
WARMUP_STEPS = 2  # eager steps of a bucket on a side stream before its CUDA graph is captured


def grouped_attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' SDPA attention (``sdpa_attention_forward``), except for a one-token query over grouped
    KV heads: (B, H, 1, D) query, (B, H_kv, L, D) keys and values, a (B, 1, 1, L) mask or none -> the
    (B, 1, H, D) output, query head h reading KV head h // (H / H_kv) as ``repeat_kv`` arranges them."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    if length != 1 or groups == 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    rows = query.reshape(batch, key.shape[1], groups, dim)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED, grouped_attention_forward)
AttentionMaskInterface.register(GROUPED, sdpa_mask)  # its masks are SDPA's


@contextlib.contextmanager
def grouped_attention(model):
    """The model's attention is ``grouped_attention_forward`` inside (where it is SDPA over grouped KV
    heads; anything else is left as it is), as it was after."""
    config = model.config
    before = config._attn_implementation
    groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    if before != "sdpa" or groups == 1:
        yield
        return
    config._attn_implementation = GROUPED
    try:
        yield
    finally:
        config._attn_implementation = before


def bucket_for(live: int, batch: int) -> int:
    """The bucket of ``live`` running rows: the smallest 2^k or 3 * 2^(k-1) that holds them, at most ``batch``
    (the whole batch is the first bucket). At most two sizes an octave: a batch of 512 has 18 below it."""
    power = 1 << max(0, live - 1).bit_length()
    three = 3 * power // 4
    return min(batch, three if power >= 4 and three >= live else power)


def eighth_done(live: int, rows: int) -> bool:
    """The dynamic cache's compaction rule: once an eighth of the rows are done."""
    gone = rows - live
    return gone > 0 and gone * 8 >= rows


def static_fits(model) -> bool:
    """Whether ``StaticKV`` serves this model: SDPA attention (its boolean masks) and every layer one of
    transformers' plain ``StaticLayer`` (no sliding window, no linear attention)."""
    if model.config._attn_implementation not in ("sdpa", GROUPED):
        return False
    return all(type(layer) is StaticLayer for layer in StaticCache(config=model.config, max_cache_len=1).layers)


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The (B, P) left-padded prompts' forward into a new DynamicCache, position ids counting real tokens only
    (as the actor's forward): (the cache, the (B, V) logits of the next token, the (B, 1) last positions)."""
    cache = DynamicCache()
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        **logits_to_keep(model, 1),
    )
    return cache, out.logits[:, -1, :], positions[:, -1:]


class DynamicKV:
    """transformers' DynamicCache as the decode loop grows it: the rows' 2D mask and positions beside it."""

    def __init__(self, model, cache: DynamicCache, attention_mask: torch.Tensor, position: torch.Tensor):
        self.model, self.cache, self.attention_mask, self.position = model, cache, attention_mask, position

    def worth(self, live: int, rows: int) -> bool:
        return eighth_done(live, rows)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows (positions in the current rows), in this order."""
        self.cache.batch_select_indices(rows)
        self.attention_mask, self.position = self.attention_mask[rows], self.position[rows]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows' (B,) last tokens -> the (B, V) logits of their next position."""
        self.attention_mask = torch.cat([self.attention_mask, torch.ones_like(self.attention_mask[:, :1])], dim=1)
        self.position = self.position + 1
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.attention_mask,
            position_ids=self.position,
            past_key_values=self.cache,
            use_cache=True,
        )
        return out.logits[:, -1, :]


def static_cache(model, layers: list, index: torch.Tensor | None, length: int, filled: int) -> StaticCache:
    """A StaticCache of ``length`` columns holding the first ``filled`` columns of each layer's (keys, values)
    in ``layers`` ((B, H_kv, >= filled, D) each), their rows ``index`` (all where None), its cursor at ``filled``."""
    cache = StaticCache(config=model.config, max_cache_len=length)
    for layer, (keys, values) in zip(cache.layers, layers, strict=True):
        keys, values = keys[:, :, :filled], values[:, :, :filled]
        if index is not None:
            keys, values = keys[index], values[index]
        layer.lazy_initialization(keys, values)
        layer.keys[:, :, :filled].copy_(keys)
        layer.values[:, :, :filled].copy_(values)
        layer.cumulative_length.fill_(filled)
    return cache


class StaticKV:
    """A static KV cache of a bucket of rows (``live`` running rows first, then filler) on buffers that its
    step only changes in place, so that CUDA can replay the step as a graph (``graphs``; ignored on the CPU)."""

    def __init__(
        self, model, cache: StaticCache, mask: torch.Tensor, position: torch.Tensor, filled: int, graphs: bool
    ):
        self.model, self.filled, self.graphs = model, filled, graphs and mask.is_cuda
        self._hold(cache, mask, position, torch.zeros_like(position), mask.shape[0])

    @classmethod
    def after_prefill(cls, model, prompt: DynamicCache, attention_mask, position, new_tokens: int, graphs: bool):
        """The prompts' DynamicCache (from ``prefill``) and (B, P) mask in a static cache with room for
        ``new_tokens`` more columns (rounded up to ``ALIGN``)."""
        batch, filled = attention_mask.shape
        length = -(-(filled + new_tokens) // ALIGN) * ALIGN
        mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device=attention_mask.device)
        mask[:, 0, 0, :filled] = attention_mask.bool()
        cache = static_cache(model, [(layer.keys, layer.values) for layer in prompt.layers], None, length, filled)
        return cls(model, cache, mask, position, filled, graphs)

    def _hold(self, cache: StaticCache, mask, position, tokens, live: int) -> None:
        self.cache, self.mask, self.position, self.tokens, self.live = cache, mask, position, tokens, live
        self.size = mask.shape[0]
        self.cursor = cache.layers[0].cumulative_length.view(1)  # the column the next step writes
        self.graph, self.logits, self.warm = None, None, 0

    def worth(self, live: int, rows: int) -> bool:
        """Whether ``live`` running rows (of ``rows``) fit a smaller bucket."""
        return bucket_for(live, self.size) < self.size

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these running rows (positions among the running ones), in this order, in the bucket that
        holds them: their keys, values, mask and positions copied into a new static cache, filler after them."""
        live = len(rows)
        size = bucket_for(live, self.size)
        index = torch.cat([rows, rows[:1].expand(size - live)])
        layers = [(layer.keys, layer.values) for layer in self.cache.layers]
        cache = static_cache(self.model, layers, index, self.mask.shape[-1], self.filled)
        self._hold(cache, self.mask[index], self.position[index], self.tokens[index], live)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The running rows' (live,) last tokens -> the (live, V) logits of their next position."""
        self.tokens[: self.live, 0].copy_(tokens)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        elif not self.graphs:
            logits = self._step()
        elif self.warm < WARMUP_STEPS:
            self.warm += 1
            logits = on_side_stream(self._step)
        else:
            self.graph, self.logits = captured(self._step)
            self.graph.replay()
            logits = self.logits
        self.filled += 1
        return logits[: self.live, -1, :]

    def _step(self) -> torch.Tensor:
        """One forward of the bucket's rows on its buffers (what a graph captures) -> (size, 1, V) logits."""
        self.position.add_(1)
        self.mask.index_fill_(3, self.cursor, True)
        with grouped_attention(self.model):
            out = self.model(
                input_ids=self.tokens,
                attention_mask=self.mask,
                position_ids=self.position,
                past_key_values=self.cache,
                use_cache=True,
            )
        return out.logits


def on_side_stream(step):
    """``step()`` on a side stream, as torch asks of the steps before a capture; its result for the current
    stream."""
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = step()
    current.wait_stream(side)
    out.record_stream(current)
    return out


def captured(step) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``step`` captured as a CUDA graph (not run: ``replay`` runs it) and its output buffer. Only this
    thread's calls may not disturb the capture (``thread_local``): a rollout generating ahead captures while
    the training thread goes on with its own work on its own streams."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step()
    return graph, out


def decode_kv(model, input_ids, attention_mask, new_tokens: int, *, static: bool, graphs: bool):
    """The prompts' prefill and the KV cache its decode goes on with (the counter sampler's): a ``StaticKV``
    where ``static`` (``graphs``: CUDA graphs of its steps), else a ``DynamicKV`` whose steps use
    ``grouped_attention``. -> (the cache, the (B, V) logits of the first new token)."""
    if static and not static_fits(model):
        raise ValueError(
            f"the static KV cache does not serve this model ({type(model).__name__}): it needs SDPA "
            "attention and full-attention layers only"
        )
    cache, logits, position = prefill(model, input_ids, attention_mask)
    if static:
        return StaticKV.after_prefill(model, cache, attention_mask, position, new_tokens, graphs), logits
    return GroupedDynamicKV(model, cache, attention_mask, position), logits


class GroupedDynamicKV(DynamicKV):
    """The dynamic cache whose decode steps attend over grouped KV heads without repeating them."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with grouped_attention(self.model):
            return super().forward(tokens)
