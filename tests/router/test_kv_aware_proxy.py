"""kv_aware through `pdkv proxy` over real engines (tiny-llama-kv2, colocated): a prompt goes to
the instance that holds it; after that instance evicted it (traffic the proxy never saw), to the
least-loaded one; every prediction the proxy made matches the prefix-cache hit the engine
reported. The index is read only through the proxy's metrics: before each decision the test waits
until the proxy has applied every event each engine published (its per-backend event count equals
the engine's), so no decision races an event in flight. Load is made deterministic by stopping
both engine processes (SIGSTOP) while a request is in flight to one of them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from pdkv.bench.compare.routing import scrape
from pdkv.bench.compare.routing import total as labelled
from pdkv.block_hashing import hash_request_tokens

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
from server_utils import RemoteServer  # noqa: E402

DEADLINE_S = 30.0
BLOCK = 16
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
                     "replay_endpoint": "tcp://127.0.0.1:0"})
ENGINE = ["serve", "--model", "tiny-llama-kv2", "--num-kv-blocks", "24", "--max-model-len",
          "256", "--block-size", str(BLOCK), "--kv-events-config", EVENTS]


def prompt(seed: int, blocks: int = 5) -> list[int]:
    """`blocks` full blocks and 3 more tokens (distinct per seed from the first token on)."""
    return [(seed * 131 + 7 * i) % 900 + 3 for i in range(blocks * BLOCK + 3)]


def until(cond, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def complete(url: str, ids: list[int], max_tokens: int = 2) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": max_tokens,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_kv_aware_routes_to_the_holder_then_after_eviction_to_the_least_loaded() -> None:
    engines = [RemoteServer(ENGINE, wait=False, timeout=120)]
    engines.append(RemoteServer(ENGINE, wait=False, timeout=120, avoid=(engines[0].port,)))
    proxy = None
    try:
        for e in engines:
            e.wait_healthy()
        urls = [e.url for e in engines]
        # Probes only at start: the engines are stopped for a moment below, and a probe then
        # would mark one down (routing by health, not by load).
        proxy = RemoteServer(["proxy", "--backends", ",".join(urls), "--routing", "kv_aware",
                              "--health-check-interval-secs", "600", "--timeout", "60"],
                             timeout=60, avoid=tuple(e.port for e in engines))

        def legs() -> dict[str, float]:
            m = scrape(proxy.url)
            return {u: labelled(m, "pdkv:proxy_requests_total", backend=u, leg="whole")
                    for u in urls}

        def synced() -> bool:
            m = scrape(proxy.url)
            for u in urls:
                published = labelled(scrape(u), "pdkv:kv_events_events_published_total")
                if labelled(m, "pdkv:proxy_kv_events_replays_total", backend=u) < 1:
                    return False  # not followed yet
                if labelled(m, "pdkv:proxy_kv_events_events_total", backend=u) != published:
                    return False
            return True

        def routed(ids: list[int]) -> tuple[str, dict]:
            until(synced, "the proxy to apply every published event")
            before = legs()
            answer = complete(proxy.url, ids)
            after = legs()
            (url,) = [u for u in urls if after[u] == before[u] + 1]
            return url, answer

        def cached(answer: dict) -> int:
            return answer["pdkv_timings"]["legs"]["whole"]["tokens"]["cached"]

        a = prompt(1)
        held, first = routed(a)
        assert cached(first) == 0
        for _ in range(2):  # both engines idle: only what `held` holds decides
            url, again = routed(a)
            assert url == held and cached(again) == 5 * BLOCK

        # Traffic the proxy never sees evicts the prompt from `held` (24 blocks in all).
        for seed in range(10, 18):
            complete(held, prompt(seed))
        hashes = [h.hex() for h in hash_request_tokens(a, BLOCK)]
        r = httpx.post(held + "/kv_events/held", json={"block_hashes": hashes}, timeout=10)
        assert r.status_code == 200 and r.json() == {"held_blocks": 0, "block_size": BLOCK}
        until(synced, "the evictions to reach the proxy")

        # A one-block request in flight on `held` (it holds that block: the last prompt above),
        # with both engines stopped so that nothing finishes; then the prompt. Nobody holds it
        # now, so it goes to the other, idle engine. (An index that missed the evictions would
        # send it to `held`: 5 cached blocks outweigh 1 block of load.)
        before = legs()
        results: dict[str, dict] = {}
        for e in engines:
            os.kill(e.proc.pid, signal.SIGSTOP)
        try:
            busy = threading.Thread(target=lambda: results.update(c=complete(
                proxy.url, prompt(17, blocks=1))))
            busy.start()
            until(lambda: sum(legs().values()) == sum(before.values()) + 1, "the busy leg")
            assert legs()[held] == before[held] + 1
            late = threading.Thread(target=lambda: results.update(a=complete(proxy.url, a)))
            late.start()
            until(lambda: sum(legs().values()) == sum(before.values()) + 2, "the prompt's leg")
            free = [u for u in urls if u != held][0]
            assert legs()[free] == before[free] + 1
        finally:
            for e in engines:
                os.kill(e.proc.pid, signal.SIGCONT)
        busy.join(DEADLINE_S)
        late.join(DEADLINE_S)
        assert not busy.is_alive() and not late.is_alive()
        assert cached(results["a"]) == 0 and cached(results["c"]) == BLOCK

        m = scrape(proxy.url)
        assert labelled(m, "pdkv:proxy_routing_decisions_total", policy="kv_aware",
                        reason="kv_hit") == 3
        assert labelled(m, "pdkv:proxy_routing_decisions_total", policy="kv_aware",
                        reason="no_match") == 2
        # Every prediction matched the engine's own report: 3 legs, then 2, none over or under.
        assert labelled(m, "pdkv:proxy_kv_predictions_total", outcome="exact") == 5
        assert labelled(m, "pdkv:proxy_kv_predictions_total", outcome="over") == 0
        assert labelled(m, "pdkv:proxy_kv_predictions_total", outcome="under") == 0
        assert labelled(m, "pdkv:proxy_kv_predicted_cached_tokens_total") == 2 * 5 * BLOCK + BLOCK
        assert labelled(m, "pdkv:proxy_kv_index_blocks", backend=held, medium="GPU") > 0
    finally:
        if proxy is not None:
            proxy.stop()
        for e in engines:
            e.stop()


def test_kv_aware_chooses_the_prefill_engine_that_holds_the_prompt_in_pd() -> None:
    """`pdkv up --mode pd --num-prefill 2 --routing kv_aware`: a repeated prompt's prefill legs
    all go to the prefill engine that computed it first, which reports the prefix-cache hit the
    proxy predicted."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdkv.cli", "up", "--mode", "pd", "--num-prefill", "2",
         "--num-decode", "1", "--model", "tiny-llama-kv2", "--routing", "kv_aware",
         "--threads-per-engine", "1", "--", "--num-kv-blocks", "64", "--max-model-len", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        urls: dict[str, str] = {}
        end = time.monotonic() + 180
        assert proc.stdout is not None
        while "ready" not in urls:
            line = proc.stdout.readline()
            assert line and time.monotonic() < end, f"pdkv up did not come up: {urls}"
            m = re.match(r"\s+(\w+): .*?(http://\S+?),", line)
            if m:
                urls[m.group(1)] = m.group(2)
            if line.startswith("ready: "):
                urls["ready"] = line.split()[1]
        proxy = urls["ready"]
        prefills = [urls["prefill0"], urls["prefill1"]]
        engines = [*prefills, urls["decode0"]]

        def synced() -> bool:
            m = scrape(proxy)
            return all(
                labelled(m, "pdkv:proxy_kv_events_replays_total", backend=u) >= 1
                and labelled(m, "pdkv:proxy_kv_events_events_total", backend=u)
                == labelled(scrape(u), "pdkv:kv_events_events_published_total")
                for u in engines)

        a = prompt(3)
        answers = []
        for _ in range(3):
            until(synced, "the proxy to apply every published event")
            answers.append(complete(proxy, a))
        m = scrape(proxy)
        legs = [labelled(m, "pdkv:proxy_requests_total", backend=u, leg="prefill")
                for u in prefills]
        assert sorted(legs) == [0, 3]
        assert [x["pdkv_timings"]["legs"]["prefill"]["tokens"]["cached"] for x in answers] == [
            0, 5 * BLOCK, 5 * BLOCK]
        assert labelled(m, "pdkv:proxy_routing_decisions_total", leg="prefill",
                        reason="kv_hit") == 2
        holder = prefills[legs.index(3)]
        assert labelled(m, "pdkv:proxy_kv_predictions_total", backend=holder,
                        outcome="exact") == 3
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
