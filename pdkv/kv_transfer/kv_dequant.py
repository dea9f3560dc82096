"""Dequantize-on-arrival of P/D: a quantized producer's blocks (kv_cache_dtype int8 / fp8_e4m3:
per layer 1-byte K/V values, then float32 scales per (token, head); pdkv/model/kv_quant.py) are
read whole into a staging buffer and written into an unquantized consumer's blocks as
value × scale in the consumer's dtype, exactly what the producer's attention read from its
cache (lossless with respect to the producer's KV)."""

from __future__ import annotations

import torch

from pdkv.model.kv_quant import dequantize
from pdkv.model.loader import TORCH_DTYPES


def dequantize_blocks(
    staged: memoryview,
    dest: memoryview,
    dest_block_ids: list[int],
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype: str,
    dtype: str,
) -> None:
    """Write the staged quantized blocks (in order) into `dest`'s blocks `dest_block_ids`.

    Args:
        staged: len(dest_block_ids) quantized blocks, each layers × page bytes, page =
            2·bs·H·D values + 2·bs·H·4 scale bytes.
        dest: the consumer group's whole region: blocks of layers × 2·bs·H·D elements of `dtype`
            ([layers, 2, bs, H, D] per block).
        cache_dtype: the producer's "int8" or "fp8_e4m3"; dtype: the consumer's model dtype name.

    Raises:
        ValueError: the staged bytes are not whole quantized blocks of that shape.
    """
    n = len(dest_block_ids)
    values = 2 * block_size * num_kv_heads * head_size
    page = values + 2 * block_size * num_kv_heads * 4
    if n == 0:
        return
    layers, rest = divmod(len(staged), n * page)
    if rest or layers == 0:
        raise ValueError(
            f"{len(staged)} staged bytes are not {n} quantized blocks of {page}-byte pages"
        )
    src = torch.frombuffer(staged, dtype=torch.uint8).view(n, layers, page)
    data = src[:, :, :values].reshape(n, layers, 2, block_size, num_kv_heads, head_size)
    scales = (
        src[:, :, values:]
        .contiguous()
        .view(torch.float32)
        .view(n, layers, 2, block_size, num_kv_heads)
    )
    torch_dtype = TORCH_DTYPES[dtype]
    out = torch.frombuffer(dest, dtype=torch.uint8).view(torch_dtype)
    out = out.view(-1, layers, 2, block_size, num_kv_heads, head_size)
    out[torch.tensor(dest_block_ids, dtype=torch.long)] = dequantize(
        data, scales, cache_dtype, torch_dtype
    )
