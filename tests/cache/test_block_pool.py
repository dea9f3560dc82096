"""Ref-counted blocks, LRU free queue and prefix-cache index (pdkv/cache/block_pool.py)."""

from __future__ import annotations

import pytest

from pdkv.block_hashing import hash_block_tokens
from pdkv.cache.block_pool import BlockPool


def h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def free_order(pool: BlockPool) -> list[int]:
    """Block ids in free-queue order (head = next to be allocated)."""
    return list(pool._free)


def check_invariants(pool: BlockPool) -> None:
    free_ids = set(pool._free)
    for b in pool.blocks:
        assert (b.ref_cnt == 0) == (b.block_id in free_ids)
        assert b.ref_cnt >= 0
        if b.block_hash is not None:
            assert pool.get_cached_block(b.block_hash) is b
    assert pool.num_free_blocks == len(free_ids)


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocation_pops_head_in_lru_order():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(3 / 5)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    check_invariants(pool)


def test_freed_blocks_go_to_the_tail_in_the_given_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0, 1, 2; free queue: 3, 4, 5
    pool.free_blocks([a[2], a[0]])
    assert free_order(pool) == [3, 4, 5, 2, 0]
    pool.free_blocks([a[1]])
    assert free_order(pool) == [3, 4, 5, 2, 0, 1]
    # Allocation takes from the head: the least recently freed first.
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [3, 4, 5, 2, 0]
    check_invariants(pool)


def test_too_many_blocks_raises_without_changing_anything():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    check_invariants(pool)


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])
    assert pool.num_free_blocks == 2
    # A never-allocated block cannot be freed either.
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[1]])


def test_shared_block_is_free_only_after_the_last_reference():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h(1))
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 3
    check_invariants(pool)


def test_cached_free_block_stays_hittable_until_reallocated_then_is_evicted():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.free_blocks([a, b])
    # Free, but still in the index.
    assert pool.get_cached_block(h(1)) is a
    assert pool.get_cached_block(h(2)) is b
    assert pool.num_evictions == 0
    (got,) = pool.get_new_blocks(1)
    assert got is a
    assert a.block_hash is None
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(2)) is b
    assert pool.num_evictions == 1
    check_invariants(pool)


def test_touch_of_free_cached_block_removes_it_from_the_free_queue():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_block(blocks[1], h(7))
    pool.free_blocks(blocks)
    assert free_order(pool) == [0, 1, 2]
    hit = pool.get_cached_block(h(7))
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_order(pool) == [0, 2]
    assert pool.num_free_blocks == 2
    # Allocating everything that is free must not hand out (or evict) the touched block.
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [0, 2]
    assert pool.get_cached_block(h(7)) is hit
    assert hit.block_hash == h(7)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    check_invariants(pool)


def test_touch_of_used_block_only_adds_a_reference():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    assert pool.num_free_blocks == 1


def test_cache_block_keeps_the_first_block_for_a_duplicate_hash():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(1))
    assert pool.get_cached_block(h(1)) is a
    assert b.block_hash is None
    # Re-caching a block that already has a hash keeps its first hash.
    pool.cache_block(a, h(2))
    assert a.block_hash == h(1)
    assert pool.get_cached_block(h(2)) is None
    # Freeing and reallocating the duplicate does not evict the original's entry.
    pool.free_blocks([b])
    got = pool.get_new_blocks(2)
    assert b in got
    assert pool.get_cached_block(h(1)) is a
    assert pool.num_evictions == 0
    check_invariants(pool)


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h(1))
    assert b.block_hash is None
    assert pool.get_cached_block(h(1)) is None


def test_evict_hashes_drops_index_entries():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.evict_hashes([a])
    assert a.block_hash is None
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(2)) is b
    assert pool.num_evictions == 1
    # Evicting an uncached block is a no-op.
    pool.evict_hashes([a])
    assert pool.num_evictions == 1


def test_num_free_blocks_bookkeeping_over_a_mixed_sequence():
    pool = BlockPool(8)
    x = pool.get_new_blocks(3)
    y = pool.get_new_blocks(2)
    assert pool.num_free_blocks == 3
    pool.cache_block(x[0], h(0))
    pool.touch([x[0]])  # shared by y's owner
    pool.free_blocks(reversed(x))
    assert pool.num_free_blocks == 5  # x[0] still held once
    pool.free_blocks(y)
    assert pool.num_free_blocks == 7
    pool.free_blocks([x[0]])
    assert pool.num_free_blocks == 8
    assert pool.usage == 0.0
    check_invariants(pool)


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    # Nothing was forgotten.
    assert pool.get_cached_block(h(1)) is a
    assert pool.get_cached_block(h(2)) is b
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(2)) is None
    assert all(blk.block_hash is None for blk in pool.blocks)
    assert pool.num_free_blocks == 3
    check_invariants(pool)
