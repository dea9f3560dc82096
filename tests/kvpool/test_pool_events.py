"""KV events of the pool tiers (pdkv.kvpool.events): what each tier reports when it stores and
drops chunks, the bounded queue between pool threads and the engine loop, descriptions (parent
hash, tokens), the namespace filter, and one key's store always queued before its removal under
concurrent puts. Torch-free; the engine-level test is tests/kv_events/test_kv_events_pool.py."""

from __future__ import annotations

import os
import threading

import pytest

from pdkv.kv_events.schema import BlockRemoved, BlockStored, Event
from pdkv.kvpool.codec import encode_chunk
from pdkv.kvpool.events import PoolEventQueue, PoolTierEvents, merge_stored
from pdkv.kvpool.keys import chunk_key
from pdkv.kvpool.store import KVPoolStore
from pdkv.kvpool.tiers.base import OwnEntries, Tier
from pdkv.kvpool.tiers.disk import DiskTier, filename_to_key, key_to_filename
from pdkv.kvpool.tiers.dram import DramTier

FP = "f" * 32
CHUNK = 32
WAIT_S = 10.0


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def key(i: int, fingerprint: str = FP) -> str:
    return chunk_key(fingerprint, h(i))


def listener(max_events: int = 10_000) -> tuple[PoolEventQueue, PoolTierEvents]:
    q = PoolEventQueue(max_events)
    return q, PoolTierEvents(q, FP, CHUNK)


def flat(events: list[Event]) -> list[tuple[str, str | None, bytes]]:
    """(kind, medium, hash) per hash, in order."""
    out = []
    for e in events:
        if isinstance(e, (BlockStored, BlockRemoved)):
            kind = "stored" if isinstance(e, BlockStored) else "removed"
            out += [(kind, e.medium, x) for x in e.block_hashes]
    return out


# ------------------------------------------------------------------------- the queue


def test_a_full_queue_drops_and_counts_and_wakes_once_per_empty_to_nonempty() -> None:
    woken: list[int] = []
    q = PoolEventQueue(max_events=3, wakeup=lambda: woken.append(1))
    ev = [BlockRemoved(block_hashes=[h(i)], medium="DRAM") for i in range(5)]
    q.put(ev[:2])
    q.put(ev[2:])  # one fits, two are dropped
    assert len(woken) == 1  # the queue was not empty at the second put
    assert q.take() == ev[:3] and q.take() == []
    assert q.take_dropped() == 2 and q.take_dropped() == 0
    q.put(ev[:1])
    assert len(woken) == 2


def test_chained_stores_of_one_medium_merge_and_nothing_else_does() -> None:
    def stored(i: int, parent: int | None, medium: str = "DRAM", tokens: bool = True
               ) -> BlockStored:
        return BlockStored(block_hashes=[h(i)], parent_block_hash=None if parent is None
                           else h(parent), token_ids=[i] * 2 if tokens else [], block_size=2,
                           lora_id=None, medium=medium, lora_name=None)

    removed = BlockRemoved(block_hashes=[h(9)], medium="DRAM")
    events: list[Event] = [stored(1, None), stored(2, 1), stored(3, 2, "DISK"),
                           stored(4, 3, "DISK"), removed, stored(5, 4, "DISK"),
                           stored(7, 6, "DISK"), stored(8, 7, "DISK", tokens=False)]
    merged = merge_stored(events)
    assert [(e.block_hashes if isinstance(e, (BlockStored, BlockRemoved)) else None)
            for e in merged] == [[h(1), h(2)], [h(3), h(4)], [h(9)], [h(5)], [h(7)], [h(8)]]
    first = merged[0]
    assert isinstance(first, BlockStored)
    assert first.parent_block_hash is None and first.token_ids == [1, 1, 2, 2]
    assert flat(merged) == flat(events)  # the same facts in the same order


# ------------------------------------------------------------------------------ tiers


