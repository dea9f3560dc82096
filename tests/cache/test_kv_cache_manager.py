"""Block tables, prefix hits and freeing (pdkv/cache/kv_cache_manager.py,
single_type_manager.py)."""

from __future__ import annotations

import pytest

from pdkv.cache.kv_cache_manager import KVCacheManager
from pdkv.cache.single_type_manager import cdiv
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams

BS = 16


def make_manager(
    num_blocks: int = 16,
    enable_caching: bool = True,
    max_model_len: int = 4096,
    num_groups: int = 1,
) -> KVCacheManager:
    groups = tuple(
        KVCacheGroupSpec((i,), FullAttentionSpec(BS, num_kv_heads=2, head_size=4))
        for i in range(num_groups)
    )
    return KVCacheManager(KVCacheConfig(num_blocks, groups), enable_caching, max_model_len)


def make_request(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), BS, cache_salt=cache_salt)


def admit(mgr: KVCacheManager, req: Request, num_new: int | None = None):
    """Schedule a waiting request the way the scheduler does (prefix lookup, then allocate),
    and mark its scheduled tokens computed. Returns (new blocks, hit tokens)."""
    hits, num_hit = mgr.get_computed_blocks(req)
    if num_new is None:
        num_new = req.num_tokens - num_hit
    req.num_computed_tokens = 0
    new = mgr.allocate_slots(req, num_new, hits, num_hit)
    assert new is not None
    req.num_computed_tokens = num_hit + num_new
    return new, num_hit


def ids(mgr: KVCacheManager, req: Request) -> list[int]:
    return mgr.get_block_ids(req.request_id)[0]


def test_cdiv():
    assert [cdiv(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 100])
def test_allocate_slots_uses_ceil_division(n):
    mgr = make_manager(num_blocks=16)
    req = make_request("r", list(range(n)))
    new = mgr.allocate_slots(req, n)
    assert new is not None
    assert len(new) == cdiv(n, BS)
    assert len(ids(mgr, req)) == cdiv(n, BS)
    assert new.get_block_ids() == (ids(mgr, req),)
    assert mgr.num_free_blocks == 16 - cdiv(n, BS)


def test_block_table_grows_one_block_at_a_time_during_decode():
    mgr = make_manager(num_blocks=8)
    req = make_request("r", list(range(10)))
    first = mgr.allocate_slots(req, 10)
    assert first is not None and len(first) == 1
    req.num_computed_tokens = 10
    table = ids(mgr, req)
    for tok in range(6):  # tokens 10..15 still fit in block 0
        req.append_output_token_ids([100 + tok])
        new = mgr.allocate_slots(req, 1)
        assert new is not None and len(new) == 0
        req.num_computed_tokens += 1
    assert ids(mgr, req) == table
    req.append_output_token_ids([200])  # token 16 starts block 1
    new = mgr.allocate_slots(req, 1)
    assert new is not None and len(new) == 1
    assert ids(mgr, req) == table + new.get_block_ids()[0]
    assert mgr.num_free_blocks == 6


def test_chunked_allocation_matches_one_shot_allocation():
    mgr = make_manager(num_blocks=8)
    req = make_request("r", list(range(50)))
    sizes = []
    for chunk in (7, 9, 20, 14):
        new = mgr.allocate_slots(req, chunk)
        assert new is not None
        sizes.append(len(new))
        req.num_computed_tokens += chunk
    # 7 -> 1 block, 16 -> 1, 36 -> 3, 50 -> 4
    assert sizes == [1, 0, 2, 1]
    assert len(ids(mgr, req)) == 4


def test_allocation_is_capped_at_max_model_len():
    mgr = make_manager(num_blocks=8, max_model_len=20)
    req = make_request("r", list(range(20)))
    new = mgr.allocate_slots(req, 60)
    assert new is not None and len(new) == 2


