"""BackendInfos: a request waits only for engines the proxy knows nothing about; stale infos are
refetched in the background, and concurrent callers share one fetch per engine."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
from fake_engines import LAYOUT

from pdkv.router.backend_info import BackendInfos

URL = "http://d.test"
HANG_GUARD_S = 30.0
"""Bounds an await that must not block, so a broken build fails instead of hanging (not a
timing goal: the awaits below return without waiting on the network)."""


class FakeD:
    """GET /kv_layout and /v1/models of a decode engine, counted; `gate` holds the answers while
    cleared, and `max_model_len` is what /v1/models reports now."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.gate = asyncio.Event()
        self.gate.set()
        self.max_model_len = 512

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.hits[request.url.path] += 1
        await self.gate.wait()
        if request.url.path == "/kv_layout":
            return httpx.Response(200, json={"kv_role": "kv_consumer", "engine_id": "d",
                                             "layout": LAYOUT})
        return httpx.Response(200, json={"data": [{"id": "smollm2",
                                                   "max_model_len": self.max_model_len}]})


def _client(d: FakeD) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(d.handle))


def test_a_stale_info_is_refetched_in_the_background_not_on_the_request_path():
    async def main() -> None:
        d = FakeD()
        infos = BackendInfos(ttl=0.0)  # every known info is stale at once
        async with _client(d) as client:
            await infos.ensure(client, [URL])  # unknown: fetched before it returns
            info = infos.get(URL)
            assert info is not None and info.max_model_len == 512
            assert d.hits["/kv_layout"] == 1
            d.gate.clear()  # D stops answering
            d.max_model_len = 1024
            # Stale but known: returns at once with what is known, a refetch under way.
            await asyncio.wait_for(infos.ensure(client, [URL]), HANG_GUARD_S)
            assert infos.get(URL) is info
            while d.hits["/kv_layout"] < 2:  # the background refetch reaches D
                await asyncio.sleep(0)
            d.gate.set()
            fresh = await asyncio.wait_for(infos.refresh(client, URL), HANG_GUARD_S)
            assert fresh is not None and fresh.max_model_len == 1024
            assert infos.get(URL) is fresh
            assert d.hits["/kv_layout"] == 2  # refresh joined the fetch under way
            await infos.aclose()

    asyncio.run(main())


def test_concurrent_callers_share_one_fetch_per_engine():
    async def main() -> None:
        d = FakeD()
        d.gate.clear()
        infos = BackendInfos(ttl=5.0)
        async with _client(d) as client:
            waiting = [asyncio.ensure_future(infos.ensure(client, [URL])) for _ in range(8)]
            while d.hits["/kv_layout"] < 1:
                await asyncio.sleep(0)
            d.gate.set()
            await asyncio.wait_for(asyncio.gather(*waiting), HANG_GUARD_S)
            assert d.hits["/kv_layout"] == 1 and d.hits["/v1/models"] == 1
            info = infos.get(URL)
            assert info is not None and info.max_model_len == 512
            await infos.aclose()

    asyncio.run(main())


def test_aclose_cancels_a_fetch_under_way():
    async def main() -> None:
        d = FakeD()
        d.gate.clear()
        infos = BackendInfos(ttl=5.0)
        async with _client(d) as client:
            waiter = asyncio.ensure_future(infos.ensure(client, [URL]))
            while d.hits["/kv_layout"] < 1:
                await asyncio.sleep(0)
            await asyncio.wait_for(infos.aclose(), HANG_GUARD_S)
            await asyncio.wait_for(asyncio.gather(waiter, return_exceptions=True), HANG_GUARD_S)
            assert waiter.cancelled() and infos.get(URL) is None

    asyncio.run(main())
