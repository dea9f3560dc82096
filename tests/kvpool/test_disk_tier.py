"""Disk tier: survives re-open, cleans temporaries, failed writes leave nothing, capacity + LRU,
damaged files are caught by the store."""

from __future__ import annotations

import errno
import os

import pytest

from pdkv.kvpool.codec import encode_chunk
from pdkv.kvpool.store import KVPoolStore
from pdkv.kvpool.tiers import disk as disk_mod
from pdkv.kvpool.tiers.base import TierError
from pdkv.kvpool.tiers.disk import DiskTier, key_to_filename
from pdkv.kvpool.tiers.dram import DramTier

OLD_NS = 1_000_000_000_000_000_000  # an mtime (2001) older than any write in the test


def _files(path: str) -> list[str]:
    return sorted(os.listdir(path))


def test_put_get_and_filename(tmp_path) -> None:
    t = DiskTier(str(tmp_path), 10_000)
    key = "pdkv:" + "a" * 32 + ":" + "0f" * 32
    t.put(key, b"hello")
    assert _files(str(tmp_path)) == ["pdkv_" + "a" * 32 + "_" + "0f" * 32 + ".kv"]
    assert t.get(key) == b"hello" and t.get("pdkv:none") is None
    assert t.contains_many([key, "pdkv:none"]) == [True, False]
    assert key_to_filename("a:b") != key_to_filename("a_b")
    assert "/" not in key_to_filename("../x/y") and not key_to_filename(".tmp-x").startswith(".")


def test_survives_reopen_lru_by_mtime(tmp_path) -> None:
    path = str(tmp_path)
    t = DiskTier(path, 10_000)
    for i, k in enumerate("abc"):
        t.put(k, k.encode() * 100)
        os.utime(os.path.join(path, key_to_filename(k)), ns=(OLD_NS + i, OLD_NS + i))
    assert t.get("a") == b"a" * 100  # a use refreshes the mtime: a is now the newest
    t.close()
    t2 = DiskTier(path, 10_000)
    assert t2.contains_many(list("abc")) == [True, True, True] and t2.bytes_in_use() == 300
    assert t2.get("b") == b"b" * 100
    t2.close()
    # re-open with room for two: c goes, the oldest by mtime now that a and b were read
    t3 = DiskTier(path, 200)
    assert t3.contains_many(list("abc")) == [True, True, False]
    assert t3.bytes_in_use() == 200 and len(_files(path)) == 2


def test_temp_files_removed_at_start(tmp_path) -> None:
    path = str(tmp_path)
    (tmp_path / ".tmp-123-0-pdkv_x.kv").write_bytes(b"partial")
    (tmp_path / "keep.kv").write_bytes(b"x" * 7)
    t = DiskTier(path, 10_000)
    assert _files(path) == ["keep.kv"] and t.bytes_in_use() == 7


def test_capacity_and_lru_eviction_deletes_files(tmp_path) -> None:
    path = str(tmp_path)
    t = DiskTier(path, 250)
    for i in range(5):
        t.put(f"k{i}", bytes([i]) * 100)
        assert t.bytes_in_use() <= 250
        assert sum(os.path.getsize(os.path.join(path, f)) for f in _files(path)) <= 250
    assert t.contains_many([f"k{i}" for i in range(5)]) == [False, False, False, True, True]
    assert t.take_evictions() == 3 and len(_files(path)) == 2
    with pytest.raises(TierError) as e:
        t.put("big", b"x" * 251)
    assert e.value.kind == "full"
    t.contains_many(["k3"])  # a probe does not refresh k3
    t.put("k5", b"5" * 100)
    assert t.contains_many(["k3", "k4", "k5"]) == [False, True, True]
    for k in ("k4", "k5"):
        t.remove(k)
    assert t.bytes_in_use() == 0 and _files(path) == []