def test_dram_reports_stores_then_evictions_and_removals_with_its_medium() -> None:
    q, events = listener()
    t = DramTier(capacity_bytes=250)
    t.set_event_listener(events)
    for i in range(3):
        t.put(key(i), bytes(100))
    t.put(key(2), bytes(100))  # already held: nothing new to report
    t.remove(key(1))
    t.remove(key(1))  # absent: nothing
    assert flat(q.take()) == [("stored", "DRAM", h(0)), ("stored", "DRAM", h(1)),
                              ("removed", "DRAM", h(0)), ("stored", "DRAM", h(2)),
                              ("removed", "DRAM", h(1))]
    assert q.take() == []


def test_stored_events_carry_the_chunk_hash_block_size_and_description() -> None:
    q, events = listener()
    t = DramTier(capacity_bytes=1 << 20)
    t.set_event_listener(events)
    events.describe(key(2), h(1), range(CHUNK, 2 * CHUNK))
    t.put(key(2), b"x")
    t.put(key(3), b"x")  # never described (e.g. a promotion): no parent, no tokens
    e2, e3 = q.take()
    assert e2 == BlockStored(block_hashes=[h(2)], parent_block_hash=h(1),
                             token_ids=list(range(CHUNK, 2 * CHUNK)), block_size=CHUNK,
                             lora_id=None, medium="DRAM", lora_name=None)
    assert isinstance(e3, BlockStored)
    assert e3.parent_block_hash is None and e3.token_ids == [] and e3.block_size == CHUNK


def test_keys_of_another_namespace_or_shape_are_not_reported() -> None:
    q, events = listener()
    t = DramTier(capacity_bytes=1 << 20)
    t.set_event_listener(events)
    t.put(key(1, fingerprint="0" * 32), b"x")  # another engine's chunk in a shared tier
    t.put(f"pdkv:{FP}:not-hex", b"x")
    t.put("other", b"x")
    t.put(key(2), b"x")
    assert flat(q.take()) == [("stored", "DRAM", h(2))]


def test_a_tier_without_a_listener_reports_nothing_and_works() -> None:
    t = DramTier(capacity_bytes=150)
    t.put(key(1), bytes(100))
    t.put(key(2), bytes(100))
    assert t.events is None and t.contains_many([key(1), key(2)]) == [False, True]


@pytest.mark.parametrize("k", ["pdkv:ab12:cd", "a_b:c%d.e-f", ".hidden", "é:ü", "x" * 3])
def test_disk_file_names_map_back_to_their_keys(k: str) -> None:
    assert filename_to_key(key_to_filename(k)) == k


def test_disk_reports_stores_evictions_vanished_files_and_removals(tmp_path) -> None:
    q, events = listener()
    t = DiskTier(str(tmp_path), capacity_bytes=250, fsync=False)
    t.set_event_listener(events)
    for i in range(3):
        t.put(key(i), bytes(100))  # the third evicts the first
    assert flat(q.take()) == [("stored", "DISK", h(0)), ("stored", "DISK", h(1)),
                              ("removed", "DISK", h(0)), ("stored", "DISK", h(2))]
    os.unlink(tmp_path / key_to_filename(key(1)))  # another process evicted it
    assert t.get(key(1)) is None
    t.remove(key(2))
    t.remove(key(2))
    assert flat(q.take()) == [("removed", "DISK", h(1)), ("removed", "DISK", h(2))]


class _Recorder(Tier):
    """A tier whose OwnEntries report through the base class (a remote tier's bookkeeping)."""

    name = "redis"

    def __init__(self) -> None:
        self.own = OwnEntries(self)

    def contains_many(self, keys):  # pragma: no cover - not called
        return [False] * len(keys)

    def get(self, key):  # pragma: no cover - not called
        return None

    def put(self, key, value):  # pragma: no cover - not called
        pass

    def remove(self, key):  # pragma: no cover - not called
        pass


