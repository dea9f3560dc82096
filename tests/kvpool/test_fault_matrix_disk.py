"""The pool's fault matrix, disk tier (issue 28): chunk files removed or damaged after a lookup
saw them, two tiers on one directory writing one key at once, a file system that runs out of
space. Engine faults run under tiny-llama-kv2 (greedy): every request keeps the text of an engine
without the pool, the failure is counted, and a later request hits the pool again. Remote tiers:
test_fault_matrix.py.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from system_packages import in_ci

from pdkv import LLM
from pdkv.kvpool.tiers.base import TierError
from pdkv.kvpool.tiers.disk import TMP_PREFIX, DiskTier
from tests.kvpool.fault_utils import (
    CHUNK,
    HIT,
    assert_idle,
    generate,
    pool_llm,
    prompt,
    reference_tokens,
    stats,
)


def disk_llm(model: str, path: Path) -> LLM:
    tier = {"name": "disk", "path": str(path), "capacity_bytes": 1 << 30, "fsync": False}
    return pool_llm(model, tier)


def chunk_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".kv")


@pytest.fixture(scope="module")
def reference(tiny_llama_kv2) -> dict[int, list[int]]:
    """Greedy tokens of prompts 0..1 on an engine without a pool."""
    return reference_tokens(tiny_llama_kv2, 2)


def _remove(p: Path) -> None:
    p.unlink()


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _random_bytes(p: Path) -> None:
    p.write_bytes(os.urandom(p.stat().st_size))


@pytest.mark.parametrize("damage", [_remove, _truncate, _random_bytes],
                         ids=["removed", "truncated", "random-bytes"])
def test_disk_file_lost_or_damaged_after_the_lookup_is_recomputed_never_wrong(
    tiny_llama_kv2, reference, tmp_path, damage
):
    """The tier's index (the lookup) still lists the file; the read finds it gone or its checksum
    wrong: the load fails, the request recomputes from there with the cold text, and the
    entry is dropped so the next request stores it again and then hits it."""
    llm = disk_llm(tiny_llama_kv2, tmp_path)
    try:
        generate(llm, prompt(0))
        before = stats(llm)
        files = chunk_files(tmp_path)
        assert len(files) == 3
        for f in files:
            damage(f)
        out = generate(llm, prompt(0))
        assert out.outputs[0].token_ids == reference[0] and out.num_cached_tokens == 0
        counts = stats(llm)
        failed_loads = before.get("kv_load_failures_recompute", 0) + 1
        assert counts["kv_load_failures_recompute"] == failed_loads
        corrupt = counts["pool:disk:failures_corrupt"]
        assert corrupt == (0 if damage is _remove else 1)  # the first chunk read failed the load
        # A try that reads a damaged chunk drops it and stops loading there; the next one misses
        # it and stores it again (chunks its lookup saw are not saved): a whole hit within two
        # tries per damaged chunk, and every output right on the way.
        for _ in range(2 * len(files) + 1):
            again = generate(llm, prompt(0))
            assert again.outputs[0].token_ids == reference[0]
            assert again.num_cached_tokens in range(0, HIT + 1, CHUNK)
            stats(llm)
            if again.num_cached_tokens == HIT:
                break
        assert again.num_cached_tokens == HIT
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_two_tiers_on_one_directory_writing_the_same_keys_at_once(tmp_path):
    a, b = DiskTier(str(tmp_path), 1 << 30), DiskTier(str(tmp_path), 1 << 30)
    values = {f"pdkv:fp:{i:04d}": os.urandom(8192 + i) for i in range(40)}
    barrier = threading.Barrier(2, timeout=30.0)
    errors: list[BaseException] = []

    def write(tier: DiskTier) -> None:
        for key, value in values.items():
            try:
                barrier.wait()
                tier.put(key, value)
            except BaseException as e:  # reported below
                errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:3]
    for key, value in values.items():
        assert a.get(key) == value and b.get(key) == value
    assert not [n for n in os.listdir(tmp_path) if n.startswith(TMP_PREFIX)]
    assert len(chunk_files(tmp_path)) == len(values)


class _PausedWrite:
    """Wraps DiskTier._write: the temporary file is written, then the put waits (`written` set)
    until `go` is set, so another tier can act while it sits there."""

    def __init__(self) -> None:
        self.written = threading.Event()
        self.go = threading.Event()
        self._real = DiskTier._write

    def __call__(self, path: str, value: bytes, fsync: bool) -> None:
        self._real(path, value, fsync)
        self.written.set()
        assert self.go.wait(30.0)


@pytest.mark.parametrize("other", ["starts", "writes-the-key"])
def test_a_second_tier_in_the_same_process_never_breaks_a_write_in_progress(
    tmp_path, monkeypatch, other
):
    """A tier's temporary file stays its own while its put runs: another tier on the directory
    (two engines in one process) neither deletes it at start-up as a stale leftover nor writes
    the same temporary name."""
    paused = _PausedWrite()
    a = DiskTier(str(tmp_path), 1 << 30)
    monkeypatch.setattr(a, "_write", paused)
    errors: list[BaseException] = []

    def put_a() -> None:
        try:
            a.put("pdkv:fp:k", b"a" * 4096)
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=put_a)
    t.start()
    try:
        assert paused.written.wait(30.0)
        b = DiskTier(str(tmp_path), 1 << 30)
        if other == "writes-the-key":
            b.put("pdkv:fp:k", b"a" * 4096)
    finally:
        paused.go.set()
        t.join(30.0)
    assert not errors, errors
    assert a.get("pdkv:fp:k") == b"a" * 4096 and b.get("pdkv:fp:k") == b"a" * 4096
    assert not [n for n in os.listdir(tmp_path) if n.startswith(TMP_PREFIX)]


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted on a fresh directory (root only), unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    why = None
    if os.geteuid() != 0:
        why = "mounting a 1 MiB tmpfs needs root"
    else:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=30.0)
        if proc.returncode != 0:
            why = f"mount -t tmpfs failed: {proc.stderr.strip()}"
    if why is not None:
        if in_ci():
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30.0)


def _fill(path: Path) -> Path:
    """Write a file under `path` until the file system is full (ENOSPC); returns it."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
    assert filler.stat().st_size > 0
    return filler


