"""Sampling noise from counters: the Gumbel noise of token position t of a sequence at vocabulary index v
is a pure function of (the sequence's seed, t, v), computed on the device that holds the logits.

Nothing of the vocabulary's size crosses between host and device: the (B,) row keys live on the device,
a step derives its keys from them and the step number, and every element's noise is an integer hash of
its row key and its vocabulary index (``lowbias32``, Chris Wellons' 32-bit finaliser, in wrapping int32
arithmetic with masked shifts, so the CPU and CUDA compute the same bits). The hash's 31 low bits, an odd
integer w in [1, 2^31), stand for the uniform 1 - u = w / 2^31; converting w to float32 (rounded to
nearest, the same on every device) and keeping the exponent and 11 mantissa bits indexes a fixed table
of Gumbel values, -log(-log(u)) at each bin's centre, computed once in float64 on the host. No device
``log`` is involved, so the noise is bit-identical on every device; the bins are relative (2^-11 of
1 - u), finest in the tail where the winning tokens' noise lies (up to about 21.5).

Sampling is then argmax(logits * (1 / T) + noise) (the temperature as a multiplication by its fp32
reciprocal, as the actor applies it: a division rounds differently on CUDA and the CPU), which draws
softmax(logits / T) exactly to the table's resolution. Because a row's noise depends on its own key
only, a sequence's tokens do not depend on which other sequences share its batch, nor on compaction
(``keep`` re-indexes the (B,) keys), and two processes sample the same tokens.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from rlctl.engine.rollout.sampling import truncate

_M32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B9  # 2^32 / phi: spreads consecutive counters over the word
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_BIN_SHIFT = 12  # float32 bits >> 12: sign, exponent and the top 11 mantissa bits
_FIRST_BIN = 0x3F800000 >> _BIN_SHIFT  # the bin of 1.0, the smallest w
_BINS = (0x4F000000 >> _BIN_SHIFT) - _FIRST_BIN + 1  # through 2^31, where float32 rounding may carry w
_ROW_BLOCK_ELEMENTS = 1 << 18  # on the CPU, rows are hashed a block at a time that stays in cache (one row of 152k)


def _i32(x: int) -> int:
    """The signed int32 with the bits of ``x`` mod 2^32 (torch has no uint32 arithmetic)."""
    x &= _M32
    return x - (1 << 32) if x >> 31 else x


def mix32_py(x: int) -> int:
    """lowbias32 on a Python int (mod 2^32): the reference that the tensor version must match."""
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL1) & _M32
    x ^= x >> 15
    x = (x * _MUL2) & _M32
    x ^= x >> 16
    return x


def mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """lowbias32 of an int32 tensor in place (wrapping products, logical shifts by masking the arithmetic
    ones), with ``tmp`` (same shape) as scratch: 11 passes, no allocation."""
    for shift, mul in ((16, _MUL1), (15, _MUL2), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mul is not None:
            x.mul_(_i32(mul))
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    return mix32_(x.clone(), torch.empty_like(x))


def row_keys(seeds: list[int], device) -> torch.Tensor:
    """(B,) int32 keys of 63-bit sequence seeds, both halves of each seed mixed in (host-side, once)."""
    keys = [mix32_py((s & _M32) ^ mix32_py((s >> 32) ^ _GOLDEN)) for s in seeds]
    return torch.tensor([_i32(k) for k in keys], dtype=torch.int32, device=device)


def bin_of(w: int) -> int:
    """The table index of an integer w in [1, 2^31]: its float32 bits (rounded to nearest even) >> 12."""
    return int(np.array([w], dtype=np.float32).view(np.int32)[0]) >> _BIN_SHIFT


def _first_int_of_bin(b: int) -> int:
    """The smallest integer w >= 1 whose float32 rounding lands in bin ``b`` (or above)."""
    f = float(np.array([b << _BIN_SHIFT], dtype=np.int32).view(np.float32)[0])
    if f <= 2**24:  # every integer up to here is exact
        return max(1, math.ceil(f))
    k = math.floor(math.log2(f))
    half_ulp = 2.0 ** (k - 25 if f == 2.0**k else k - 24)  # of the binade below f where f is a power of 2
    return math.ceil(f - half_ulp)  # f's mantissa is even (its low 12 bits are 0): a tie rounds up to it


def _first_ints_of_bins(bins: np.ndarray) -> np.ndarray:
    """``_first_int_of_bin`` of every bin of ``bins`` at once (int64), to the same integer: a float32 widened
    to float64, ``frexp`` (f = m 2^e, m in [0.5, 1): floor(log2 f) = e - 1, a power of two where m = 0.5),
    ``ldexp`` and f minus half an ulp are all exact in float64."""
    f = (bins.astype(np.int64) << _BIN_SHIFT).astype(np.int32).view(np.float32).astype(np.float64)
    mantissa, exponent = np.frexp(f)
    k = exponent - 1
    half_ulp = np.ldexp(1.0, np.where(mantissa == 0.5, k - 25, k - 24))
    return np.where(f <= 2**24, np.maximum(1.0, np.ceil(f)), np.ceil(f - half_ulp)).astype(np.int64)


@lru_cache(maxsize=1)
def gumbel_table() -> np.ndarray:
    """(_BINS,) float32 Gumbel values, one per bin of w: -log(-log(1 - w/2^31)) at the mean of the odd
    integers w in the bin (empty bins, which no w reaches, get 0). The bins' bounds are found for all bins
    at once; the logs are the standard library's, per bin, as every table before was made (the same bits)."""
    starts = np.append(_first_ints_of_bins(np.arange(_FIRST_BIN, _FIRST_BIN + _BINS)), 2**31 + 1)
    lo, hi = starts[:-1] | 1, starts[1:]  # the odd integers of each bin: [lo, hi)
    last = np.where((hi - 1) & 1, hi - 1, hi - 2)
    mean = ((lo + last) / 2 / 2**31).tolist()  # (exact: integers below 2^33, halved, over a power of two)
    table = np.zeros(_BINS, dtype=np.float64)
    filled = np.flatnonzero(lo < hi)
    table[filled] = [-math.log(-math.log1p(-mean[i])) for i in filled.tolist()]
    return table.astype(np.float32)


