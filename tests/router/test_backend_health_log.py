"""The proxy's log of its engines' health: an engine that is not up yet when the proxy starts
(the usual start-up order) is an INFO line, not a warning; once it has answered, losing it is a
WARNING, and coming back is INFO. Probes go to an httpx mock transport whose answers the test
sets."""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client import CollectorRegistry, Gauge

from pdkv.router.backend_health import BackendHealth, HealthCheckConfig
from pdkv.router.policies import Backend

URL = "http://127.0.0.1:1"


def test_down_at_start_is_info_and_down_after_up_is_a_warning(caplog) -> None:
    up = {"ok": False}

    def answer(request: httpx.Request) -> httpx.Response:
        if not up["ok"]:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return httpx.Response(200)

    gauge = Gauge("healthy", "h", ["backend", "role"], registry=CollectorRegistry())
    health = BackendHealth([("decode", Backend(URL))], HealthCheckConfig(), gauge)

    async def probes(*states: bool) -> list[bool]:
        out = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            for state in states:
                up["ok"] = state
                out.append(await health.probe(client, URL))
        return out

    with caplog.at_level(logging.INFO, logger="pdkv.router.backend_health"):
        assert asyncio.run(probes(False, False, True, False, True)) == [False, False, True,
                                                                       False, True]
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("INFO", f"backend {URL} is not up yet: GET /health failed: ConnectError: All connection "
                 "attempts failed"),
        ("INFO", f"backend {URL} is up"),
        ("WARNING", f"backend {URL} is unhealthy: GET /health failed: ConnectError: All "
                    "connection attempts failed"),
        ("INFO", f"backend {URL} is healthy again"),
    ]
