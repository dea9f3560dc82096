"""The fused KV write (`csrc/kv_write.cpp`, pdkv.model.paged_decode.write_kv_fused) puts every
token's K and V exactly where the reference write (`pdkv.model.attention.write_kv`, indexed
assignment) does, for float32 and bfloat16, with K a strided view as the layers pass it; leaves
every other slot alone; refuses a slot outside the cache with the slot named; and hands
layouts it does not take to the reference write."""

from __future__ import annotations

import pytest
import torch

from pdkv.model.attention import write_kv
from pdkv.model.paged_decode import write_kv_fused
from pdkv.worker.attn_metadata import build_attention_metadata

pytestmark = pytest.mark.usefixtures("cpu_ops")

BLOCKS, BS, KVH, D, H = 9, 4, 2, 8, 4


def _meta(seqs: list[tuple[int, int, list[int]]], num_tokens: int):
    """seqs: (already cached, new tokens, block table) per request."""
    reqs, start = [], 0
    for cached, new, table in seqs:
        reqs.append((start, new, cached, table))
        start += new
    return build_attention_metadata(reqs, num_tokens, BS, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_cache_as_the_indexed_write(dtype):
    g = torch.Generator().manual_seed(0)
    # A prefill of 7 tokens into blocks 3, 5; a decode at position 9 of blocks 1, 0, 8.
    meta = _meta([(0, 7, [3, 5]), (9, 1, [1, 0, 8])], 8)
    qkv = torch.randn(8, (H + 2 * KVH) * D, generator=g).to(dtype)
    qk = qkv[:, : (H + KVH) * D].view(8, H + KVH, D)
    k = qk[:, H:]  # a view with token stride (H + 2 KVH) D, as the layer passes it
    v = qkv[:, (H + KVH) * D :].view(8, KVH, D)
    assert not k.is_contiguous()
    # The engine's layout: one block-major buffer [blocks, layers, 2, block_size, kvh, D] whose
    # per-layer [2, blocks, ...] views are not contiguous.
    buf = torch.randn(BLOCKS, 3, 2, BS, KVH, D, generator=g).to(dtype)
    ref_buf, got_buf = buf.clone(), buf.clone()
    ref, got, fill = (
        ref_buf[:, 1].transpose(0, 1),
        got_buf[:, 1].transpose(0, 1),
        buf[:, 1].transpose(0, 1),
    )
    assert not got.is_contiguous()
    write_kv(ref, k, v, meta)
    rk, rv = write_kv_fused(got, k, v, meta)
    assert rk is k and rv is v
    assert torch.equal(got_buf, ref_buf)  # the other layers untouched too
    assert torch.equal(got[0, 8, 1], k[7]) and torch.equal(
        got[1, 5, 2], v[6]
    )  # slots as the tables say
    untouched = torch.ones(BLOCKS, BS, dtype=torch.bool)
    untouched[3, :] = False
    untouched[5, :3] = False
    untouched[8, 1] = False
    assert torch.equal(got[:, untouched], fill[:, untouched])


def test_a_slot_outside_the_cache_is_refused_with_its_position():
    meta = _meta([(0, 2, [BLOCKS])], 2)  # block id one past the end
    cache = torch.zeros(2, BLOCKS, BS, KVH, D)
    with pytest.raises(
        RuntimeError,
        match=f"token 0 has slot \\(block {BLOCKS}, offset 0\\) outside {BLOCKS} blocks",
    ):
        write_kv_fused(cache, torch.ones(2, KVH, D), torch.ones(2, KVH, D), meta)
    assert not cache.any()


def test_mismatched_dtype_or_shape_is_refused():
    meta = _meta([(0, 2, [0])], 2)
    cache = torch.zeros(2, BLOCKS, BS, KVH, D)
    with pytest.raises(RuntimeError, match="k is BFloat16, the cache Float"):
        write_kv_fused(
            cache, torch.ones(2, KVH, D, dtype=torch.bfloat16), torch.ones(2, KVH, D), meta
        )
    with pytest.raises(RuntimeError, match="v must be"):
        write_kv_fused(cache, torch.ones(2, KVH, D), torch.ones(2, KVH + 1, D), meta)


def test_other_layouts_take_the_reference_write():
    meta = _meta([(0, 3, [2])], 3)
    k = torch.randn(KVH, 3, D).transpose(0, 1)  # heads not contiguous within a token
    v = torch.randn(3, KVH, D)
    ref, got = torch.zeros(2, BLOCKS, BS, KVH, D), torch.zeros(2, BLOCKS, BS, KVH, D)
    write_kv(ref, k, v, meta)
    write_kv_fused(got, k, v, meta)
    assert torch.equal(got, ref) and got.any()
