"""Which sliding-window blocks the KV pool stores per chunk and reads per hit, against a
brute-force definition (torch-free): a chunk stores the blocks meeting its tail window
[end_j - W + 1, end_j) and only blocks the window manager still holds; a hit of L tokens over F
local ones loads the blocks meeting [max(F, L - W + 1), L), each from a chunk that stored it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.pool_config import PoolConnectorConfig
from pdkv.kv_transfer.connector.pool_lookup import StoreLookup
from pdkv.kv_transfer.connector.pool_scheduler import PoolConnectorScheduler
from pdkv.kv_transfer.connector.spec import connector_spec
from pdkv.kvpool.keys import chunk_hashes, chunk_key
from pdkv.kvpool.store import KVPoolStore
from pdkv.kvpool.tiers.dram import DramTier
from pdkv.request import Request
from pdkv.sampling_params import SamplingParams

FP = "f" * 32
WIN = 1000  # window-group block id = WIN + block index (the full group: the index itself)

# (block size, chunk size, window): W - 1 < C, W - 1 == C, W - 1 > C (reaching 2-3 chunks back).
CASES = [
    (4, 8, 3),
    (4, 8, 5),
    (4, 8, 9),
    (4, 8, 10),
    (4, 16, 7),
    (4, 8, 17),
    (4, 8, 23),
    (2, 4, 11),
    (4, 4, 6),
    (4, 16, 40),
]


def stored(j: int, bs: int, c: int, w: int) -> list[int]:
    """Brute force: chunk j's blocks with a token in [end_j - W + 1, end_j)."""
    end = (j + 1) * c
    return [b for b in range(j * c // bs, end // bs)
            if any(end - w + 1 <= t < end for t in range(b * bs, (b + 1) * bs))]


def needed(f: int, hit_end: int, bs: int, w: int) -> list[int]:
    """Brute force: blocks with a token t, F <= t < L, that a query at L or later reads
    (t > L - W)."""
    return [b for b in range(f // bs, hit_end // bs)
            if any(f <= t < hit_end and t > hit_end - w for t in range(b * bs, (b + 1) * bs))]


def held(b: int, before: int, bs: int, w: int) -> bool:
    """Brute force of SlidingWindowManager.remove_skipped_blocks(before): freed once every token
    of the block is below before - W + 1."""
    return not all(t < before - w + 1 for t in range(b * bs, (b + 1) * bs))


def make(tier: DramTier, bs: int, c: int, w: int) -> PoolConnectorScheduler:
    cfg = connector_spec(KVTransferConfig(kv_connector="KVPoolConnector", kv_role="kv_both"), bs)
    return PoolConnectorScheduler(
        cfg, PoolConnectorConfig(chunk_size=c), StoreLookup(KVPoolStore([tier]), FP), bs, 2,
        (None, w)
    )


def request(n: int, bs: int) -> Request:
    return Request("r", list(range(100, 100 + n)), SamplingParams(max_tokens=1), bs)


def step(sched: PoolConnectorScheduler, req: Request, n: int, table: tuple[list[int], ...] | None):
    """One scheduler step of `n` tokens (a new request when `table` is given); the saves."""
    req.num_computed_tokens += n  # the scheduler advances it before build_connector_meta
    new = [SimpleNamespace(req_id="r", block_ids=table)] if table is not None else []
    cached = [] if table is not None else [SimpleNamespace(req_id="r", new_block_ids=([], []))]
    out = SimpleNamespace(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens={"r": n}
    )
    return sched.build_connector_meta(out).saves  # type: ignore[arg-type]


@pytest.mark.parametrize(("bs", "c", "w"), CASES)
@pytest.mark.parametrize("per_step", [1, 2, 3])  # blocks per prefill step
def test_each_chunk_stores_its_tail_window_while_every_block_of_it_is_held(bs, c, w, per_step):
    n = 6 * c + 1
    sched, req = make(DramTier(1 << 20), bs, c, w), request(n, bs)
    sched.on_new_request(req)
    nblocks = -(-n // bs)
    table = (list(range(nblocks)), [WIN + b for b in range(nblocks)])
    saved: dict[int, tuple[tuple[int, ...], ...]] = {}
    keys = [chunk_key(FP, h) for h in chunk_hashes(req.block_hashes, bs, c, 6 * c)]
    first = True
    while req.num_computed_tokens < n:
        before = req.num_computed_tokens
        k = min(per_step * bs, n - before)
        for spec in step(sched, req, k, table if first else None):
            for ref in spec.chunks:
                j = keys.index(chunk_key(FP, ref.chunk_hash))
                saved[j] = ref.block_ids
                assert all(
                    held(i - WIN, before, bs, w) for i in ref.block_ids[1]
                )  # never a freed block
        first = False
    assert sorted(saved) == list(range(6))
    for j, ids in saved.items():
        assert list(ids[0]) == list(range(j * c // bs, (j + 1) * c // bs))
        assert [i - WIN for i in ids[1]] == stored(j, bs, c, w)
        assert len(ids[1]) <= min(c // bs, -(-(w - 1) // bs) + 1)


@pytest.mark.parametrize(("bs", "c", "w"), CASES)
def test_a_local_hit_saves_only_the_chunks_whose_tail_window_is_still_held(bs, c, w):
    """Local prefix hits of F tokens: the window group holds only the window of F (null block 0
    before it); chunks of the hit whose tail lies below it are skipped, never read from id 0."""
    n, f = 6 * c + 1, 5 * c
    sched, req = make(DramTier(1 << 20), bs, c, w), request(n, bs)
    sched.on_new_request(req)
    nblocks = -(-n // bs)
    req.num_computed_tokens = f
    table = (list(range(nblocks)), [WIN + b if held(b, f, bs, w) else 0 for b in range(nblocks)])
    (spec,) = step(sched, req, n - f, table)
    keys = [chunk_key(FP, h) for h in chunk_hashes(req.block_hashes, bs, c, 6 * c)]
    got = {keys.index(chunk_key(FP, ref.chunk_hash)): [i - WIN for i in ref.block_ids[1]]
           for ref in spec.chunks}
    want = {
        j: stored(j, bs, c, w)
        for j in range(6)
        if all(held(b, f, bs, w) for b in stored(j, bs, c, w))
    }
    assert got == want and 5 in got


@pytest.mark.parametrize(("bs", "c", "w"), CASES)
@pytest.mark.parametrize("f_blocks", [0, 1, 3, 5, 9, 14])
@pytest.mark.parametrize("hit_chunks", [1, 2, 4])
def test_a_hit_loads_the_window_of_its_end_each_block_from_a_chunk_that_stored_it(
    bs, c, w, f_blocks, hit_chunks
):
    tier = DramTier(1 << 20)
    sched = make(tier, bs, c, w)
    f = f_blocks * bs
    first_chunk = f // c
    hit_end = (first_chunk + hit_chunks) * c  # F <= L, F > L - W + 1 included
    n = hit_end + 3
    req = request(n, bs)
    keys = [chunk_key(FP, h) for h in chunk_hashes(req.block_hashes, bs, c, hit_end)]
    for k in keys:
        tier.put(k, b"x")
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, f) == (hit_end - f, True)
    req.num_computed_tokens = f
    nnew = -(-n // bs) - f_blocks
    new = ([f_blocks + i for i in range(nnew)], [WIN + f_blocks + i for i in range(nnew)])
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: new), hit_end - f)  # type: ignore[arg-type]
    (spec,) = sched._to_load
    assert [chunk_key(FP, ref.chunk_hash) for ref in spec.chunks] == keys[first_chunk:]
    reads: dict[int, tuple[int, int]] = {}  # window block -> (chunk, index in its stored value)
    full: list[int] = []
    for ref in spec.chunks:
        j = keys.index(chunk_key(FP, ref.chunk_hash))
        full += list(ref.block_ids[0])
        assert ref.block_ids[0] and list(ref.block_ids[0]) == list(
            range(max(f_blocks, j * c // bs), (j + 1) * c // bs))[:len(ref.block_ids[0])]
        assert ref.first_blocks[0] == max(f_blocks, j * c // bs) - j * c // bs
        for i, b in enumerate(ref.block_ids[1]):
            reads[b - WIN] = (j, ref.first_blocks[1] + i)
    assert full == list(range(f_blocks, hit_end // bs))  # full attention: the whole hit
    want = needed(f, hit_end, bs, w)
    assert sorted(reads) == want
    for b, (j, index) in reads.items():
        assert j == b * bs // c and stored(j, bs, c, w)[index] == b
    assert len(want) <= -(-(w - 1) // bs) + 1