def test_disk_full_fails_writes_counted_reads_still_hit_and_space_brings_it_back(
    tiny_llama_kv2, reference, small_fs
):
    llm = disk_llm(tiny_llama_kv2, small_fs)
    try:
        generate(llm, prompt(0))
        assert stats(llm)["pool:disk:chunks_written"] == 3
        filler = _fill(small_fs)
        out = generate(llm, prompt(1))
        assert out.outputs[0].token_ids == reference[1] and out.num_cached_tokens == 0
        counts = stats(llm)
        assert counts["pool:disk:failures_io"] == 3 and counts["pool:disk:chunks_written"] == 3
        assert not [n for n in os.listdir(small_fs) if n.startswith(TMP_PREFIX)]
        hot = generate(llm, prompt(0))  # what is stored is still read
        assert hot.num_cached_tokens == HIT and hot.outputs[0].token_ids == reference[0]
        filler.unlink()
        generate(llm, prompt(1))  # stored now
        assert stats(llm)["pool:disk:chunks_written"] == 6
        back = generate(llm, prompt(1))
        assert back.num_cached_tokens == HIT and back.outputs[0].token_ids == reference[1]
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_put_on_a_full_file_system_is_an_io_error_and_leaves_nothing(small_fs):
    tier = DiskTier(str(small_fs), 1 << 30, fsync=True)
    _fill(small_fs)
    with pytest.raises(TierError) as ei:
        tier.put("pdkv:fp:k", os.urandom(256 << 10))
    assert ei.value.kind == "io" and "No space" in str(ei.value)
    assert tier.get("pdkv:fp:k") is None and os.listdir(small_fs) == ["filler"]
