"""prefix_aware routing: the policy on fake backends, chunk hashes as the pool computes them, and
the proxy's colocated mode (fake engines; no model)."""

from __future__ import annotations

import sys

import httpx
import pytest

from pdkv.block_hashing import hash_request_tokens
from pdkv.kvpool.keys import chunk_hashes
from pdkv.router.policies import Backend, PrefixAware, PrefixAwareConfig, make_policy
from pdkv.router.prefix_keys import Granularity, KeysUnavailable, RequestKeyer, request_chunk_hashes
from pdkv.router.proxy import build_proxy_app
from tests.router.fake_engines import FakeEngine, ServerThread

H = [bytes([i]) * 32 for i in range(10)]


def _policy(imbalance: float = 0.5, entries: int = 1000) -> PrefixAware:
    return PrefixAware(PrefixAwareConfig(max_imbalance=imbalance, max_entries=entries))


def _same(hashes, backends):
    return {b.url: hashes for b in backends}


def test_longest_recorded_prefix_wins():
    a, b, c = Backend("a"), Backend("b"), Backend("c")
    pol = _policy(imbalance=10)
    pol.record("a", H[:1])
    pol.record("b", H[:2])
    pol.record("c", [H[0], H[5]])  # a different second chunk: only chunk 0 matches
    d = pol.decide([a, b, c], _same(H[:3], [a, b, c]))
    assert (d.backend.url, d.reason, d.matched_chunks) == ("b", "prefix_hit", 2)
    # The decision is recorded: b now holds all three chunks.
    assert pol.matched("b", H[:3]) == 3


def test_equal_prefixes_go_to_the_least_loaded():
    a, b, c = Backend("a", inflight=2), Backend("b", inflight=1), Backend("c")
    pol = _policy(imbalance=10)
    for url in ("a", "b"):
        pol.record(url, H[:2])
    d = pol.decide([a, b, c], _same(H[:2], [a, b, c]))
    assert (d.backend.url, d.reason) == ("b", "prefix_hit")


def test_load_bound_sends_a_prefix_elsewhere():
    a, b = Backend("a", inflight=3), Backend("b")
    strict = _policy(imbalance=0.5)
    strict.record("a", H[:4])
    # a would hold 4 of 4 in flight; the mean would be 2, the bound 1.5 x 2 = 3.
    d = strict.decide([a, b], _same(H[:4], [a, b]))
    assert (d.backend.url, d.reason, d.matched_chunks) == ("b", "load", 0)
    loose = _policy(imbalance=1.0)  # bound 2 x 2 = 4: a may take it
    loose.record("a", H[:4])
    d = loose.decide([a, b], _same(H[:4], [a, b]))
    assert (d.backend.url, d.reason, d.matched_chunks) == ("a", "prefix_hit", 4)


def test_idle_backends_always_qualify():
    """Concurrency 1: whatever the bound, the backend holding the prefix gets the request."""
    a, b = Backend("a"), Backend("b")
    pol = _policy(imbalance=0.0)
    pol.record("b", H[:1])
    assert pol.decide([a, b], _same(H[:2], [a, b])).backend.url == "b"


def test_misses_and_unknown_keys_go_least_loaded():
    a, b = Backend("a", inflight=1), Backend("b")
    pol = _policy()
    d = pol.decide([a, b], _same(H[:2], [a, b]))
    assert (d.backend.url, d.reason) == ("b", "no_match")
    d = pol.decide([a, b], None)
    assert (d.backend.url, d.reason) == ("b", "fallback")
    assert len(pol) == 2  # the miss was recorded for b, the fallback recorded nothing


def test_memory_is_bounded_and_the_deepest_chunks_go_first():
    pol = _policy(entries=4)
    pol.record("a", H[:3])
    pol.record("b", H[5:7])
    assert len(pol) == 4
    assert pol.matched("a", H[:3]) == 2  # a's third chunk was forgotten, its first two kept
    assert pol.matched("b", H[5:7]) == 2
    pol.record("c", H[:4])
    assert len(pol) == 4 and pol.matched("c", H[:4]) == 4
    assert pol.matched("a", H[:3]) == 0 and pol.matched("b", H[5:7]) == 0


def test_bad_config_and_names():
    with pytest.raises(ValueError, match="max_imbalance"):
        PrefixAwareConfig(max_imbalance=-0.1)
    with pytest.raises(ValueError, match="max_entries"):
        PrefixAwareConfig(max_entries=0)
    assert make_policy("prefix_aware").wants_hashes
    assert not make_policy("round_robin").wants_hashes


def test_chunk_hashes_are_the_pools():
    ids = list(range(1000, 1000 + 200))
    gran = Granularity(16, 64)
    got = request_chunk_hashes(ids, gran, "salt")
    assert got == chunk_hashes(hash_request_tokens(ids, 16, "salt"), 16, 64, 200)
    assert len(got) == 3
    assert request_chunk_hashes(ids[:130], gran, "salt") == got[:2]  # a shared prefix shares hashes
    assert request_chunk_hashes(ids, gran, None)[0] != got[0]  # the salt changes every chunk
    with pytest.raises(ValueError):
        Granularity(16, 40)


def test_keyer_takes_token_ids_without_a_tokenizer_and_stays_torch_free():
    keyer = RequestKeyer(None)
    assert keyer.token_ids({"prompt": [5, 6, 7]}, chat=False) == [5, 6, 7]
    assert keyer.token_ids({"prompt": [[5, 6]]}, chat=False) == [5, 6]
    with pytest.raises(KeysUnavailable):
        keyer.token_ids({"prompt": "text needs a tokenizer"}, chat=False)


