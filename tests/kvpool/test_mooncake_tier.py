"""MooncakeTier against a real Mooncake Store (mooncake_master + a store process) on loopback."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from pdkv.kvpool.tiers.base import TierError
from pdkv.kvpool.tiers.mooncake import MooncakeTier, import_store_class
from pdkv.ports import free_port

SMALL_BUFFER = 4 << 20  # values above 1 MiB take the registered-buffer path


@pytest.fixture(scope="module")
def tier(mooncake_service):
    t = MooncakeTier(mooncake_service.address, local_buffer_bytes=SMALL_BUFFER, timeout_s=5.0)
    yield t
    t.close()


def _key(request, name: str) -> str:
    return f"pdkv:test:{request.node.name}:{name}"


def test_round_trip_small_and_larger_than_local_buffer(tier, request):
    small, mid, big = _key(request, "small"), _key(request, "mid"), _key(request, "big")
    vs, vm, vb = os.urandom(64 << 10), os.urandom(3 << 20), os.urandom(3 * SMALL_BUFFER)
    assert tier.contains_many([small, mid, big]) == [False, False, False]
    tier.put(small, vs)
    tier.put(mid, vm)
    tier.put(big, vb)
    assert tier.contains_many([small, _key(request, "absent"), mid, big]) == [
        True,
        False,
        True,
        True,
    ]
    assert tier.get(small) == vs
    assert tier.get(mid) == vm
    assert tier.get(big) == vb
    for k in (small, mid, big):
        tier.remove(k)
        assert tier.get(k) is None
    assert tier.contains_many([small, mid, big]) == [False, False, False]
    assert tier.contains_many([]) == []


def test_miss_is_none_and_remove_of_absent_is_fine(tier, request):
    k = _key(request, "never-put")
    assert tier.get(k) is None
    tier.remove(k)


def test_put_of_existing_key_keeps_first_value(tier, request):
    # Keys are content addresses: a second put never carries other bytes in the pool; the
    # store keeps the first value and the tier reports success.
    k = _key(request, "k")
    tier.put(k, b"first" * 100)
    tier.put(k, b"other" * 100)
    assert tier.get(k) == b"first" * 100
    tier.remove(k)


def test_other_process_writes_closes_and_entries_stay(mooncake_service, tier, request, run_python):
    small, big = _key(request, "small"), _key(request, "big")
    code = (
        "from pdkv.kvpool.tiers.mooncake import MooncakeTier\n"
        f"t = MooncakeTier({mooncake_service.address!r}, local_buffer_bytes={SMALL_BUFFER})\n"
        f"t.put({small!r}, bytes(range(256)) * 64)\n"
        f"t.put({big!r}, bytes(range(256)) * {3 * SMALL_BUFFER // 256})\n"
        "t.close()\n"
    )
    run_python(code, hash_seed="4242")  # the writer has closed: its (empty) segment is gone
    assert tier.contains_many([small, big]) == [True, True]
    assert tier.get(small) == bytes(range(256)) * 64
    assert tier.get(big) == bytes(range(256)) * (3 * SMALL_BUFFER // 256)
    tier.remove(small)
    tier.remove(big)


def test_keeps_working_after_another_client_closes(mooncake_service, tier, request):
    other = MooncakeTier(mooncake_service.address, local_buffer_bytes=SMALL_BUFFER)
    k_other, k_mine = _key(request, "other"), _key(request, "mine")
    other.put(k_other, b"o" * 5000)
    other.close()
    other.close()  # idempotent
    assert tier.get(k_other) == b"o" * 5000
    tier.put(k_mine, b"m" * (2 << 20))
    assert tier.get(k_mine) == b"m" * (2 << 20)
    with pytest.raises(TierError):
        other.get(k_other)  # a closed tier refuses, it does not crash
    tier.remove(k_other)
    tier.remove(k_mine)


def test_killed_store_process_then_master_never_hangs(own_mooncake):
    t = MooncakeTier(own_mooncake.address, local_buffer_bytes=SMALL_BUFFER, timeout_s=2.0)
    t.put("k", b"v" * 4096)
    assert t.get("k") == b"v" * 4096
    master, store = own_mooncake.procs
    store.kill()
    store.wait(5)
    # The memory is gone with the store process: a read is a miss or an error, never stale
    # bytes; a write fails fast.
    start = time.monotonic()
    with contextlib.suppress(TierError):
        assert t.get("k") is None
    with pytest.raises(TierError):
        t.put("k2", b"w" * 4096)
    assert time.monotonic() - start < 5.0

    master.kill()
    master.wait(5)
    calls = [
        lambda: t.get("k"),
        lambda: t.put("k3", b"v"),
        lambda: t.contains_many(["k"]),
        lambda: t.remove("k"),
        lambda: t.get("k"),
    ]
    for call in calls:
        start = time.monotonic()
        with pytest.raises(TierError) as ei:
            call()
        assert ei.value.kind in ("unavailable", "timeout")
        assert time.monotonic() - start < 5.0
    start = time.monotonic()
    t.close()
    assert time.monotonic() - start < 5.0


def test_dead_master_at_construction_then_calls_fail_fast_until_it_starts():
    pytest.importorskip("mooncake.store")
    from pdkv.launch import services

    port = free_port()
    start = time.monotonic()
    t = MooncakeTier(f"127.0.0.1:{port}", timeout_s=2.0)  # no error: set up later
    with pytest.raises(TierError) as ei:
        t.get("k")
    assert ei.value.kind == "unavailable"
    assert time.monotonic() - start < 10.0
    try:
        with services.start_mooncake(segment_bytes=16 << 20, port=port):
            t.put("k", b"v" * 4096)  # the first call sets the client up
            assert t.get("k") == b"v" * 4096
    finally:
        t.close()


def test_master_that_accepts_but_never_answers_is_bounded_at_construction_and_per_call():
    """A real client against a socket that accepts and reads forever: without the answer probe
    setup() holds the GIL for 20 x 30 s, so this test runs the tier in a child process with a
    deadline and fails (instead of hanging) if it does not finish."""
    pytest.importorskip("mooncake.store")
    listener = socket.socket()  # the kernel accepts into the backlog; nothing ever answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    code = (
        "import time\n"
        "from pdkv.kvpool.tiers.base import TierError\n"
        "from pdkv.kvpool.tiers.mooncake import MooncakeTier\n"
        "start = time.monotonic()\n"
        f"t = MooncakeTier('127.0.0.1:{listener.getsockname()[1]}', timeout_s=1.0)\n"
        "for call in (lambda: t.get('k'), lambda: t.put('k', b'v')):\n"
        "    try:\n"
        "        call()\n"
        "    except TierError as e:\n"
        "        assert e.kind == 'timeout' and 'did not answer' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('a call to a master that never answers succeeded')\n"
        "assert time.monotonic() - start < 15.0\n"
        "t.close()\n"
        "print('refused')\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=_child_env(), timeout=60.0,
                              capture_output=True, text=True)
    finally:
        listener.close()
    assert proc.returncode == 0 and proc.stdout.strip() == "refused", proc.stderr[-2000:]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH", "")) if x)
    return env


def test_bad_master_address():
    with pytest.raises(ValueError, match="host:port"):
        MooncakeTier("no-port")


def test_missing_package_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError) as ei:
        import_store_class()
    assert "mooncake-transfer-engine-non-cuda" in str(ei.value)
    assert "libibverbs1" in str(ei.value)


class _HangingStore:
    """Stands in for MooncakeDistributedStore: setup succeeds, get_size blocks until released
    (a master that answers the probe but not the call)."""

    release = threading.Event()
    calls: list[str] = []

    def setup(self, *args):
        return 0

    def get_size(self, key):
        self.calls.append(key)
        self.release.wait(30)
        return -704

    def close(self):
        return 0


def test_unanswered_call_times_out_and_dead_master_is_refused_without_a_call(monkeypatch):
    import pdkv.kvpool.tiers.mooncake as mod

    monkeypatch.setattr(mod, "import_store_class", lambda: _HangingStore)
    _HangingStore.release.clear()
    _HangingStore.calls.clear()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    def answer_probes() -> None:  # like a live master: drop each connection at once
        with contextlib.suppress(OSError):
            while True:
                listener.accept()[0].close()

    threading.Thread(target=answer_probes, daemon=True).start()
    t = MooncakeTier(f"127.0.0.1:{port}", timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(TierError) as ei:
            t.get("k1")
        assert ei.value.kind == "timeout"
        assert time.monotonic() - start < 5.0
        assert _HangingStore.calls == ["k1"]
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (Linux)
        listener.close()  # the master goes away while the first call is still stuck
        with pytest.raises(TierError) as ei:
            t.get("k2")
        assert ei.value.kind == "unavailable"
        assert _HangingStore.calls == ["k1"]  # refused by the probe, never sent
    finally:
        _HangingStore.release.set()
        listener.close()
        t.close()


def test_concurrent_threads_small_and_large(tier, request):
    values = {
        _key(request, str(i)): os.urandom((64 << 10) if i % 2 else (2 * SMALL_BUFFER))
        for i in range(12)
    }
    errors: list[BaseException] = []

    def work(items):
        try:
            for k, v in items:
                tier.put(k, v)
                assert tier.get(k) == v
        except BaseException as e:  # reported below
            errors.append(e)

    items = list(values.items())
    threads = [threading.Thread(target=work, args=(items[i::4],)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert tier.contains_many(list(values)) == [True] * len(values)
    for k in values:
        tier.remove(k)


def test_bytes_in_use_counts_this_instances_entries_the_store_still_holds(
    mooncake_service, request
):
    mine = MooncakeTier(mooncake_service.address, local_buffer_bytes=SMALL_BUFFER, timeout_s=5.0)
    other = MooncakeTier(mooncake_service.address, local_buffer_bytes=SMALL_BUFFER, timeout_s=5.0)
    try:
        a, b, c = (_key(request, n) for n in "abc")
        assert mine.fetch_bytes_in_use() == 0
        mine.put(a, os.urandom(64 << 10))
        mine.put(b, os.urandom(3 * SMALL_BUFFER))
        other.put(c, os.urandom(1000))  # another client's entry is not counted
        assert mine.fetch_bytes_in_use() == (64 << 10) + 3 * SMALL_BUFFER
        deadline = time.monotonic() + 30.0  # answered from the background fetch, never waited
        while mine.bytes_in_use() != (64 << 10) + 3 * SMALL_BUFFER:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        other.remove(b)  # gone from the store behind this instance's back
        assert mine.fetch_bytes_in_use() == 64 << 10
        mine.remove(a)
        assert mine.fetch_bytes_in_use() == 0
        other.remove(c)
    finally:
        mine.close()
        other.close()
