"""`--skip-prefill-on-pool-hit`: under P/D with a shared pool the proxy sends a prompt straight
to D when its record says the pool holds every loadable chunk (fake engines; no model)."""

from __future__ import annotations

import httpx
import pytest

from pdkv.router.pool_record import PoolRecord, loadable_chunks
from pdkv.router.proxy import build_proxy_app
from tests.router.fake_engines import FakeEngine, ServerThread


def test_pool_record_covers_only_when_every_hash_is_remembered_and_is_bounded():
    rec = PoolRecord(max_entries=3)
    rec.add([b"a", b"b"])
    assert rec.covers([b"a", b"b"]) and not rec.covers([b"a", b"c"]) and not rec.covers([])
    rec.add([b"c", b"d"])  # "a" was the least recently used
    assert len(rec) == 3 and not rec.covers([b"a"]) and rec.covers([b"b", b"c", b"d"])
    assert [loadable_chunks(n, 64) for n in (1, 64, 65, 129, 130)] == [0, 0, 1, 2, 2]
    with pytest.raises(ValueError):
        PoolRecord(0)


@pytest.fixture
def pd():
    p = FakeEngine("kv_producer", pool_chunk_size=32)
    d = FakeEngine("kv_consumer", pool_chunk_size=32)
    srv = ServerThread(build_proxy_app([p.url], [d.url], skip_prefill_on_pool_hit=True))
    yield p, d, srv.url
    srv.stop()
    p.stop()
    d.stop()


def _post(url: str, prompt: list[int], **extra: object) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, **extra}, timeout=10
    )


def _skipped(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdkv:proxy_prefill_legs_skipped_total"))


def test_a_prompt_the_pool_holds_goes_straight_to_d(pd):
    p, d, url = pd
    prompt = list(range(100, 165))  # 65 tokens: 2 loadable chunks of 32
    assert _post(url, prompt).status_code == 200
    assert (p.hits["prefill"], d.hits["decode"], _skipped(url)) == (1, 1, 0)
    assert d.decode_params[-1]["do_remote_prefill"]
    assert _post(url, prompt).status_code == 200  # P saved it: no prefill leg this time
    assert (p.hits["prefill"], d.hits["decode"], _skipped(url)) == (1, 2, 1)
    assert d.decode_params[-1] is None  # D computes with its pool: no P params
    longer = prompt + list(range(7, 40))  # its third chunk was never prefilled: P again
    assert _post(url, longer).status_code == 200 and p.hits["prefill"] == 2
    salted = _post(url, prompt, cache_salt="tenant-b")  # another salt: other chunk hashes
    assert salted.status_code == 200 and p.hits["prefill"] == 3 and _skipped(url) == 1
    short = list(range(100, 132))  # 32 tokens: nothing loadable, never skipped
    _post(url, short)
    _post(url, short)
    assert p.hits["prefill"] == 5


def test_no_skip_without_a_shared_chunking_or_in_colocated_mode():
    p = FakeEngine("kv_producer", pool_chunk_size=32)
    d = FakeEngine("kv_consumer", pool_chunk_size=64)  # another chunk size: other keys
    srv = ServerThread(build_proxy_app([p.url], [d.url], skip_prefill_on_pool_hit=True))
    try:
        for _ in range(2):
            assert _post(srv.url, list(range(100, 229))).status_code == 200
        assert p.hits["prefill"] == 2 and _skipped(srv.url) == 0
    finally:
        srv.stop()
        p.stop()
        d.stop()
    with pytest.raises(ValueError, match="skip-prefill-on-pool-hit"):
        build_proxy_app([], [], backend_urls=["http://127.0.0.1:1"], skip_prefill_on_pool_hit=True)
