"""Quantized KV cache (`--kv-cache-dtype int8 | fp8 | fp8_e4m3`): per-(token, head) scales.

Formula (symmetric absmax quantization per token and KV head, the per-token scheme of
LLM.int8() / SmoothQuant applied to K and V; e4m3's largest finite value 448 is
`torch.finfo(torch.float8_e4m3fn).max`, the format vLLM's `--kv-cache-dtype fp8` stores):
    scale[t, h] = max_d |x[t, h, d]| / qmax            (float32; 1.0 where the row is all 0)
    q[t, h, d]  = round(x / scale) clamped to ±127      (int8, qmax = 127)
                  (x / scale) cast to float8_e4m3fn     (fp8, qmax = 448, round-to-nearest)
    x'[t, h, d] = q * scale                              (dequantized, in the compute dtype)
Error bounds (tests/model/test_kv_quant.py): int8 |x − x'| <= scale / 2 = amax / 254;
e4m3 (3 mantissa bits) |x − x'| <= max(|x| / 16, scale · 2^-10) (normals: half an ulp,
relative 2^-4; subnormals: half the spacing 2^-9).

Page layout (docs/ARCHITECTURE.md "Quantized KV cache"): one block of one layer is one run of
bytes: data [2, block_size, num_kv_heads, head_size] (1 byte each: K then V), then scales
[2, block_size, num_kv_heads] float32; the group tensor is raw bytes [num_blocks, layers,
page_bytes] (pdkv.worker.kv_cache.allocate_kv_cache), so P/D, the pool and offload move a block
(data and scales) with one copy, like the plain layout.

Attention (reference path): the write path quantizes the step's K/V into their slots and hands
back their dequantized values, and every read dequantizes what it gathers, so a query always
sees exactly the values stored in the cache, whether they were computed in this step, loaded by
a connector, or hit in the prefix cache (P/D and pool outputs then equal colocated ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANT_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
"""Canonical quantized KV cache dtypes and the torch type of their stored values."""

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
"""Largest magnitude a stored value takes: int8 symmetric 127; e4m3 torch.finfo().max = 448."""

_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23


def quantize(x: torch.Tensor, cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows of the last dimension with one absmax scale each.

    Args:
        x: [..., head_size] K or V (any float dtype).
        cache_dtype: "int8" or "fp8_e4m3".

    Returns:
        (data [..., head_size] uint8 holding the int8 / e4m3 bit patterns, scales [...] float32).

    Raises:
        KeyError: an unknown cache_dtype.
    """
    qmax = QMAX[cache_dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale[..., None]
    if cache_dtype == "int8":
        # Round to nearest even: |y| <= 127, so adding and removing 1.5 * 2^23 leaves y rounded
        # to an integer in float32 (what torch.round gives; much faster on a busy CPU).
        q = ((y.clamp_(-qmax, qmax) + _ROUND_MAGIC) - _ROUND_MAGIC).to(torch.int8)
    else:
        q = y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def dequantize(
    data: torch.Tensor, scales: torch.Tensor, cache_dtype: str, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize`: data [..., D] uint8, scales [...] float32 -> [..., D] in `dtype`."""
    return (data.view(QUANT_DTYPES[cache_dtype]).float() * scales[..., None]).to(dtype)


@dataclass
class QuantKVCache:
    """One layer's quantized KV cache: typed views into its group's raw byte pages.

    Attributes:
        data: [2, num_blocks, block_size, num_kv_heads, head_size] uint8 (0 = K, 1 = V).
        scales: [2, num_blocks, block_size, num_kv_heads] float32.
        cache_dtype: "int8" or "fp8_e4m3".
        compute_dtype: the model dtype attention computes in (reads dequantize to it).
    """

    data: torch.Tensor
    scales: torch.Tensor
    cache_dtype: str
    compute_dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """The logical shape [2, num_blocks, block_size, num_kv_heads, head_size]."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def write(
        self, kv: int, blocks: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        """Quantize x [T, H, D] into slots (blocks[i], offsets[i]) of K (kv 0) or V (kv 1);
        returns the dequantized values (what a later read of those slots gives), [T, H, D]."""
        q, s = quantize(x, self.cache_dtype)
        self.data[kv, blocks, offsets] = q
        self.scales[kv, blocks, offsets] = s
        return dequantize(q, s, self.cache_dtype, self.compute_dtype)

    def read(self, kv: int, *index: torch.Tensor) -> torch.Tensor:
        """Dequantized K (kv 0) or V (kv 1) at `index` (as plain indexing of a [2, N, bs, H, D]
        cache after its first dimension), in compute_dtype."""
        return dequantize(
            self.data[(kv, *index)], self.scales[(kv, *index)], self.cache_dtype, self.compute_dtype
        )


KVCacheLayer = torch.Tensor | QuantKVCache
"""A layer's KV cache: a plain [2, num_blocks, block_size, H, D] tensor or a QuantKVCache."""


def store_kv(kv_cache: KVCacheLayer, blocks: torch.Tensor, offsets: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k, v [T, H, D] into their slots; returns the values a read of them gives (k, v
    themselves for a plain cache, their dequantized values for a quantized one)."""
    if isinstance(kv_cache, QuantKVCache):
        return kv_cache.write(0, blocks, offsets, k), kv_cache.write(1, blocks, offsets, v)
    kv_cache[0, blocks, offsets] = k
    kv_cache[1, blocks, offsets] = v
    return k, v


def read_kv(kv_cache: KVCacheLayer, kv: int, *index: torch.Tensor) -> torch.Tensor:
    """K (kv 0) or V (kv 1) of a layer's cache at `index`, in the compute dtype."""
    if isinstance(kv_cache, QuantKVCache):
        return kv_cache.read(kv, *index)
    return kv_cache[(kv, *index)]
