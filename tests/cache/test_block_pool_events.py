"""KV cache events recorded by the block pool (pdkv/cache/block_pool.py): storing, evicting and
resetting the prefix cache produce BlockStored / BlockRemoved / AllBlocksCleared with the
prefix cache's own hashes and parents; the KV cache manager feeds them a request's tokens."""

from __future__ import annotations

from pdkv.block_hashing import hash_request_tokens
from pdkv.cache.block_pool import BlockPool
from pdkv.cache.kv_cache_manager import KVCacheManager
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams

BS = 4
TOKENS = list(range(100, 116))  # 4 full blocks
H = hash_request_tokens(TOKENS, BS)


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None)


def test_store_evict_reset() -> None:
    pool = BlockPool(4, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, H[:3], None, TOKENS[:12], BS)
    assert pool.take_events() == [stored(H[:3], None, TOKENS[:12])]
    assert pool.take_events() == []  # drained

    pool.free_blocks(reversed(blocks))  # tail first: blocks[2] is reused first
    pool.get_new_blocks(2)  # the never-cached block, then blocks[2]
    assert pool.take_events() == [BlockRemoved(block_hashes=[H[2]], medium="GPU")]

    pool.evict_hashes([blocks[0]])  # invalid content (a failed load)
    assert pool.take_events() == [BlockRemoved(block_hashes=[H[0]], medium="GPU")]
    pool.evict_hashes([blocks[0]])  # no longer indexed: nothing
    assert pool.take_events() == []

    pool.free_blocks([b for b in pool.blocks if b.ref_cnt])
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]


def test_runs_split_at_blocks_not_stored_now() -> None:
    """A block already indexed (same content held elsewhere) is not stored again: the runs on
    either side are separate events, each with the hash before it as parent."""
    pool = BlockPool(8, enable_kv_cache_events=True)
    first = pool.get_new_blocks(1)
    pool.cache_full_blocks(first, [H[1]], H[0], TOKENS[4:8], BS)
    pool.take_events()
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, H, None, TOKENS, BS)
    assert pool.take_events() == [
        stored([H[0]], None, TOKENS[0:4]),
        stored(H[2:4], H[1], TOKENS[8:16]),
    ]


def test_refused_reset_and_disabled_pool_record_nothing() -> None:
    pool = BlockPool(4, enable_kv_cache_events=True)
    held = pool.get_new_blocks(1)
    pool.cache_full_blocks(held, H[:1], None, TOKENS[:4], BS)
    pool.take_events()
    assert not pool.reset_prefix_cache()  # a block is in use: refused, no event
    assert pool.take_events() == []

    off = BlockPool(4)
    blocks = off.get_new_blocks(2)
    off.cache_full_blocks(blocks, H[:2], None, TOKENS[:8], BS)
    off.free_blocks(blocks)
    off.get_new_blocks(4)
    assert off.take_events() == []
    assert off.get_cached_block(H[0]) is None  # it did cache (then evicted) all the same


def test_manager_events_carry_the_requests_hashes_and_tokens() -> None:
    """Chunked prefill: the second chunk's BlockStored names the first chunk's last block as
    its parent; the hashes are the request's own (the ones prefix hits look up)."""
    groups = (KVCacheGroupSpec((0,), FullAttentionSpec(BS, num_kv_heads=1, head_size=4)),)
    mgr = KVCacheManager(KVCacheConfig(16, groups), True, 256, enable_kv_cache_events=True)
    req = Request("r", TOKENS + [7, 8], SamplingParams(max_tokens=4), BS)
    assert req.block_hashes == H
    assert mgr.allocate_slots(req, 8) is not None
    req.num_computed_tokens = 8
    assert mgr.allocate_slots(req, 10) is not None
    assert mgr.take_events() == [stored(H[:2], None, TOKENS[:8]), stored(H[2:], H[1], TOKENS[8:])]
    assert all(mgr.block_pools[0].get_cached_block(h) is not None for h in H)
    mgr.free(req)
    assert mgr.reset_prefix_cache()
    assert mgr.take_events() == [AllBlocksCleared()]
