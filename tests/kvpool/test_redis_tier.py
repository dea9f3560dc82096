"""RedisTier against a real redis-server on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest

from pdkv.kvpool.tiers.base import TierError
from pdkv.kvpool.tiers.redis import RedisTier
from pdkv.ports import free_port


@pytest.fixture
def tier(redis_service, request):
    t = RedisTier(redis_service.address, timeout_s=2.0)
    yield t
    t.close()


def _key(request, name: str) -> str:
    return f"pdkv:test:{request.node.name}:{name}"


def test_round_trip_multi_mb(tier, request):
    a, b = _key(request, "a"), _key(request, "b")
    va, vb = os.urandom(3 << 20), os.urandom(5 << 20) + b"\0\r\n"
    assert tier.contains_many([a, b]) == [False, False]
    tier.put(a, va)
    tier.put(b, vb)
    assert tier.contains_many([a, _key(request, "absent"), b]) == [True, False, True]
    assert tier.get(a) == va
    assert tier.get(b) == vb
    tier.remove(a)
    assert tier.get(a) is None
    assert tier.contains_many([a, b]) == [False, True]
    tier.remove(a)  # absent: no error
    tier.remove(b)
    assert tier.contains_many([]) == []


def test_miss_is_none(tier, request):
    assert tier.get(_key(request, "never-put")) is None


def test_no_ttl_by_default_and_ttl_expires(redis_service, tier, request):
    import redis

    raw = redis.Redis.from_url(redis_service.address)
    try:
        k = _key(request, "plain")
        tier.put(k, b"v")
        assert raw.ttl(k) == -1  # no expiry

        expiring = RedisTier(redis_service.address, ttl_s=1.0, timeout_s=2.0)
        kt = _key(request, "ttl")
        expiring.put(kt, b"x" * 1000)
        assert 0 < raw.ttl(kt) <= 1
        deadline = time.monotonic() + 10.0
        while expiring.get(kt) is not None:
            assert time.monotonic() < deadline, "entry with ttl_s=1 never expired"
            time.sleep(0.1)
        assert expiring.contains_many([kt]) == [False]
        expiring.close()
        tier.remove(k)
    finally:
        raw.close()


def test_two_processes_share_entries(redis_service, tier, request, run_python):
    k = _key(request, "from-child")
    code = (
        "import sys\n"
        "from pdkv.kvpool.tiers.redis import RedisTier\n"
        f"t = RedisTier({redis_service.address!r})\n"
        f"t.put({k!r}, bytes(range(256)) * 8192)\n"
        f"assert t.contains_many([{k!r}]) == [True]\n"
        "t.close()\n"
    )
    run_python(code, hash_seed="12345")
    assert tier.contains_many([k]) == [True]
    assert tier.get(k) == bytes(range(256)) * 8192
    tier.remove(k)


def test_concurrent_threads(tier, request):
    values = {_key(request, str(i)): os.urandom(64 << 10) for i in range(16)}
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
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert tier.contains_many(list(values)) == [True] * len(values)
    for k in values:
        tier.remove(k)


def test_server_killed_mid_run_raises_quickly(own_redis):
    t = RedisTier(own_redis.address, timeout_s=1.0)
    t.put("k", b"v" * 4096)
    assert t.get("k") == b"v" * 4096
    own_redis.procs[0].kill()
    own_redis.procs[0].wait(5)
    for call in (
        lambda: t.get("k"),
        lambda: t.put("k2", b"v"),
        lambda: t.contains_many(["k"]),
        lambda: t.remove("k"),
    ):
        start = time.monotonic()
        with pytest.raises(TierError) as ei:
            call()
        assert ei.value.kind in ("unavailable", "timeout")
        assert time.monotonic() - start < 5.0
    t.close()


def test_out_of_memory_put_is_full_and_reads_still_answer(own_redis):
    import redis

    t = RedisTier(own_redis.address, timeout_s=5.0)
    admin = redis.Redis.from_url(own_redis.address)
    try:
        t.put("k", b"v" * 4096)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # below what the server uses: every write refused
        with pytest.raises(TierError) as ei:
            t.put("k2", b"w" * 4096)
        assert ei.value.kind == "full"
        assert t.get("k") == b"v" * 4096 and t.contains_many(["k2"]) == [False]
    finally:
        admin.close()
        t.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="redis://"):
        RedisTier("http://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="ttl_s"):
        RedisTier("redis://127.0.0.1:1/0", ttl_s=0)


def test_unreachable_server_fails_fast():
    t = RedisTier(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(TierError) as ei:
        t.get("k")
    assert ei.value.kind == "unavailable"
    assert time.monotonic() - start < 5.0
    t.close()


def test_server_that_never_answers_times_out():
    listener = socket.socket()  # accepts connections (backlog), never replies
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    t = RedisTier(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(TierError) as ei:
            t.contains_many(["k"])
        assert ei.value.kind == "timeout"
        assert time.monotonic() - start < 5.0
        # one connection per call: no client-side retries multiplying the wait
        listener.setblocking(False)
        attempts = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                listener.accept()[0].close()
                attempts += 1
        assert attempts == 1
    finally:
        t.close()
        listener.close()


def _eventually(fn, want, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while (got := fn()) != want:
        assert time.monotonic() < deadline, f"still {got}, want {want}"
        time.sleep(0.01)
    return got


def test_bytes_in_use_counts_this_instances_entries_the_server_still_holds(
    redis_service, request
):
    mine = RedisTier(redis_service.address, timeout_s=2.0)
    other = RedisTier(redis_service.address, timeout_s=2.0)
    expiring = RedisTier(redis_service.address, ttl_s=1.0, timeout_s=2.0)
    a, b, c, d = (_key(request, n) for n in "abcd")
    assert mine.fetch_bytes_in_use() == 0
    mine.put(a, os.urandom(64 << 10))
    mine.put(b, os.urandom(3 << 20))
    other.put(c, os.urandom(1000))  # another client's entry is not counted
    assert mine.fetch_bytes_in_use() == (64 << 10) + (3 << 20)
    # bytes_in_use answers at once from the last background check: 0, then the figure.
    _eventually(mine.bytes_in_use, (64 << 10) + (3 << 20))
    other.remove(b)  # gone from the server behind this instance's back
    assert mine.fetch_bytes_in_use() == 64 << 10
    mine.remove(a)
    assert mine.fetch_bytes_in_use() == 0
    expiring.put(d, b"x" * 100)
    assert expiring.fetch_bytes_in_use() == 100
    _eventually(lambda: other.get(d), None)  # expired (TTL 1 s); seen by another client
    assert expiring.fetch_bytes_in_use() == 0
    other.remove(c)
    for t in (mine, other, expiring):
        t.close()


def test_bytes_in_use_keeps_the_last_figure_when_the_server_dies(own_redis):
    tier = RedisTier(own_redis.address, timeout_s=1.0)
    tier.put("pdkv:test:k", b"x" * (1 << 20))
    _eventually(lambda: tier.bytes_in_use() >= 1 << 20, True)
    held = tier.bytes_in_use()
    own_redis.stop()
    with pytest.raises(TierError):
        tier.fetch_bytes_in_use()
    assert tier.bytes_in_use() == held
    tier.close()
