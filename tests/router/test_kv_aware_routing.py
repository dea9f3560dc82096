"""The proxy's kv_aware wiring without engines: load claims, the prediction check against an
engine's `pdkv_timings.tokens`, following GET /kv_events (a fake engine over httpx's mock
transport), the oracle's held sets and the --kv-medium-weights flag."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from pdkv.router.backend_info import BackendInfos
from pdkv.router.kv_aware import KVAwareOracle
from pdkv.router.policies import Backend, Claim, Decision, make_policy
from pdkv.router.proxy_cli import medium_weights
from pdkv.router.proxy_metrics import ProxyMetrics
from pdkv.router.proxy_routing import RequestRouter, prediction_outcome

H = [bytes([i]) * 32 for i in range(8)]


def sample(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_prediction_is_capped_like_the_engines_hit() -> None:
    # 5 full blocks of 16 and 3 tokens: the engine may hit all 5 (the last token is computed).
    assert prediction_outcome(5, 16, {"prompt": 83, "cached": 80, "external": 0}) == (80, 80)
    # Exactly 5 blocks: the block holding the last token is never a hit, so at most 4.
    assert prediction_outcome(5, 16, {"prompt": 80, "cached": 64, "external": 0}) == (64, 64)
    # Tokens a connector loaded are not the prefix cache's.
    assert prediction_outcome(2, 16, {"prompt": 83, "cached": 80, "external": 48}) == (32, 32)
    assert prediction_outcome(0, 16, {"prompt": 1, "cached": 0, "external": 0}) == (0, 0)
    for bad in (None, {}, {"prompt": "x", "cached": 0, "external": 0}, [1, 2]):
        assert prediction_outcome(1, 16, bad) is None


def test_claim_counts_load_until_it_ends_and_reports_once() -> None:
    b = Backend("a")
    seen: list[object] = []
    claim = Claim(b, 7, seen.append)
    claim.start()
    assert (b.inflight, b.active_blocks) == (1, 7)
    claim.end({"x": 1})
    assert (b.inflight, b.active_blocks) == (0, 0) and seen == [{"x": 1}]
    claim.start()
    claim.end(None)
    assert seen == [{"x": 1}]  # on_end runs once


def router(routing: str, client: httpx.AsyncClient | None = None,
           metrics: ProxyMetrics | None = None) -> RequestRouter:
    infos = BackendInfos(60.0)
    return RequestRouter(routing, infos, metrics or ProxyMetrics(),
                         lambda: client or httpx.AsyncClient())


def test_kv_aware_claims_check_the_prediction_round_robin_does_not() -> None:
    metrics = ProxyMetrics()
    r = router("kv_aware", metrics=metrics)
    b = Backend("http://e0")
    for predicted, cached, outcome in ((3, 48, "exact"), (3, 16, "over"), (0, 32, "under")):
        claim = r.claim("whole", Decision(b, "kv_hit", predicted, load_blocks=5))
        claim.start()
        assert b.active_blocks == 5
        claim.end({"tokens": {"prompt": 83, "cached": cached, "external": 0}})
        assert sample(metrics, "pdkv:proxy_kv_predictions_total", backend=b.url,
                      outcome=outcome) == 1
    assert sample(metrics, "pdkv:proxy_kv_predicted_cached_tokens_total", backend=b.url) == 96
    assert sample(metrics, "pdkv:proxy_kv_reported_cached_tokens_total", backend=b.url) == 96
    # A fallback decision (no hashes) predicts nothing.
    claim = r.claim("whole", Decision(b, "fallback"))
    claim.start()
    claim.end({"tokens": {"prompt": 83, "cached": 80, "external": 0}})
    assert sample(metrics, "pdkv:proxy_kv_predictions_total", backend=b.url, outcome="under") == 1
    plain = ProxyMetrics()
    claim = router("round_robin", metrics=plain).claim("whole", Decision(b, "round_robin"))
    assert claim.on_end is None


def test_follow_subscribes_once_per_run_and_stops_on_404() -> None:
    answers: dict[str, httpx.Response] = {}

    def engine(request: httpx.Request) -> httpx.Response:
        return answers[str(request.url)]

    info = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:1", "replay_endpoint": None,
            "topic": "", "engine_id": "e", "epoch": 1, "event_encoding": "map",
            "block_size": 16}
    url = "http://e0"

    async def body() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        r = router("kv_aware", client)
        sub = r.subscriber
        assert sub is not None
        try:
            answers[url + "/kv_events"] = httpx.Response(200, json=info)
            await r.follow(url)
            first = sub._tasks[url]
            await r.follow(url)  # the same run: the same subscription
            assert sub._tasks[url] is first
            answers[url + "/kv_events"] = httpx.Response(200, json=dict(info, epoch=2))
            await r.follow(url)  # a restart: followed again
            assert sub._tasks[url] is not first
            answers[url + "/kv_events"] = httpx.Response(404, json={})
            await r.follow(url)
            assert sub.sources() == []
            answers[url + "/kv_events"] = httpx.Response(200, json={"endpoint": 1})
            await r.follow(url)  # unusable: nothing followed, nothing raised
            assert sub.sources() == []
            answers[url + "/kv_events"] = httpx.Response(200, json=info)
            await r.follow(url)
            r.unfollow(url)  # the engine went down
            assert sub.sources() == []
        finally:
            await r.aclose()
            await client.aclose()

    asyncio.run(body())


def test_oracle_decides_on_what_it_was_told_is_held() -> None:
    a, b = Backend("a"), Backend("b")
    oracle = KVAwareOracle()
    hashes = {"a": H[:4], "b": H[:4]}
    oracle.set_held("b", H[:3], 16)
    d = oracle.decide([a, b], hashes)
    assert (d.backend.url, d.reason, d.matched_chunks) == ("b", "kv_hit", 3)
    oracle.set_held("b", [], 16)  # b evicted it: nobody holds anything
    d = oracle.decide([a, b], hashes)
    assert (d.reason, d.matched_chunks) == ("no_match", 0)


def test_kv_policies_are_built_by_the_router_only() -> None:
    with pytest.raises(ValueError, match="KV event index"):
        make_policy("kv_aware")
    assert router("kv_aware_oracle").subscriber is None
    assert router("kv_aware").follows_kv_events


def test_medium_weights_flag() -> None:
    w = medium_weights("dram=0.9, DISK=0.1")
    assert (w["DRAM"], w["DISK"], w["GPU"]) == (0.9, 0.1, 1.0)
    for bad in ("DRAM", "=0.3", "DRAM=x", "FOO=1", "", "GPU=1,,DISK=0.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            medium_weights(bad)
