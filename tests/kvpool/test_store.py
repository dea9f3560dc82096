"""KVPoolStore: lookup across tiers, promotion, bounded non-blocking saves, tier back-off,
metrics, flush and close. Races are forced with fault-injecting fake tiers, not sleeps."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from pdkv.kvpool.codec import encode_chunk
from pdkv.kvpool.store import COUNTERS, FAILURE_KINDS, KVPoolStore
from pdkv.kvpool.tiers.base import Tier, TierError
from pdkv.kvpool.tiers.disk import DiskTier
from pdkv.kvpool.tiers.dram import DramTier
from pdkv.kvpool.tiers.factory import (
    DEFAULT_DISK_CAPACITY_BYTES,
    DEFAULT_DRAM_CAPACITY_BYTES,
    create_tier,
)

WAIT_S = 10.0  # generous deadline for waits that should end at once


class FakeTier(Tier):
    """Dict-backed tier with injectable faults: `error` is raised by every call while set;
    `gate` (when set) makes put wait on it, signalling `put_entered` first."""

    def __init__(self, name: str, local_index: bool = True) -> None:
        self.name = name
        self.local_index = local_index
        self.data: dict[str, bytes] = {}
        self.error: TierError | None = None
        self.gate: threading.Event | None = None
        self.put_entered = threading.Event()
        self.calls: list[str] = []
        self.closed = False

    def _enter(self, what: str) -> None:
        self.calls.append(what)
        if self.error is not None:
            raise self.error

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        self._enter("contains_many")
        return [k in self.data for k in keys]

    def get(self, key: str) -> bytes | None:
        self._enter("get")
        return self.data.get(key)

    def put(self, key: str, value: bytes) -> None:
        self._enter("put")
        self.put_entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.data[key] = value

    def remove(self, key: str) -> None:
        self._enter("remove")
        self.data.pop(key, None)

    def bytes_in_use(self) -> int:
        return sum(len(v) for v in self.data.values())

    def close(self) -> None:
        self.closed = True


GROUPS = [b"k" * 48, b"v" * 16]
LENGTHS = [48, 16]


def _value(key: str) -> bytes:
    return encode_chunk(key, 16, GROUPS)


def test_lookup_leading_run_across_tiers() -> None:
    fast, slow = FakeTier("fast"), FakeTier("slow", local_index=False)
    store = KVPoolStore([fast, slow])
    fast.data.update({"k0": b"", "k2": b""})
    slow.data.update({"k1": b"", "k4": b""})  # k1 only in tier 2 still counts
    assert store.lookup(["k0", "k1", "k2", "k3", "k4"]) == 3
    s = store.stats()
    assert (s["pool:fast:lookups"], s["pool:fast:hits"]) == (5, 2)
    assert (s["pool:slow:lookups"], s["pool:slow:hits"]) == (3, 2)  # only keys fast lacked
    assert store.lookup([]) == 0 and store.lookup(["k3", "k0"]) == 0
    assert not store.all_local
    store.close()
    local = KVPoolStore([fast])
    assert local.all_local
    local.close()


def test_lookup_does_not_ask_slower_tiers_when_all_found() -> None:
    fast, slow = FakeTier("fast"), FakeTier("slow")
    store = KVPoolStore([fast, slow])
    fast.data.update({"a": b"", "b": b""})
    assert store.lookup(["a", "b"]) == 2 and slow.calls == []
    store.close()


def test_get_promotes_slower_tier_hit() -> None:
    fast, slow = FakeTier("fast"), FakeTier("slow")
    store = KVPoolStore([fast, slow])
    slow.data["k"] = _value("k")
    got = store.get("k", 16, LENGTHS)
    assert got is not None and [bytes(g) for g in got] == GROUPS
    assert fast.data["k"] == slow.data["k"]
    s = store.stats()
    assert s["pool:slow:chunks_read"] == 1 and s["pool:slow:bytes_read"] == len(slow.data["k"])
    assert s["pool:fast:chunks_written"] == 1 and s["pool:fast:chunks_read"] == 0
    got2 = store.get("k", 16, LENGTHS)  # now served by the fast tier
    assert got2 is not None and store.stats()["pool:fast:chunks_read"] == 1
    assert store.get("missing", 16, LENGTHS) is None
    store.close()


def test_promotion_failure_is_counted_not_raised() -> None:
    fast, slow = DramTier(capacity_bytes=10), FakeTier("slow")
    store = KVPoolStore([fast, slow])
    slow.data["k"] = _value("k")
    assert store.get("k", 16, LENGTHS) is not None
    assert store.stats()["pool:dram:failures_full"] == 1
    store.close()


def test_corrupt_value_removed_and_next_tier_tried() -> None:
    fast, slow = FakeTier("fast"), FakeTier("slow")
    store = KVPoolStore([fast, slow])
    fast.data["k"] = _value("other-key")  # stored under the wrong name
    slow.data["k"] = _value("k")
    got = store.get("k", 16, LENGTHS)
    assert got is not None and [bytes(g) for g in got] == GROUPS
    assert store.stats()["pool:fast:failures_corrupt"] == 1
    assert fast.data["k"] == _value("k")  # removed, then replaced by the promoted copy
    assert store.get("k", 16, [48, 17]) is None  # wrong expectation: a miss, never wrong data
    store.close()


def test_save_queue_full_drops_and_never_blocks() -> None:
    tier = FakeTier("slow")
    tier.gate = threading.Event()
    store = KVPoolStore([tier], save_queue_size=2)
    assert store.save("k0", b"0")
    assert tier.put_entered.wait(WAIT_S)  # the save thread is now stuck inside put
    assert store.flush(0.01) is False  # queue empty, but k0 not yet written
    assert store.stats()["pool:all:save_queue_depth"] == 1
    assert store.save("k1", b"1") and store.save("k2", b"2")
    assert store.save("k3", b"3") is False  # queue full: dropped, returned at once
    s = store.stats()
    assert s["pool:all:save_drops"] == 1 and s["pool:all:saves"] == 3
    assert s["pool:all:save_queue_depth"] == 3
    assert store.flush(0.01) is False
    tier.gate.set()
    assert store.flush(WAIT_S)
    assert sorted(tier.data) == ["k0", "k1", "k2"]
    s = store.stats()
    assert s["pool:all:save_queue_depth"] == 0 and s["pool:slow:chunks_written"] == 3
    assert s["pool:slow:bytes_written"] == 3
    store.close()


def test_save_writes_through_every_tier_and_counts_failures() -> None:
    a, b = FakeTier("a"), FakeTier("b")
    b.error = TierError("disk on fire", "io")
    store = KVPoolStore([a, b])
    assert store.save("k", b"xyz") and store.flush(WAIT_S)
    s = store.stats()
    assert a.data == {"k": b"xyz"} and s["pool:a:chunks_written"] == 1
    assert s["pool:b:failures_io"] == 1 and s["pool:b:chunks_written"] == 0
    store.close()


def test_unavailable_tier_skipped_for_retry_after_then_retried() -> None:
    now = [100.0]
    fast, remote = FakeTier("fast"), FakeTier("remote", local_index=False)
    remote.data["k"] = _value("k")
    remote.error = TierError("connection refused", "unavailable")
    store = KVPoolStore([fast, remote], retry_after_s=5.0, clock=lambda: now[0])
    assert store.lookup(["k"]) == 0
    assert store.stats()["pool:remote:failures_unavailable"] == 1
    n_calls = len(remote.calls)
    # within retry_after_s: not called at all, counted as skipped, a miss everywhere
    assert store.lookup(["k"]) == 0 and store.get("k", 16, LENGTHS) is None
    assert store.save("k2", b"v") and store.flush(WAIT_S)
    assert len(remote.calls) == n_calls
    s = store.stats()
    assert s["pool:remote:skipped"] == 3 and s["pool:remote:failures_unavailable"] == 1
    assert fast.data == {"k2": b"v"}
    now[0] += 5.0  # back-off over; the server is back
    remote.error = None
    assert store.lookup(["k"]) == 1 and store.get("k", 16, LENGTHS) is not None
    remote.error = TierError("slow", "timeout")  # a timeout backs off too
    assert store.lookup(["k"]) == 1  # the fast tier has it now (promoted); remote not asked
    remote.data["k9"] = b""
    assert store.lookup(["k9"]) == 0 and store.lookup(["k9"]) == 0
    s = store.stats()
    assert s["pool:remote:failures_timeout"] == 1 and s["pool:remote:skipped"] == 4
    store.close()


def test_down_warning_names_the_cause_once_per_down_period(caplog) -> None:
    now = [0.0]
    tier = FakeTier("remote", local_index=False)
    tier.error = TierError("redis GET failed: invalid username-password pair", "unavailable")
    store = KVPoolStore([tier], retry_after_s=5.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="pdkv.kvpool.store"):
        assert store.lookup(["k"]) == 0
        assert store.lookup(["k"]) == 0  # skipped: no second warning
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "invalid username-password pair" in warned[0]
    store.close()


def test_io_error_does_not_back_off() -> None:
    tier = FakeTier("t")
    tier.error = TierError("bad sector", "io")
    store = KVPoolStore([tier], clock=lambda: 0.0)
    assert store.lookup(["k"]) == 0 and store.lookup(["k"]) == 0
    s = store.stats()
    assert s["pool:t:failures_io"] == 2 and s["pool:t:skipped"] == 0
    store.close()


def test_unexpected_tier_exception_counts_as_other() -> None:
    class Broken(FakeTier):
        def contains_many(self, keys: Sequence[str]) -> list[bool]:
            raise RuntimeError("bug")

    store = KVPoolStore([Broken("b")])
    assert store.lookup(["k"]) == 0 and store.stats()["pool:b:failures_other"] == 1
    store.close()


def test_stats_keys_and_values() -> None:
    store = KVPoolStore([DramTier(capacity_bytes=1000), FakeTier("remote")])
    names = list(COUNTERS) + [f"failures_{k}" for k in FAILURE_KINDS] + ["bytes_in_use"]
    expected = {f"pool:{t}:{n}" for t in ("dram", "remote") for n in names}
    expected |= {"pool:all:save_queue_depth", "pool:all:save_drops", "pool:all:saves"}
    s = store.stats()
    assert set(s) == expected and all(v == 0 for v in s.values())
    assert all(isinstance(v, float) for v in s.values())
    for i in range(3):
        assert store.save(f"k{i}", b"x" * 400)
    assert store.flush(WAIT_S)
    s = store.stats()
    assert s["pool:dram:evictions"] == 1 and s["pool:dram:bytes_in_use"] == 800
    assert s["pool:remote:bytes_in_use"] == 1200 and s["pool:all:saves"] == 3
    assert store.stats()["pool:dram:evictions"] == 1  # cumulative, not reset by reading
    store.close()


def test_observations_drained() -> None:
    fast, slow = FakeTier("fast"), FakeTier("slow")
    store = KVPoolStore([fast, slow])
    assert store.save("k", _value("k")) and store.flush(WAIT_S)
    assert store.get("k", 16, LENGTHS) is not None
    obs = store.take_observations()
    assert set(obs) == {"pool:fast:save_seconds", "pool:slow:save_seconds",
                        "pool:fast:load_seconds"}
    assert len(obs["pool:fast:load_seconds"]) == 1 and obs["pool:fast:load_seconds"][0] >= 0
    assert store.take_observations() == {}
    store.close()


def test_close_drains_queue_then_closes_tiers() -> None:
    tier = FakeTier("t")
    store = KVPoolStore([tier])
    for i in range(5):
        assert store.save(f"k{i}", b"v")
    store.close(WAIT_S)
    assert len(tier.data) == 5 and tier.closed
    assert store.save("late", b"v") is False
    assert store.stats()["pool:all:save_drops"] == 1
    store.close()  # idempotent


def test_close_with_stuck_tier_returns_and_drops_the_rest() -> None:
    tier = FakeTier("t")
    tier.gate = threading.Event()
    store = KVPoolStore([tier], save_queue_size=4)
    assert store.save("k0", b"v") and tier.put_entered.wait(WAIT_S)
    assert store.save("k1", b"v") and store.save("k2", b"v")
    store.close(timeout_s=0.05)  # the put never finishes in time; close must not hang
    assert tier.closed and store.stats()["pool:all:save_drops"] == 2
    tier.gate.set()


def test_accounting_returns_to_zero_after_removing_everything() -> None:
    dram = DramTier(capacity_bytes=10_000)
    store = KVPoolStore([dram])
    keys = [f"k{i}" for i in range(10)]
    for k in keys:
        assert store.save(k, _value(k))
    assert store.flush(WAIT_S) and store.stats()["pool:dram:bytes_in_use"] > 0
    for k in keys:
        dram.remove(k)
    assert store.stats()["pool:dram:bytes_in_use"] == 0
    store.close()


def test_bad_config_rejected() -> None:
    with pytest.raises(ValueError, match="distinct"):
        KVPoolStore([FakeTier("a"), FakeTier("a")])
    with pytest.raises(ValueError):
        KVPoolStore([])


def test_factory_dram_and_disk(tmp_path) -> None:
    dram = create_tier({"name": "dram"}, str(tmp_path))
    assert isinstance(dram, DramTier) and dram.capacity_bytes == DEFAULT_DRAM_CAPACITY_BYTES
    disk = create_tier({"name": "disk"}, str(tmp_path))
    assert isinstance(disk, DiskTier) and disk.capacity_bytes == DEFAULT_DISK_CAPACITY_BYTES
    assert disk.path == str(tmp_path / "kvpool") and (tmp_path / "kvpool").is_dir()
    own = create_tier({"name": "disk", "path": str(tmp_path / "d"), "capacity_bytes": 10},
                      "/nonexistent")
    assert isinstance(own, DiskTier) and own.capacity_bytes == 10


@pytest.mark.parametrize("spec,match", [
    ({"name": "tape"}, "unknown pool tier 'tape'; known: dram, disk, redis, mooncake"),
    ({}, "unknown pool tier None"),
    ({"name": "dram", "capacity": 5}, r"unknown keys \['capacity'\].*known: \['capacity_bytes'"),
    ({"name": "disk", "size": 5, "path": "x"}, r"unknown keys \['size'\]"),
    ({"name": "redis", "url": "redis://127.0.0.1:1/0", "db": 1}, r"unknown keys \['db'\]"),
    ({"name": "dram", "capacity_bytes": 0}, "positive int"),
    ({"name": "dram", "capacity_bytes": "1GiB"}, "positive int"),
    ({"name": "disk", "path": ""}, "non-empty string"),
])
def test_factory_rejects_bad_specs(tmp_path, spec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_tier(spec, str(tmp_path))


def test_save_skips_a_tier_that_already_holds_the_key() -> None:
    """A chunk saved again (a producer that never looks up, or a prompt the prefix cache served)
    is not rewritten into a tier that holds it: one contains_many check, no put."""
    local, remote = FakeTier("dram"), FakeTier("redis", local_index=False)
    remote.data["k"] = b"old"
    store = KVPoolStore([local, remote])
    assert store.save("k", b"new") and store.flush(WAIT_S)
    assert local.data == {"k": b"new"} and remote.data == {"k": b"old"}
    assert remote.calls == ["contains_many"]
    s = store.stats()
    assert s["pool:redis:save_skips"] == 1 and s["pool:redis:chunks_written"] == 0
    assert s["pool:dram:save_skips"] == 0 and s["pool:dram:chunks_written"] == 1
    assert s["pool:redis:lookups"] == 0  # the save's check is not a lookup
    assert store.save("k", b"new") and store.flush(WAIT_S)
    assert store.stats()["pool:dram:save_skips"] == 1
    store.close()
