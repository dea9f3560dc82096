"""The KV pool's rank lookup (issue 31): a chunk is present only when every rank's store holds
its shard under that rank's namespace; a chunk some ranks hold is counted as a rank miss; a rank
that does not answer makes the lookup a miss at its deadline (counted); late answers to an
earlier lookup are ignored. Real ZeroMQ sockets on loopback, real stores (dram tier)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdkv.kv_transfer.connector.pool_lookup import PoolLookupServer, RankLookup
from pdkv.kvpool.keys import chunk_key
from pdkv.kvpool.store import KVPoolStore
from pdkv.kvpool.tiers.dram import DramTier

FPS = ("a" * 32, "b" * 32)  # two ranks' namespaces
H = [bytes([i]) * 32 for i in range(4)]


@pytest.fixture
def ranks() -> Iterator[tuple[list[KVPoolStore], list[PoolLookupServer]]]:
    stores = [KVPoolStore([DramTier(1 << 20)]) for _ in FPS]
    servers = [PoolLookupServer(s, fp) for s, fp in zip(stores, FPS)]
    yield stores, servers
    for server, store in zip(servers, stores):
        server.close()
        store.close()


def put(store: KVPoolStore, fp: str, h: bytes) -> None:
    store.tiers[0].put(chunk_key(fp, h), b"x")


def test_a_chunk_is_present_only_when_every_rank_holds_its_shard(ranks):
    stores, servers = ranks
    for h in H[:3]:
        put(stores[0], FPS[0], h)
    for h in (H[0], H[2], H[3]):
        put(stores[1], FPS[1], h)
    # Rank 1's copy of H[1] under rank 0's namespace does not count for rank 1.
    put(stores[1], FPS[0], H[1])
    lookup = RankLookup([s.address for s in servers], timeout_s=10.0)
    try:
        assert lookup.contains(H) == [True, False, True, False]
        assert lookup.take_stats() == {"pool:all:rank_misses": 2.0,
                                       "pool:all:rank_lookup_timeouts": 0.0}
        assert lookup.take_stats() == {}
        assert lookup.contains([]) == []
    finally:
        lookup.close()
    assert lookup.contains(H) == [False] * 4  # closed: misses, never an error


def test_a_silent_rank_makes_the_lookup_a_miss_at_its_deadline(ranks):
    stores, servers = ranks
    for store, fp in zip(stores, FPS):
        put(store, fp, H[0])
    servers[1].close()  # rank 1 stops answering
    lookup = RankLookup([s.address for s in servers], timeout_s=0.5)
    try:
        t0 = time.monotonic()
        assert lookup.contains(H[:1]) == [False]
        assert time.monotonic() - t0 >= 0.5
        assert lookup.take_stats() == {"pool:all:rank_lookup_timeouts": 1.0,
                                       "pool:all:rank_misses": 0.0}
    finally:
        lookup.close()


def test_late_answers_of_a_timed_out_lookup_are_ignored(ranks, monkeypatch):
    stores, servers = ranks
    for store, fp in zip(stores, FPS):
        put(store, fp, H[0])
    slow = servers[1]
    answer = slow._answer
    calls = []

    def delayed(payload: bytes):  # the first answer of rank 1 comes after the deadline
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.8)
        return answer(payload)

    monkeypatch.setattr(slow, "_answer", delayed)
    lookup = RankLookup([s.address for s in servers], timeout_s=0.3)
    try:
        assert lookup.contains(H[:2]) == [False, False]  # timed out
        lookup.timeout_s = 10.0
        # The next lookup must not take the late reply (2 answers) as its own (1 answer).
        assert lookup.contains(H[:1]) == [True]
    finally:
        lookup.close()