def test_returns_none_and_changes_nothing_when_pool_is_too_small():
    mgr = make_manager(num_blocks=4)
    a = make_request("a", list(range(40)))
    admit(mgr, a)  # 3 blocks
    a_ids = ids(mgr, a)
    refs = [b.ref_cnt for b in mgr.block_pools[0].blocks]
    hashes = [b.block_hash for b in mgr.block_pools[0].blocks]
    b = make_request("b", list(range(1000, 1033)))  # needs 3 blocks, 1 free
    assert mgr.allocate_slots(b, 33) is None
    assert mgr.num_free_blocks == 1
    assert ids(mgr, b) == []
    assert ids(mgr, a) == a_ids
    assert [blk.ref_cnt for blk in mgr.block_pools[0].blocks] == refs
    assert [blk.block_hash for blk in mgr.block_pools[0].blocks] == hashes
    # Exactly what fits still works.
    assert mgr.allocate_slots(b, 16) is not None
    assert mgr.num_free_blocks == 0


def test_none_with_prefix_hits_takes_no_reference_on_them():
    mgr = make_manager(num_blocks=3)
    a = make_request("a", list(range(33)))
    admit(mgr, a)  # 3 blocks, blocks 0 and 1 cached
    b = make_request("b", list(range(33)) + list(range(900, 920)))  # 53 tokens: 4 blocks
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 32
    refs = [blk.ref_cnt for blk in hits.blocks[0]]
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) is None
    assert [blk.ref_cnt for blk in hits.blocks[0]] == refs
    assert ids(mgr, b) == []


def test_prefix_hit_after_blocks_were_cached_is_capped_below_num_tokens():
    mgr = make_manager(num_blocks=16)
    prompt = list(range(100, 132))  # 32 tokens = 2 full blocks
    a = make_request("a", prompt)
    _, a_hit = admit(mgr, a)
    assert a_hit == 0

    # Same 32-token prompt: the last token must be computed, so only 1 block hits.
    b = make_request("b", prompt)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16
    assert hits.get_block_ids() == ([ids(mgr, a)[0]],)

    # One more token: both blocks hit.
    c = make_request("c", prompt + [7])
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 32
    assert hits.get_block_ids() == (ids(mgr, a)[:2],)

    # Diverging inside block 1: only block 0 hits; diverging in block 0: nothing.
    d = make_request("d", prompt[:20] + [1] * 20)
    assert mgr.get_computed_blocks(d)[1] == 16
    e = make_request("e", [1] + prompt[1:] + [7])
    assert mgr.get_computed_blocks(e)[1] == 0

    # A hit shorter than one block is no hit.
    f = make_request("f", prompt[:10])
    assert mgr.get_computed_blocks(f)[1] == 0


def test_get_computed_blocks_is_side_effect_free():
    mgr = make_manager(num_blocks=8)
    prompt = list(range(48))
    a = make_request("a", prompt)
    admit(mgr, a)
    mgr.free(a)
    free_before = mgr.num_free_blocks
    refs_before = [blk.ref_cnt for blk in mgr.block_pools[0].blocks]
    b = make_request("b", prompt + [1])
    first = mgr.get_computed_blocks(b)
    second = mgr.get_computed_blocks(b)
    assert first[1] == second[1] == 48
    assert first[0].get_block_ids() == second[0].get_block_ids()
    assert mgr.num_free_blocks == free_before
    assert [blk.ref_cnt for blk in mgr.block_pools[0].blocks] == refs_before


def test_only_scheduled_full_blocks_are_cached():
    mgr = make_manager(num_blocks=8)
    prompt = list(range(40))
    a = make_request("a", prompt)
    admit(mgr, a, num_new=10)  # first chunk: no full block yet
    b = make_request("b", prompt)
    assert mgr.get_computed_blocks(b)[1] == 0
    new = mgr.allocate_slots(a, 22)  # tokens 10..31 -> blocks 0 and 1 full
    assert new is not None
    a.num_computed_tokens = 32
    assert mgr.get_computed_blocks(b)[1] == 32