def test_engines_report_the_pool_chunk_size():
    from pdkv.serve.api_server import pool_chunk_size

    assert pool_chunk_size("KVPoolConnector", {"chunk_size": 64}) == 64
    assert pool_chunk_size("KVPoolConnector", {}) == 256
    assert pool_chunk_size("MultiConnector", {"connectors": [
        {"kv_connector": "P2PConnector"}, {"kv_connector": "KVPoolConnector",
                                           "kv_connector_extra_config": {"chunk_size": 32}}]}) == 32
    assert pool_chunk_size("P2PConnector", {}) is None


def test_proxy_modules_do_not_import_torch():
    import subprocess

    code = (
        "import sys, pdkv.router.proxy, pdkv.router.prefix_keys, pdkv.launch.launcher; "
        "from pdkv.router.prefix_keys import RequestKeyer; "
        "RequestKeyer(None).token_ids({'prompt': [1]}, False); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture
def colocated():
    engines = [FakeEngine("kv_both"), FakeEngine("kv_both")]
    started = []

    def start(routing: str, **kw):
        app = build_proxy_app([], [], routing, backend_urls=[e.url for e in engines], **kw)
        srv = ServerThread(app)
        started.append(srv)
        return srv.url

    yield engines, start
    for s in started:
        s.stop()
    for e in engines:
        e.stop()


def _post(url: str, prompt: list[int], stream: bool = False) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "stream": stream},
        timeout=10,
    )


def _metric(url: str, line_start: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)
    )


def test_colocated_prefix_aware_sends_a_continuation_where_its_prefix_went(colocated):
    engines, start = colocated
    url = start("prefix_aware")
    conv_a, conv_b = list(range(100, 148)), list(range(500, 548))  # 3 blocks each
    seen = []
    # Round-robin would alternate 0, 1, 0, 1, 0; the continuations follow their prefixes instead.
    for prompt in (
        conv_a,
        conv_b,
        conv_b + [7] * 20,
        conv_a + list(range(900, 940)),
        conv_a + [1] * 100,
    ):
        before = [e.hits["decode"] for e in engines]
        r = _post(url, prompt, stream=len(seen) % 2 == 1)
        assert r.status_code == 200
        seen.append([e.hits["decode"] - b for e, b in zip(engines, before)].index(1))
    assert seen[0] != seen[1]  # idle tie: spread
    assert seen[2] == seen[1] and seen[3] == seen[4] == seen[0]
    assert (
        _metric(
            url,
            'pdkv:proxy_routing_decisions_total{leg="whole",policy="prefix_aware",reason="prefix_hit"}',
        )
        == 3
    )
    assert (
        _metric(
            url,
            'pdkv:proxy_routing_decisions_total{leg="whole",policy="prefix_aware",reason="no_match"}',
        )
        == 2
    )
    assert _metric(url, "pdkv:proxy_prefix_matched_tokens_total") == 3 * 48
    home = engines[seen[0]].url
    assert _metric(url, f'pdkv:proxy_requests_total{{backend="{home}",leg="whole"}}') == 3
    assert _metric(url, 'pdkv:proxy_leg_latency_seconds_count{leg="whole"}') == 5
    assert _metric(url, "pdkv:proxy_prefill_legs_skipped_total") == 0
    assert all(e.hits["prefill"] == 0 for e in engines)  # the whole request, never a prefill leg


def test_colocated_round_robin_alternates_and_counts_errors(colocated):
    engines, start = colocated
    url = start("round_robin")
    for _ in range(4):
        assert _post(url, [1, 2, 3] * 20).status_code == 200
    assert [e.hits["decode"] for e in engines] == [2, 2]
    engines[1].decode_error = (400, "nope")
    codes = sorted(_post(url, [1, 2]).status_code for _ in range(2))
    assert codes == [200, 400]  # the backend's error passes through
    assert (
        _metric(url, 'pdkv:proxy_errors_total{kind="client",leg="whole"}') == 1
    )  # a 4xx: the client's
    assert (
        _metric(
            url,
            'pdkv:proxy_routing_decisions_total{leg="whole",policy="round_robin",reason="round_robin"}',
        )
        == 6
    )


def test_colocated_unreachable_backend_is_502_then_skipped():
    """The instance dies after a probe found it healthy: the request that finds it down is a 502;
    the next one is a 503 without a leg (no healthy instance is left)."""
    engine = FakeEngine(None)
    srv = ServerThread(build_proxy_app([], [], "least_loaded", backend_urls=[engine.url]))
    try:
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        engine.stop()
        r = _post(srv.url, [1, 2, 3])
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
        assert _metric(srv.url, 'pdkv:proxy_errors_total{kind="unreachable",leg="whole"}') == 1
        r = _post(srv.url, [1, 2, 3])
        assert r.status_code == 503 and "no healthy backend" in r.json()["error"]["message"]
        assert _metric(srv.url, 'pdkv:proxy_errors_total{kind="unavailable",leg="whole"}') == 1
    finally:
        srv.stop()


def test_modes_are_exclusive():
    with pytest.raises(ValueError, match="either"):
        build_proxy_app(["http://p"], ["http://d"], backend_urls=["http://x"])
    with pytest.raises(ValueError, match="at least one"):
        build_proxy_app([], [])