def test_write_error_leaves_no_entry_and_no_file(tmp_path, monkeypatch) -> None:
    path = str(tmp_path)
    t = DiskTier(path, 10_000)
    real_write = os.write

    def failing_write(fd: int, data) -> int:  # writes a little, then the disk is "full"
        real_write(fd, bytes(data[:3]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod.os, "write", failing_write)
    with pytest.raises(TierError) as e:
        t.put("k", b"v" * 100)
    monkeypatch.undo()
    assert e.value.kind == "io"
    assert _files(path) == [] and t.contains_many(["k"]) == [False] and t.bytes_in_use() == 0
    t.put("k", b"v" * 100)  # the tier still works
    assert t.get("k") == b"v" * 100


def test_rename_error_leaves_no_entry_and_no_file(tmp_path, monkeypatch) -> None:
    path = str(tmp_path)
    t = DiskTier(path, 10_000)

    def failing_replace(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(disk_mod.os, "replace", failing_replace)
    with pytest.raises(TierError) as e:
        t.put("k", b"v" * 100)
    monkeypatch.undo()
    assert e.value.kind == "io"
    assert _files(path) == [] and t.contains_many(["k"]) == [False] and t.bytes_in_use() == 0


def test_write_error_through_store_is_counted_not_raised(tmp_path, monkeypatch) -> None:
    path = str(tmp_path)
    store = KVPoolStore([DiskTier(path, 10_000)])

    def failing_replace(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(disk_mod.os, "replace", failing_replace)
    assert store.save("k", b"v" * 10)
    assert store.flush(10)
    monkeypatch.undo()
    assert store.stats()["pool:disk:failures_io"] == 1 and store.lookup(["k"]) == 0
    assert _files(path) == []
    store.close()


KEY = "pdkv:" + "1" * 32 + ":" + "2" * 64
GROUPS = [b"k" * 64, b"v" * 32]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_is_a_miss_counted_and_removed(tmp_path, damage: str) -> None:
    path = str(tmp_path)
    store = KVPoolStore([DiskTier(path, 10_000)])
    assert store.save(KEY, encode_chunk(KEY, 16, GROUPS)) and store.flush(10)
    file = tmp_path / key_to_filename(KEY)
    raw = bytearray(file.read_bytes())
    if damage == "flip":
        raw[-1] ^= 0xFF
    else:
        del raw[-10:]
    file.write_bytes(bytes(raw))
    assert store.lookup([KEY]) == 1  # the index cannot know; the load finds out
    assert store.get(KEY, 16, [64, 32]) is None
    s = store.stats()
    assert s["pool:disk:failures_corrupt"] == 1 and s["pool:disk:chunks_read"] == 0
    assert not file.exists() and store.lookup([KEY]) == 0 and s["pool:disk:bytes_in_use"] == 0
    store.close()


def test_damaged_file_falls_through_to_next_tier(tmp_path) -> None:
    path = str(tmp_path)
    disk = DiskTier(path, 10_000)
    store = KVPoolStore([disk, DramTier(10_000)])  # disk first here, to reach the next tier
    value = encode_chunk(KEY, 16, GROUPS)
    assert store.save(KEY, value) and store.flush(10)
    file = tmp_path / key_to_filename(KEY)
    file.write_bytes(file.read_bytes()[:-1])
    got = store.get(KEY, 16, [64, 32])
    assert got is not None and [bytes(g) for g in got] == GROUPS
    s = store.stats()
    assert s["pool:disk:failures_corrupt"] == 1 and s["pool:dram:chunks_read"] == 1
    assert file.read_bytes() == value  # promoted back into disk, intact
    store.close()


def test_an_entry_another_process_wrote_into_the_directory_is_found_and_adopted(tmp_path):
    reader = DiskTier(str(tmp_path), 1 << 20)  # started first: its start-up index is empty
    writer = DiskTier(str(tmp_path), 1 << 20)
    writer.put("pdkv:f:01", b"x" * 100)
    assert reader.contains_many(["pdkv:f:01", "pdkv:f:02"]) == [True, False]
    assert reader.get("pdkv:f:01") == b"x" * 100
    assert reader.bytes_in_use() == 100
    other = DiskTier(str(tmp_path / "sub"), 1 << 20)
    assert other.get("pdkv:f:01") is None


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_of_the_file_and_the_directory_follows_the_option(tmp_path, monkeypatch, fsync):
    t = DiskTier(str(tmp_path), 10_000, fsync=fsync)
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def counting_fsync(fd: int) -> None:
        calls.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    def noting_replace(src: str, dst: str) -> None:
        calls.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(disk_mod.os, "fsync", counting_fsync)
    monkeypatch.setattr(disk_mod.os, "replace", noting_replace)
    t.put("k", b"v" * 100)
    t.put("k", b"v" * 100)  # held already: nothing written
    assert calls == (["file", "rename", "dir"] if fsync else ["rename"])
    assert t.get("k") == b"v" * 100


def test_the_fsync_option_is_read_from_the_tier_spec(tmp_path):
    from pdkv.kvpool.tiers.factory import create_tier

    def disk(**extra: object) -> DiskTier:
        tier = create_tier({"name": "disk", "path": str(tmp_path), **extra}, str(tmp_path))
        assert isinstance(tier, DiskTier)
        return tier

    assert disk().fsync is True and disk(fsync=False).fsync is False
    with pytest.raises(ValueError, match="fsync"):
        disk(fsync="no")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in _files(path))


def test_two_tiers_on_one_directory_share_its_capacity(tmp_path):
    path = str(tmp_path)
    a, b = DiskTier(path, 1000), DiskTier(path, 1000)
    for i in range(6):  # alternately, 600 bytes each: 1,200 written, room for 1,000
        a.put(f"a{i}", bytes([i]) * 100)
        b.put(f"b{i}", bytes([i]) * 100)
        assert _dir_bytes(path) <= 1000
    assert _dir_bytes(path) == 1000 and b.bytes_in_use() == 1000
    # The two oldest files, a0 (b's eviction) and b0 (a's), are gone.
    assert not os.path.exists(os.path.join(path, key_to_filename("a0")))
    assert not os.path.exists(os.path.join(path, key_to_filename("b0")))
    assert a.take_evictions() + b.take_evictions() == 2
    # a still lists a0 (evicted by b since a's last scan): reading it is a miss, not an error.
    assert a.get("a0") is None and a.contains_many(["a0"]) == [False]
    # The other's entries are hits; a's read of b1 makes it the newest file for b too.
    assert a.get("b1") == bytes([1]) * 100
    b.put("b6", b"x" * 200)  # b scans, sees the read, evicts the two oldest: a1 and a2
    assert _dir_bytes(path) == 1000 and b.take_evictions() == 2
    assert [a.get(k) is None for k in ("a1", "a2", "b1", "b2")] == [True, True, False, False]


def test_a_put_of_an_entry_another_tier_evicted_writes_it_again(tmp_path):
    path = str(tmp_path)
    a, b = DiskTier(path, 250), DiskTier(path, 250)
    a.put("k", b"k" * 100)
    b.put("x", b"x" * 100)
    b.put("y", b"y" * 100)  # evicts a's k
    assert not os.path.exists(os.path.join(path, key_to_filename("k")))
    a.put("k", b"k" * 100)  # a's index still lists k: the file is gone, so it is written
    assert b.get("k") == b"k" * 100 and _dir_bytes(path) <= 250


def test_start_up_keeps_temporary_files_of_running_writers(tmp_path):
    import subprocess
    import sys

    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".tmp-{writer.pid}-0-pdkv_x.kv"
        live.write_bytes(b"in progress")
        dead = tmp_path / ".tmp-999999999-0-pdkv_y.kv"
        dead.write_bytes(b"left by a crash")
        DiskTier(str(tmp_path), 10_000)
        assert live.exists() and not dead.exists()
    finally:
        writer.kill()
        writer.wait()
