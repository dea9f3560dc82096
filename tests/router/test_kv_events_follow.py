"""The router's subscriber on real `pdkv serve` processes (tiny-llama-kv2): GET /kv_events says
where to subscribe, a prompt served by the engine shows up in the index with the block hashes a
router computes from the same token ids, and a restart of the engine on the same endpoints
clears what the index held for it once the router follows the new run (as the proxy does when GET
/kv_events shows a new engine id or epoch). Without --kv-events-config, GET /kv_events is a 404."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import httpx

from pdkv.block_hashing import hash_request_tokens
from pdkv.ports import free_port
from pdkv.router.kv_index import KVIndex
from pdkv.router.kv_subscriber import EventSource, KVEventSubscriber

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
from server_utils import RemoteServer  # noqa: E402

DEADLINE_S = 30.0
PROMPT = [(7 * i) % 900 + 3 for i in range(3 * 16 + 5)]  # 3 full blocks of 16


def server(events: dict | None, port: int | None = None) -> RemoteServer:
    args = ["serve", "--model", "tiny-llama-kv2", "--num-kv-blocks", "64", "--max-model-len",
            "128", "--block-size", "16"]
    if events is not None:
        args += ["--kv-events-config", json.dumps(events)]
    return RemoteServer(args, timeout=120, port=port)


def complete(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


async def until(cond, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_served_prompt_is_indexed_and_a_restart_clears_it() -> None:
    taken: set[int] = set()
    events = {"enable_kv_cache_events": True, "topic": "kv",
              "endpoint": f"tcp://127.0.0.1:{free_port(taken)}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port(taken)}"}
    hashes = hash_request_tokens(PROMPT, 16)
    assert len(hashes) == 3
    srv = server(events)

    async def body() -> None:
        nonlocal srv
        info = httpx.get(srv.url + "/kv_events", timeout=10).json()
        assert (info["endpoint"], info["block_size"], info["topic"]) == (
            events["endpoint"], 16, "kv")
        index = KVIndex()
        sub = KVEventSubscriber(index)
        # The index is keyed by the URL the router routes to; a restart below keeps it.
        sub.add(EventSource.from_info(srv.url, info))
        try:
            await asyncio.to_thread(complete, srv.url)
            await until(lambda: index.overlap(srv.url, hashes, 16).engine_blocks == 3,
                        "the prompt's 3 blocks")
            url, first_epoch = srv.url, info["epoch"]
            srv.stop()
            srv = server(events, port=srv.port)  # same URL, same event endpoints
            again = httpx.get(srv.url + "/kv_events", timeout=10).json()
            assert again["epoch"] != first_epoch and srv.url == url
            # A restart without a fixed engine id (no kv connector here) comes back under a new
            # one, which the SUB socket's subscription filters out: the router learns of it from
            # GET /kv_events, as the proxy's periodic refresh does, and follows the new run.
            assert again["engine_id"] != info["engine_id"]
            sub.add(EventSource.from_info(url, again))
            assert index.num_blocks(url) == {}  # the old run's entries are gone at once
            await asyncio.to_thread(complete, srv.url)
            await until(lambda: index.overlap(url, hashes, 16).engine_blocks == 3,
                        "the prompt's blocks from the new run")
            assert sub.counters().gaps_unfilled == 0
        finally:
            await sub.close()

    try:
        asyncio.run(body())
    finally:
        srv.stop()


def test_kv_events_is_404_without_the_config() -> None:
    with server(None) as srv:
        r = httpx.get(srv.url + "/kv_events", timeout=10)
        assert r.status_code == 404 and "kv-events-config" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/kv_events/held", json={"block_hashes": []}, timeout=10)
        assert r.status_code == 404 and "kv-events-config" in r.json()["error"]["message"]


def test_held_blocks_answer_what_the_prefix_cache_holds() -> None:
    """POST /kv_events/held (the routing oracle's truth): the leading blocks of a prompt the
    engine's prefix cache holds, before and after serving it; bad hashes are a 400."""
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"}
    hashes = [h.hex() for h in hash_request_tokens(PROMPT, 16)]

    def held(body: object) -> httpx.Response:
        return httpx.post(srv.url + "/kv_events/held", json=body, timeout=10)

    with server(events) as srv:
        assert held({"block_hashes": hashes}).json() == {"held_blocks": 0, "block_size": 16}
        complete(srv.url)
        assert held({"block_hashes": hashes}).json() == {"held_blocks": 3, "block_size": 16}
        other = "ab" * 32
        assert held({"block_hashes": [hashes[0], other, hashes[2]]}).json()["held_blocks"] == 1
        for bad in ({"block_hashes": ["zz"]}, {"block_hashes": ["ab" * 31]},
                    {"block_hashes": [other] * 10}, {"block_hashes": 3}, {}):
            r = held(bad)
            assert r.status_code == 400, (bad, r.text)