def test_prefix_hit_is_attached_and_shared():
    mgr = make_manager(num_blocks=8)
    prompt = list(range(40))
    a = make_request("a", prompt)
    admit(mgr, a)
    a_ids = ids(mgr, a)
    b = make_request("b", prompt[:32] + [5, 6, 7])
    free_before = mgr.num_free_blocks
    new, num_hit = admit(mgr, b)
    assert num_hit == 32
    assert b.num_computed_tokens == 35
    assert ids(mgr, b)[:2] == a_ids[:2]
    assert len(new) == 1 and new.get_block_ids()[0] == ids(mgr, b)[2:]
    assert new.get_block_ids()[0][0] not in a_ids
    assert mgr.num_free_blocks == free_before - 1
    pool = mgr.block_pools[0]
    assert [pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]
    # Freeing one owner keeps the shared blocks held by the other.
    mgr.free(a)
    assert [pool.blocks[i].ref_cnt for i in ids(mgr, b)] == [1, 1, 1]
    mgr.free(b)
    assert mgr.num_free_blocks == 8


def test_free_but_cached_hit_counts_toward_blocks_to_allocate():
    mgr = make_manager(num_blocks=4)
    prompt = list(range(33))
    a = make_request("a", prompt)
    admit(mgr, a)  # blocks 0, 1 (cached), 2 (partial)
    cached_ids = ids(mgr, a)[:2]
    mgr.free(a)
    c = make_request("c", list(range(500, 517)))
    admit(mgr, c)  # 2 blocks: the never-used block 3 and a's uncached tail block
    assert mgr.num_free_blocks == 2  # exactly the two cached blocks of a

    b = make_request("b", prompt)  # 33 tokens: 3 blocks
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 32
    assert hits.get_block_ids() == (cached_ids,)
    assert all(blk.ref_cnt == 0 for blk in hits.blocks[0])
    manager = mgr.managers[0]
    # 1 new block + 2 hits that would leave the free queue.
    assert manager.get_num_blocks_to_allocate("b", 33, hits.blocks[0]) == 3
    assert mgr.allocate_slots(b, 1, hits, num_hit) is None
    assert mgr.num_free_blocks == 2
    assert all(blk.ref_cnt == 0 for blk in hits.blocks[0])

    # Once c is gone there is room: the hits are reused, not recomputed.
    mgr.free(c)
    new = mgr.allocate_slots(b, 1, hits, num_hit)
    assert new is not None and len(new) == 1
    assert ids(mgr, b)[:2] == cached_ids
    # The cached blocks kept their hashes (touched, not popped and evicted).
    assert mgr.block_pools[0].num_evictions == 0


def test_hit_on_blocks_held_by_a_running_request_costs_nothing_extra():
    mgr = make_manager(num_blocks=4)
    prompt = list(range(33))
    a = make_request("a", prompt)
    admit(mgr, a)  # 3 blocks held
    b = make_request("b", prompt)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 32
    assert mgr.managers[0].get_num_blocks_to_allocate("b", 33, hits.blocks[0]) == 1
    assert mgr.allocate_slots(b, 1, hits, num_hit) is not None
    assert mgr.num_free_blocks == 0


def test_free_returns_every_block_and_is_idempotent():
    mgr = make_manager(num_blocks=10)
    start = mgr.num_free_blocks
    reqs = [make_request(f"r{i}", list(range(i * 100, i * 100 + 20 + 7 * i))) for i in range(3)]
    for r in reqs:
        admit(mgr, r)
    assert mgr.num_free_blocks < start
    for r in reqs:
        mgr.free(r)
        assert ids(mgr, r) == []
    assert mgr.num_free_blocks == start
    mgr.free(reqs[0])  # second free is a no-op, not a double free
    assert mgr.num_free_blocks == start
    assert all(b.ref_cnt == 0 for b in mgr.block_pools[0].blocks)
    assert mgr.usage == 0.0


