"""DRAM tier: LRU by bytes under capacity; probes do not keep entries alive."""

from __future__ import annotations

import pytest

from pdkv.kvpool.tiers.base import TierError
from pdkv.kvpool.tiers.dram import DramTier


def test_lru_by_bytes_stays_under_capacity() -> None:
    t = DramTier(capacity_bytes=250)
    for i in range(5):
        t.put(f"k{i}", bytes([i]) * 100)
        assert t.bytes_in_use() <= 250
    assert t.contains_many([f"k{i}" for i in range(5)]) == [False, False, False, True, True]
    assert t.take_evictions() == 3 and t.take_evictions() == 0
    assert t.get("k4") == b"\x04" * 100 and t.get("k0") is None


def test_get_refreshes_recency() -> None:
    t = DramTier(capacity_bytes=300)
    for k in "abc":
        t.put(k, k.encode() * 100)
    assert t.get("a") is not None
    t.put("d", b"d" * 100)  # evicts b, the least recently used
    assert t.contains_many(["a", "b", "c", "d"]) == [True, False, True, True]


def test_probed_but_never_read_entries_are_evicted_in_lru_order() -> None:
    t = DramTier(capacity_bytes=300)
    for k in "abc":
        t.put(k, k.encode() * 100)
    for _ in range(3):  # lookups that are never followed by a read
        assert t.contains_many(["a", "b"]) == [True, True]
    t.put("d", b"d" * 100)
    t.put("e", b"e" * 100)
    assert t.contains_many(["a", "b", "c", "d", "e"]) == [False, False, True, True, True]


def test_value_bigger_than_capacity_is_full_and_evicts_nothing() -> None:
    t = DramTier(capacity_bytes=100)
    t.put("a", b"a" * 60)
    with pytest.raises(TierError) as e:
        t.put("big", b"x" * 101)
    assert e.value.kind == "full"
    assert t.contains_many(["a", "big"]) == [True, False] and t.bytes_in_use() == 60


def test_put_existing_key_keeps_accounting_and_remove_returns_to_zero() -> None:
    t = DramTier(capacity_bytes=1000)
    t.put("a", b"a" * 100)
    t.put("a", b"a" * 100)
    t.put("b", b"b" * 50)
    assert t.bytes_in_use() == 150
    t.remove("a")
    t.remove("a")
    t.remove("missing")
    t.remove("b")
    assert t.bytes_in_use() == 0 and t.contains_many(["a", "b"]) == [False, False]
    assert t.local_index and t.name == "dram"
