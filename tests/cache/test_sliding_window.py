"""Sliding-window KV cache groups: early free, the null block, per-window prefix hits
(pdkv/cache/single_type_manager.py SlidingWindowManager, block_pool.py, kv_cache_manager.py)."""

from __future__ import annotations

import random

import pytest

from pdkv.cache.block_pool import BlockPool
from pdkv.cache.kv_cache_manager import KVCacheManager
from pdkv.cache.single_type_manager import SlidingWindowManager, cdiv
from pdkv.cache.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams
from pdkv.sched.kv_connector_state import KVConnectorState


def swa(bs: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(bs, num_kv_heads=1, head_size=4, sliding_window=window)


def full(bs: int) -> FullAttentionSpec:
    return FullAttentionSpec(bs, num_kv_heads=1, head_size=4)


def make_manager(specs: list[KVCacheSpec], num_blocks: int = 256) -> KVCacheManager:
    groups = tuple(KVCacheGroupSpec((i,), s) for i, s in enumerate(specs))
    return KVCacheManager(KVCacheConfig(num_blocks, groups), True, 1 << 16)


def make_request(rid: str, n: int, bs: int, seed: int = 0) -> Request:
    tokens = [(seed * 7919 + i * 31) % 1000 for i in range(n)]
    return Request(rid, tokens, SamplingParams(max_tokens=4), bs)


def run_chunks(mgr: KVCacheManager, req: Request, chunk: int, check=None) -> None:
    """Prefill the request in chunks (scheduler order: allocate, then the step computes)."""
    while req.num_computed_tokens < req.num_tokens:
        k = min(chunk, req.num_tokens - req.num_computed_tokens)
        new = mgr.allocate_slots(req, k)
        assert new is not None
        assert not any(b.is_null for group in new.blocks for b in group)
        if check is not None:
            check(req.num_computed_tokens, k)
        req.num_computed_tokens += k


def held(mgr: KVCacheManager, req: Request, g: int) -> list[int]:
    """Indices in the request's table of group g that hold a real block."""
    return [i for i, b in enumerate(mgr.managers[g].req_to_blocks.get(req.request_id, []))
            if not b.is_null]


def assert_pools_full(mgr: KVCacheManager) -> None:
    for pool in mgr.block_pools:
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert pool.num_used_blocks == 0
        if pool.null_block is not None:
            assert pool.null_block.ref_cnt == 0 and pool.null_block.block_hash is None
            assert pool.null_block.block_id not in pool._free


# ------------------------------------------------------------------------------ null block
def test_null_block_is_reserved_only_for_sliding_window_groups():
    mgr = make_manager([full(4), swa(4, 6)], num_blocks=10)
    dense, window = mgr.block_pools
    assert dense.null_block is None and dense.num_free_blocks == 10
    assert window.null_block is not None and window.null_block.block_id == 0
    assert window.num_free_blocks == 9 and window.usage == 0.0
    assert make_manager([full(4)], num_blocks=10).block_pools[0].num_free_blocks == 10


def test_null_block_is_never_handed_out_touched_freed_or_cached():
    pool = BlockPool(4, reserve_null_block=True)
    null = pool.null_block
    assert null is not None
    got = pool.get_new_blocks(3)
    assert null not in got and pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.touch([null])
    pool.free_blocks([null, null])
    pool.cache_block(null, b"h")
    assert null.ref_cnt == 0 and null.block_hash is None and pool.get_cached_block(b"h") is None
    pool.free_blocks(got)
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 0
    with pytest.raises(ValueError):
        BlockPool(1, reserve_null_block=True)


# ----------------------------------------------------------------------- remove_skipped_blocks
@pytest.mark.parametrize("bs", [1, 4, 5])
def test_request_holds_exactly_the_window_and_the_new_tokens(bs):
    rng = random.Random(bs)
    for window in [1, 2, 3, bs - 1, bs, bs + 1, 2 * bs, 2 * bs + 3, 11]:
        if window < 1:
            continue
        mgr = make_manager([full(bs), swa(bs, window)])
        req = make_request("a", rng.randint(1, 60), bs, seed=window)

        while req.num_computed_tokens < req.num_tokens:
            c = req.num_computed_tokens
            k = min(rng.randint(1, 9), req.num_tokens - c)
            assert mgr.allocate_slots(req, k) is not None
            # Kept: blocks intersecting [c - W + 1, c + k), i.e. not ending at or before c - W + 1.
            want = [i for i in range(cdiv(c + k, bs)) if (i + 1) * bs > c - window + 1]
            assert held(mgr, req, 1) == want, (bs, window, c, k)
            assert len(mgr.get_block_ids("a")[1]) == cdiv(c + k, bs)
            assert held(mgr, req, 0) == list(range(cdiv(c + k, bs)))  # full keeps all
            req.num_computed_tokens += k
        mgr.free(req)
        assert_pools_full(mgr)


def test_full_attention_remove_skipped_blocks_is_a_no_op():
    mgr = make_manager([full(4)])
    req = make_request("a", 40, 4)
    run_chunks(mgr, req, 16)
    mgr.managers[0].remove_skipped_blocks("a", 40)
    assert held(mgr, req, 0) == list(range(10))


def test_chunked_long_request_holds_a_bounded_number_of_blocks_and_leaks_none():
    bs, window, chunk = 4, 10, 16
    bound = cdiv(window - 1, bs) + 1 + cdiv(chunk, bs)
    # 500 tokens need 125 blocks; the sliding-window pool has 12 usable ones.
    mgr = make_manager([swa(bs, window)], num_blocks=13)
    req = make_request("a", 500, bs)
    most = 0

    def check(c: int, k: int) -> None:
        nonlocal most
        most = max(most, len(held(mgr, req, 0)))
        assert all(not b.is_null for b in mgr.managers[0].req_to_blocks["a"][-cdiv(k, bs):])

    run_chunks(mgr, req, chunk, check)
    assert most <= bound
    assert mgr.num_blocks_freed_early == 125 - len(held(mgr, req, 0))
    pool = mgr.block_pools[0]
    assert pool.null_block is not None and pool.null_block.block_hash is None
    mgr.free(req)
    assert_pools_full(mgr)


def test_preemption_frees_everything_and_the_request_runs_again():
    mgr = make_manager([full(4), swa(4, 5)], num_blocks=40)
    req = make_request("a", 60, 4)
    run_chunks(mgr, req, 16)
    mgr.free(req)  # what the scheduler's _preempt does, then num_computed_tokens = 0
    req.num_computed_tokens = 0
    assert_pools_full(mgr)
    run_chunks(mgr, req, 7)
    mgr.free(req)
    mgr.free(req)  # idempotent
    assert_pools_full(mgr)


# ------------------------------------------------------------------------------- hit search
def brute_hit(cached: list[bool], bs: int, window: int, max_length: int) -> int:
    """Largest L (multiple of bs, <= max_length) whose blocks holding [L - W + 1, L) are all
    cached."""
    best = 0
    for nb in range(min(max_length // bs, len(cached)) + 1):
        end = nb * bs
        first = max(0, end - window + 1)
        if all(cached[i] for i in range(nb) if (i + 1) * bs > first):
            best = end
    return best


def fill_pool(pool: BlockPool, hashes: list[bytes], cached: list[bool]) -> None:
    """Put the cached blocks' hashes in the pool's index, all free (evictable)."""
    for h, c in zip(hashes, cached):
        if c:
            (b,) = pool.get_new_blocks(1)
            pool.cache_block(b, h)
            pool.free_blocks([b])


def test_hit_search_matches_the_brute_force_definition():
    rng = random.Random(0)
    for trial in range(400):
        bs = rng.choice([1, 2, 4, 5])
        window = rng.randint(1, 20)
        n = rng.randint(0, 14)
        cached = [rng.random() < 0.7 for _ in range(n)]
        hashes = [bytes([trial % 256, i]) for i in range(n)]
        pool = BlockPool(n + 2, reserve_null_block=True)
        fill_pool(pool, hashes, cached)
        mgr = SlidingWindowManager(swa(bs, window), pool, 0)
        max_length = rng.randint(0, n * bs + bs)
        hit = mgr.find_longest_cache_hit(hashes, max_length)
        want = brute_hit(cached, bs, window, max_length)
        assert len(hit) * bs == want, (bs, window, cached, max_length, hit)
        first = max(0, want - window + 1) // bs
        assert all(b is pool.null_block for b in hit[:first])
        assert [b.block_hash for b in hit[first:]] == hashes[first:len(hit)]


def test_hybrid_hit_is_the_longest_length_every_group_can_give():
    rng = random.Random(1)
    bs = 4
    for _ in range(150):
        windows = rng.sample([2, 5, 8, 13], rng.randint(1, 2))
        mgr = make_manager([full(bs)] + [swa(bs, w) for w in windows], num_blocks=20)
        req = make_request("q", rng.randint(1, 64), bs, seed=rng.randint(0, 99))
        n = len(req.block_hashes)
        masks = [[rng.random() < (0.9 if g == 0 else 0.6) for _ in range(n)]
                 for g in range(len(windows) + 1)]
        for pool, mask in zip(mgr.block_pools, masks):
            fill_pool(pool, req.block_hashes, mask)
        cap = req.num_tokens - 1
        want = max(
            nb * bs
            for nb in range(cap // bs + 1)
            if all(masks[0][:nb])
            and all(
                brute_hit(m[:nb], bs, w, nb * bs) == nb * bs for m, w in zip(masks[1:], windows)
            )
        )
        hits, num_hit = mgr.get_computed_blocks(req)
        assert num_hit == want
        assert all(len(h) * bs == want for h in hits.blocks)
        assert [b.block_hash for b in hits.blocks[0]] == req.block_hashes[: want // bs]
        for h, w in zip(hits.blocks[1:], windows):  # null before the window, its blocks after
            first = max(0, want - w + 1) // bs
            assert [b.is_null for b in h] == [i < first for i in range(want // bs)]
            assert [b.block_hash for b in h[first:]] == req.block_hashes[first: want // bs]


def test_second_request_hits_the_prefix_but_holds_only_the_window():
    bs, window = 4, 10
    mgr = make_manager([full(bs), swa(bs, window)], num_blocks=40)
    a = make_request("a", 50, bs)
    run_chunks(mgr, a, 16)
    swa_ids_a = mgr.get_block_ids("a")[1]
    mgr.free(a)
    b = make_request("b", 50, bs)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 48  # n - 1 = 49, whole blocks
    full_hit, swa_hit = hits.blocks
    assert len(full_hit) == len(swa_hit) == 12
    assert not any(x.is_null for x in full_hit)
    # The query at 48 reads 39..48: blocks 9, 10, 11 (and block 12, computed anew).
    assert [i for i, x in enumerate(swa_hit) if not x.is_null] == [9, 10, 11]
    assert [x.block_id for x in swa_hit[9:]] == swa_ids_a[9:12]
    free_before = mgr.block_pools[1].num_free_blocks
    # What admission checks: null entries cost nothing, the three evictable hits and one new do.
    assert mgr.managers[1].get_num_blocks_to_allocate("b", 50, swa_hit) == 4
    assert mgr.allocate_slots(b, 2, hits, num_hit) is not None
    # Three window hits taken from the free queue plus one new block for tokens 48, 49.
    assert mgr.block_pools[1].num_free_blocks == free_before - 4
    assert held(mgr, b, 1) == [9, 10, 11, 12]
    assert all(x.ref_cnt == 1 for x in swa_hit[9:])
    mgr.free(b)
    assert_pools_full(mgr)


# ------------------------------------------------------------------------ external KV loads
def test_finished_load_caches_only_the_sliding_window_blocks_inside_the_window():
    bs, window, n = 4, 6, 40
    mgr = make_manager([full(bs), swa(bs, window)], num_blocks=20)
    state = KVConnectorState(mgr, None, "recompute")
    req = make_request("d", n, bs)
    assert mgr.allocate_slots(req, 0, None, 0, num_external_computed_tokens=n) is not None
    state.start_load(req, n)
    state.finished_recving.add("d")
    to_resume, failed = state.resolve_finished_loads()
    assert to_resume == [req] and not failed
    assert req.num_computed_tokens == n - 1
    # The query at 39 reads 34..39 and a later prefix hit of 36 tokens reads 31..35: blocks
    # 7, 8 and 9 were loaded (the window of the block boundary before the resume position),
    # 0..6 hold garbage.
    full_pool, swa_pool = mgr.block_pools
    assert all(full_pool.get_cached_block(h) is not None for h in req.block_hashes)
    cached = [i for i, h in enumerate(req.block_hashes) if swa_pool.get_cached_block(h)]
    assert cached == [7, 8, 9]
    assert held(mgr, req, 1) == [7, 8, 9]
    assert swa_pool.null_block is not None and swa_pool.null_block.block_hash is None
    mgr.free(req)
    assert_pools_full(mgr)


def test_stats_count_blocks_freed_early():
    mgr = make_manager([full(4), swa(4, 5), swa(4, 9)], num_blocks=40)
    req = make_request("a", 41, 4)
    run_chunks(mgr, req, 16)  # last allocation at 32: skipped < 28 and < 24
    assert mgr.num_blocks_freed_early == 7 + 6