def test_free_puts_tail_blocks_first_in_line_for_eviction():
    mgr = make_manager(num_blocks=3)
    a = make_request("a", list(range(48)))
    admit(mgr, a)
    a_ids = ids(mgr, a)
    mgr.free(a)
    # Allocation pops the head of the LRU queue: a's last block first.
    b = make_request("b", list(range(1000, 1016)))
    new = mgr.allocate_slots(b, 16)
    assert new is not None and new.get_block_ids() == ([a_ids[2]],)
    # Blocks 0 and 1 of a are still hits.
    c = make_request("c", list(range(48)) + [1])
    assert mgr.get_computed_blocks(c)[1] == 32


def test_output_tokens_completing_a_block_become_hits():
    mgr = make_manager(num_blocks=8)
    a = make_request("a", list(range(30)))
    admit(mgr, a)
    for t in (70, 71):  # tokens 30 and 31 complete block 1
        a.append_output_token_ids([t])
        assert mgr.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    b = make_request("b", list(range(30)) + [70, 71, 5])
    assert mgr.get_computed_blocks(b)[1] == 32


def test_cache_salt_isolates_hits():
    mgr = make_manager(num_blocks=16)
    prompt = list(range(40))
    a = make_request("a", prompt, cache_salt="tenant-a")
    admit(mgr, a)
    assert mgr.get_computed_blocks(make_request("b", prompt, cache_salt="tenant-b"))[1] == 0
    assert mgr.get_computed_blocks(make_request("c", prompt))[1] == 0
    assert mgr.get_computed_blocks(make_request("d", prompt, cache_salt="tenant-a"))[1] == 32
    # And the other way round: unsalted blocks are not visible to a salted request.
    e = make_request("e", list(range(200, 240)))
    admit(mgr, e)
    assert mgr.get_computed_blocks(make_request("f", list(range(200, 240))))[1] == 32
    assert mgr.get_computed_blocks(make_request("g", list(range(200, 240)), "s"))[1] == 0


def test_prefix_caching_disabled_gives_no_hits():
    mgr = make_manager(num_blocks=8, enable_caching=False)
    prompt = list(range(40))
    a = make_request("a", prompt)
    admit(mgr, a)
    hits, num_hit = mgr.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 0 and len(hits) == 0
    assert all(b.block_hash is None for b in mgr.block_pools[0].blocks)
    mgr.record_prefix_lookup(40, 0)
    assert mgr.prefix_cache_stats.requests == 0
    assert mgr.prefix_cache_stats.queries == 0


def test_record_prefix_lookup_accumulates_stats():
    mgr = make_manager()
    stats = mgr.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    mgr.record_prefix_lookup(40, 32)
    mgr.record_prefix_lookup(10, 0)
    assert (stats.requests, stats.queries, stats.hits) == (2, 50, 32)


def test_reset_prefix_cache_refuses_while_a_request_holds_blocks():
    mgr = make_manager(num_blocks=8)
    prompt = list(range(40))
    a = make_request("a", prompt)
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    assert mgr.get_computed_blocks(make_request("b", prompt))[1] == 32
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("c", prompt))[1] == 0


def test_two_groups_get_one_block_table_each():
    mgr = make_manager(num_blocks=6, num_groups=2)
    prompt = list(range(40))
    a = make_request("a", prompt)
    new, _ = admit(mgr, a)
    assert len(new.blocks) == 2
    assert [len(t) for t in mgr.get_block_ids("a")] == [3, 3]
    assert mgr.num_free_blocks == 3
    hits, num_hit = mgr.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 32
    assert [len(g) for g in hits.blocks] == [2, 2]
    mgr.free(a)
    assert all(p.num_free_blocks == 6 for p in mgr.block_pools)