@lru_cache(maxsize=8)
def _device_tables(device: str, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gumbel table and the (V,) int32 vocabulary counters (v * golden, mod 2^32) on ``device``."""
    table = torch.from_numpy(gumbel_table()).to(device)
    counters = (torch.arange(vocab, dtype=torch.int64) * _GOLDEN) & _M32
    counters = torch.where(counters >= 2**31, counters - 2**32, counters).to(torch.int32)
    return table, counters.to(device)


def step_keys(keys: torch.Tensor, step: int) -> torch.Tensor:
    """(B,) int32 keys of position ``step`` of each row (on the keys' device; no host transfer)."""
    return mix32(keys + _i32((step + 1) * _GOLDEN))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) float32 Gumbel noise of rows with these (B,) step keys, on their device."""
    table, counters = _device_tables(str(keys.device), vocab)
    rows = keys.shape[0]
    out = torch.empty(rows, vocab, dtype=torch.float32, device=keys.device)
    block = rows if keys.device.type != "cpu" else max(1, _ROW_BLOCK_ELEMENTS // vocab)
    x = torch.empty(min(block, rows), vocab, dtype=torch.int32, device=keys.device)
    tmp = torch.empty_like(x)
    for start in range(0, rows, block):
        n = min(block, rows - start)
        xs, ts = x[:n], tmp[:n]
        torch.bitwise_xor(counters[None, :], keys[start : start + n, None], out=xs)
        mix32_(xs, ts)
        xs.bitwise_and_(0x7FFFFFFF).bitwise_or_(1)  # an odd w in [1, 2^31)
        index = xs.float().view(torch.int32)
        index.bitwise_right_shift_(_BIN_SHIFT).sub_(_FIRST_BIN)
        torch.index_select(table, 0, index.view(-1), out=out[start : start + n].view(-1))
    return out


def _noisy_argmax(
    scaled: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """(B,) argmax(scaled + gumbel_noise(keys)) in one functional expression (for a compiler to fuse into
    one pass over the (B, V) logits): the same integer steps, the same table, the same fp32 addition."""
    x = counters[None, :] ^ keys[:, None]
    for shift, mul in ((16, _MUL1), (15, _MUL2), (16, None)):
        x = x ^ ((x >> shift) & ((1 << (32 - shift)) - 1))
        if mul is not None:
            x = x * _i32(mul)
    w = (x & 0x7FFFFFFF) | 1
    index = (w.float().view(torch.int32) >> _BIN_SHIFT) - _FIRST_BIN
    return (table[index.long()] + scaled).argmax(-1)


@lru_cache(maxsize=1)
def fused_noisy_argmax():
    """On CUDA: ``_noisy_argmax`` compiled (TorchInductor, one fused kernel for any batch size); its tokens
    are the eager path's bit for bit (the GPU check compares them with the CPU's). None where Triton is
    missing: the eager path then runs, with the same tokens."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return torch.compile(_noisy_argmax, dynamic=True)


