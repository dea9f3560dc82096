"""Quantized KV cache (issue 12, acceptance 3): the quantize / dequantize round trip stays within
its error bounds, the page layout is values then scales inside one contiguous block, and the
attention paths (SDPA and the DCP reference) read exactly the dequantized values."""

from __future__ import annotations

import pytest
import torch

from pdkv.cache.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    canonical_kv_cache_dtype,
)
from pdkv.config import CacheConfig
from pdkv.model.attention import paged_attention
from pdkv.model.attention_lse import ShardSeq, shard_attention
from pdkv.model.kv_quant import QMAX, QuantKVCache, dequantize, quantize
from pdkv.worker.attn_metadata import build_attention_metadata
from pdkv.worker.kv_cache import allocate_kv_cache

BS, H, D = 4, 2, 8
QUANT = ("int8", "fp8_e4m3")


def sample(shape: tuple[int, ...]) -> torch.Tensor:
    """Rows of very different magnitudes, an outlier per row, and an all-zero row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None, None]
    x[:, :, 3] *= 20
    x[1] = 0
    return x


@pytest.mark.parametrize("cache_dtype", QUANT)
def test_round_trip_error_is_within_the_bound(cache_dtype):
    x = sample((64, H, 128))
    data, scales = quantize(x, cache_dtype)
    assert (
        data.dtype == torch.uint8 and scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    )
    amax = x.abs().amax(-1)
    torch.testing.assert_close(scales, torch.where(amax > 0, amax / QMAX[cache_dtype], 1.0))
    err = (dequantize(data, scales, cache_dtype, torch.float32) - x).abs()
    s = scales[..., None]
    if cache_dtype == "int8":
        bound = s / 2 * (1 + 1e-5)  # half a step, float32 slack
    else:  # e4m3: half an ulp (relative 2^-4) for normals, half the subnormal spacing 2^-9
        bound = torch.maximum(x.abs() / 16, s * 2.0**-10) * (1 + 1e-5)
    assert (err <= bound).all(), float((err - bound).max())
    assert (err[1] == 0).all()  # zero rows come back exactly
    # The absmax element maps to ±qmax and comes back up to float32 rounding.
    top = x.abs().argmax(-1, keepdim=True)
    assert (
        data.view(torch.int8 if cache_dtype == "int8" else torch.float8_e4m3fn)
        .float()
        .abs()
        .gather(-1, top)[0]
        == QMAX[cache_dtype]
    ).all()
    torch.testing.assert_close(dequantize(data, scales, cache_dtype, torch.float32).gather(-1, top),
                               x.gather(-1, top), rtol=1e-6, atol=0)


def test_kv_cache_dtype_names():
    assert canonical_kv_cache_dtype("fp8", "float32") == "fp8_e4m3"
    assert (
        canonical_kv_cache_dtype("float32", "float32")
        == canonical_kv_cache_dtype("auto", "bfloat16")
        == "auto"
    )
    assert canonical_kv_cache_dtype("int8", "float32") == "int8"
    with pytest.raises(ValueError, match="'fp4'"):
        canonical_kv_cache_dtype("fp4", "float32")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(cache_dtype="fp4")


def quant_config(cache_dtype: str, num_blocks: int = 6, layers: int = 3) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BS, num_kv_heads=H, head_size=D, dtype="float32", cache_dtype=cache_dtype
    )
    return KVCacheConfig(
        num_blocks=num_blocks, groups=(KVCacheGroupSpec(tuple(range(layers)), spec),)
    )


@pytest.mark.parametrize("cache_dtype", QUANT)
def test_page_layout_is_values_then_scales_in_one_contiguous_block(cache_dtype):
    cfg = quant_config(cache_dtype)
    spec = cfg.groups[0].spec
    assert isinstance(spec, FullAttentionSpec)
    page = 2 * BS * H * D * 1 + 2 * BS * H * 4
    assert spec.page_size_bytes == page and cfg.block_bytes(0) == 3 * page
    plain = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype="float32")
    assert plain.page_size_bytes == 2 * BS * H * D * 4
    (group,), layers = allocate_kv_cache(cfg, torch.float32, torch.device("cpu"))
    assert group.dtype == torch.uint8 and group.shape == (6, 3, page) and group.is_contiguous()
    group.zero_()  # allocated with torch.empty: clear it so the write below is all that is non-zero
    x = sample((BS, H, D))
    blocks, offsets = torch.full((BS,), 4), torch.arange(BS)
    cache = layers[1]
    assert isinstance(cache, QuantKVCache) and cache.shape == (2, 6, BS, H, D)
    cache.write(1, blocks, offsets, x)  # V of layer 1, block 4
    data, scales = quantize(x, cache_dtype)
    raw = group[4].reshape(-1)  # the block: one run of bytes, layer after layer
    v_data = page + BS * H * D  # layer 1's page, after its K values
    assert torch.equal(raw[v_data : v_data + BS * H * D], data.reshape(-1))
    v_scales = page + 2 * BS * H * D + BS * H * 4
    assert torch.equal(
        raw[v_scales : v_scales + BS * H * 4].view(torch.float32), scales.reshape(-1)
    )
    assert int(group.count_nonzero()) == int(raw.count_nonzero())  # nothing outside block 4
    torch.testing.assert_close(
        cache.read(1, blocks, offsets), dequantize(data, scales, cache_dtype, torch.float32)
    )


@pytest.mark.parametrize("cache_dtype", QUANT)
def test_attention_reads_the_dequantized_values(cache_dtype):
    """paged_attention (prefill without and with context, decode) and shard_attention over a
    quantized cache equal the same calls over a plain cache holding the dequantized K/V."""
    g = torch.Generator().manual_seed(1)
    (groups, layers) = allocate_kv_cache(
        quant_config(cache_dtype, layers=1), torch.float32, torch.device("cpu")
    )
    groups[0].zero_()  # torch.empty: the last check compares every slot with the zeroed plain cache
    qcache = layers[0]
    assert isinstance(qcache, QuantKVCache)
    plain = torch.zeros(2, 6, BS, H, D)
    tables = [[0, 1, 2], [3, 4, 5]]
    ctx = 0
    for n in (5, 3, 1, 1):  # prefill 5, a chunk of 3 over that context, then two decodes
        t = 2 * n
        q, k, v = (torch.randn(t, hh, D, generator=g) for hh in (4, H, H))
        meta = build_attention_metadata(
            [(0, n, ctx, tables[0]), (n, n, ctx, tables[1])], t, BS, torch.device("cpu")
        )
        out_q = paged_attention(q, k, v, qcache, meta, D**-0.5)
        kd = dequantize(*quantize(k, cache_dtype), cache_dtype, torch.float32)
        vd = dequantize(*quantize(v, cache_dtype), cache_dtype, torch.float32)
        out_p = paged_attention(q, kd, vd, plain, meta, D**-0.5)
        torch.testing.assert_close(out_q, out_p, rtol=0, atol=1e-6)
        ctx += n
        seqs = [
            ShardSeq(
                i * n,
                (i + 1) * n,
                torch.arange(ctx - n, ctx),
                torch.tensor(tables[i]),
                torch.arange(ctx),
            )
            for i in range(2)
        ]
        oq, lq = shard_attention(q, qcache, seqs, D**-0.5)
        op, lp = shard_attention(q, plain, seqs, D**-0.5)
        torch.testing.assert_close(oq, op, rtol=0, atol=1e-6)
        torch.testing.assert_close(lq, lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(qcache.read(0, torch.arange(6)), plain[0], rtol=0, atol=0)