def test_remote_tiers_report_their_own_puts_and_the_entries_they_find_gone() -> None:
    q, events = listener()
    t = _Recorder()
    t.set_event_listener(events)
    t.own.add(key(1), 10)
    t.own.add(key(2), 10)
    t.own.add(key(3), 10)
    t.own.drop(key(1))  # a get miss or a remove of its own entry
    t.own.drop(key(1))  # no longer recorded: nothing
    assert t.own.prune([key(2), key(3), key(4)], [False, True, False]) == 10
    assert flat(q.take()) == [("stored", "REDIS", h(1)), ("stored", "REDIS", h(2)),
                              ("stored", "REDIS", h(3)), ("removed", "REDIS", h(1)),
                              ("removed", "REDIS", h(2))]


# ------------------------------------------------------------------------------ store


def test_the_store_reports_every_tier_and_a_corrupt_entry_it_removes(tmp_path) -> None:
    q, events = listener()
    store = KVPoolStore([DramTier(1 << 20), DiskTier(str(tmp_path), 1 << 20, fsync=False)])
    try:
        store.set_tier_events(events)
        k = key(7)
        events.describe(k, h(6), range(CHUNK))
        assert store.save(k, encode_chunk(k, CHUNK, [bytes(64)]))
        assert store.flush(WAIT_S)
        got = q.take()
        assert flat(got) == [("stored", "DRAM", h(7)), ("stored", "DISK", h(7))]
        assert all(isinstance(e, BlockStored) and e.parent_block_hash == h(6) for e in got)
        # The description is dropped once the save reached every tier.
        store.tiers[0].remove(k)
        store.tiers[0].put(k, encode_chunk(k, CHUNK, [bytes(64)]))
        again = q.take()[-1]
        assert isinstance(again, BlockStored) and again.parent_block_hash is None
        # A value that fails its checksum is removed from its tier, and reported.
        store.tiers[0].remove(k)
        q.take()
        store.tiers[0].put(k, b"garbage")
        q.take()
        assert store.get(k, CHUNK, [64]) is not None  # from disk, promoted into dram again
        assert flat(q.take()) == [("removed", "DRAM", h(7)), ("stored", "DRAM", h(7))]
    finally:
        store.close()


def test_under_concurrent_puts_a_key_is_never_reported_removed_before_stored() -> None:
    """Many threads put into one small DRAM tier (each put evicts): replaying the events must
    never remove a hash that is not held, and must end with exactly what the tier holds."""
    q, events = listener(max_events=1 << 20)
    t = DramTier(capacity_bytes=10 * 8)
    t.set_event_listener(events)
    keys = [key(i) for i in range(64)]
    start = threading.Barrier(8)

    def work(n: int) -> None:
        start.wait(WAIT_S)
        for r in range(200):
            t.put(keys[(n * 7 + r * 13) % len(keys)], bytes(8))
            if r % 17 == 0:
                t.remove(keys[(n + r) % len(keys)])

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT_S)
        assert not th.is_alive()
    held: set[bytes] = set()
    for kind, medium, x in flat(q.take()):
        assert medium == "DRAM"
        if kind == "stored":
            assert x not in held
            held.add(x)
        else:
            assert x in held, "removed before it was stored"
            held.remove(x)
    assert q.take_dropped() == 0
    assert held == {h(i) for i, present in enumerate(t.contains_many(keys)) if present}


def test_a_redis_tier_reports_its_put_and_a_drop_it_sees_only_at_its_next_miss(
        redis_service) -> None:
    """Redis evicts and expires on its own side: another client's DEL is not reported when it
    happens, only when this tier next misses the key it put."""
    import redis

    from pdkv.kvpool.tiers.redis import RedisTier

    q, events = listener()
    t = RedisTier(redis_service.address, timeout_s=2.0)
    other = redis.Redis.from_url(redis_service.address)
    try:
        t.set_event_listener(events)
        k = key(int.from_bytes(os.urandom(8), "big"))
        x = bytes.fromhex(k.rsplit(":", 1)[1])
        t.put(k, b"value")
        assert flat(q.take()) == [("stored", "REDIS", x)]
        other.delete(k)  # another client (or redis's own eviction)
        assert q.take() == []  # not observed yet
        assert t.get(k) is None
        assert flat(q.take()) == [("removed", "REDIS", x)]
        assert t.get(k) is None and q.take() == []  # reported once
    finally:
        other.close()
        t.close()