def test_groups_with_different_block_sizes_are_rejected():
    groups = (
        KVCacheGroupSpec((0,), FullAttentionSpec(16)),
        KVCacheGroupSpec((1,), FullAttentionSpec(32)),
    )
    with pytest.raises(ValueError):
        KVCacheManager(KVCacheConfig(4, groups), True, 128)


def test_hit_stops_at_the_first_missing_block():
    mgr = make_manager(num_blocks=8)
    prompt = list(range(49))
    a = make_request("a", prompt)
    admit(mgr, a)  # blocks 0..2 cached, block 3 partial
    assert mgr.get_computed_blocks(make_request("b", prompt))[1] == 48
    # Block 1's content becomes invalid: blocks 2.. are unreachable even though cached.
    pool = mgr.block_pools[0]
    pool.evict_hashes([pool.blocks[ids(mgr, a)[1]]])
    hits, num_hit = mgr.get_computed_blocks(make_request("c", prompt))
    assert num_hit == 16
    assert hits.get_block_ids() == ([ids(mgr, a)[0]],)


def test_hit_with_two_groups_is_the_common_prefix():
    mgr = make_manager(num_blocks=8, num_groups=2)
    prompt = list(range(49))
    a = make_request("a", prompt)
    admit(mgr, a)
    table1 = mgr.get_block_ids("a")[1]
    pool1 = mgr.block_pools[1]
    pool1.evict_hashes([pool1.blocks[table1[2]]])  # group 1 lost block 2
    hits, num_hit = mgr.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 32
    assert [len(g) for g in hits.blocks] == [2, 2]


def test_reset_prefix_cache_turns_a_hit_into_a_miss_and_keeps_the_free_blocks():
    mgr = make_manager(num_blocks=8, num_groups=2)
    prompt = list(range(40))
    a = make_request("a", prompt)
    admit(mgr, a)
    mgr.free(a)
    assert mgr.get_computed_blocks(make_request("b", prompt))[1] == 32  # hit
    free_before = [p.num_free_blocks for p in mgr.block_pools]
    assert free_before == [8, 8]
    assert mgr.reset_prefix_cache() is True
    assert [p.num_free_blocks for p in mgr.block_pools] == free_before
    assert all(blk.block_hash is None for p in mgr.block_pools for blk in p.blocks)
    c = make_request("c", prompt)
    assert mgr.get_computed_blocks(c)[1] == 0  # miss
    admit(mgr, c)  # the freed blocks are allocatable as before
    assert mgr.num_free_blocks == 8 - 3
    mgr.free(c)
    assert mgr.num_free_blocks == 8


def test_reset_prefix_cache_changes_nothing_while_blocks_are_in_use():
    mgr = make_manager(num_blocks=12, num_groups=2)
    running, done = list(range(40)), list(range(100, 140))
    a = make_request("a", running)
    admit(mgr, a)
    d = make_request("d", done)
    admit(mgr, d)
    mgr.free(d)  # cached and free
    table = mgr.get_block_ids("a")
    free = mgr.num_free_blocks
    assert mgr.reset_prefix_cache() is False
    # vLLM's semantics: all or nothing; the free blocks keep their hashes too.
    assert mgr.get_block_ids("a") == table
    assert mgr.num_free_blocks == free
    assert mgr.get_computed_blocks(make_request("x", running))[1] == 32
    assert mgr.get_computed_blocks(make_request("y", done))[1] == 32
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("x", running))[1] == 0
    assert mgr.num_free_blocks == 12


def test_reset_prefix_cache_is_all_or_nothing_across_groups():
    mgr = make_manager(num_blocks=8, num_groups=2)
    prompt = list(range(40))
    a = make_request("a", prompt)
    admit(mgr, a)
    mgr.free(a)
    held = mgr.block_pools[1].get_new_blocks(1)  # only the second group has a block in use
    assert mgr.reset_prefix_cache() is False
    assert mgr.get_computed_blocks(make_request("b", prompt))[1] == 32
    mgr.block_pools[1].free_blocks(held)
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("b", prompt))[1] == 0