class CounterSampler:
    """Sampling at ``temperature`` (0: greedy) as argmax(logits * (1/T) + counter noise), one (B,) key per
    sequence from its seed; ``top_p``, ``top_k`` and ``min_p`` truncate the scaled logits first
    (``sampling.truncate``; nothing is touched when all are off). Every ``pick`` is the next position.
    ``check_every``: the decode steps between two looks of the host at the batch (``hf.decode``)."""

    check_every = 8

    def __init__(self, seeds: list[int], temperature: float, *, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0):
        self.seeds = list(seeds)
        self.temperature = temperature
        self.filters = {"top_p": top_p, "top_k": top_k, "min_p": min_p}
        self.step = 0
        self._keys: torch.Tensor | None = None  # (B,) int32 on the logits' device, made at the first pick
        self._rows: torch.Tensor | None = None  # positions kept so far, before the keys exist

    def scale(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) fp32 logits * (1 / T), the reciprocal rounded to fp32 (as the actor's log-probs); the
        logits themselves in fp32 when greedy."""
        logits = logits.float()
        return logits if self.temperature == 0 else logits * (1.0 / self.temperature)

    def keys(self, device) -> torch.Tensor:
        if self._keys is None:
            self._keys = row_keys(self.seeds, device)
            if self._rows is not None:
                self._keys = self._keys[self._rows.to(device)]
        return self._keys

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, V) logits of the next position -> ((B,) sampled tokens, (B, V) fp32 scaled logits, untruncated,
        for the log-probs)."""
        scaled, keys = self._next(logits)
        if keys is None:  # greedy: no noise drawn (no filter removes the most probable token)
            return scaled.argmax(-1), scaled
        truncated = truncate(scaled, **self.filters)
        fused = fused_noisy_argmax() if logits.is_cuda else None
        if fused is not None:
            return fused(truncated, keys, *reversed(_device_tables(str(keys.device), scaled.shape[-1]))), scaled
        return gumbel_noise(keys, scaled.shape[-1]).add_(truncated).argmax(-1), scaled

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        """As a transformers LogitsProcessor (greedy decoding then samples as ``pick``): the (B, V) scaled,
        truncated logits plus the next position's noise (the scaled logits alone when greedy)."""
        scaled, keys = self._next(scores)
        if keys is None:
            return scaled
        return gumbel_noise(keys, scaled.shape[-1]).add_(truncate(scaled, **self.filters))

    def _next(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next position's (B, V) scaled logits and (B,) step keys (None when greedy); the step advances."""
        step, self.step = self.step, self.step + 1
        keys = None if self.temperature == 0 else step_keys(self.keys(logits.device), step)
        return self.scale(logits), keys

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows (positions in the current batch, a device tensor), in this order."""
        if self._keys is not None:
            self._keys = self._keys[rows.to(self._keys.device)]
        else:
            self._rows = rows if self._rows is None else self._rows[rows]
