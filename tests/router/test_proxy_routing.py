"""Routing policies, and the proxy spreading requests over several prefill and decode engines
(mock backends speaking the P/D protocol; no model)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from pdkv.ports import free_port
from pdkv.router.policies import Backend, LeastLoaded, RoundRobin, make_policy
from pdkv.router.proxy import build_proxy_app
from pdkv.router.proxy_protocol import prefill_body


def test_round_robin_cycles():
    backends = [Backend("a"), Backend("b"), Backend("c")]
    rr = RoundRobin()
    assert [rr.choose(backends).url for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_prefers_idle_and_rotates_ties():
    a, b, c = Backend("a", inflight=2), Backend("b"), Backend("c")
    ll = LeastLoaded()
    assert {ll.choose([a, b, c]).url for _ in range(4)} == {"b", "c"}
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_prefill_body_follows_vllm_proxy_protocol():
    body = {"prompt": "x", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3}
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50 and body["min_tokens"] == 3  # the original is untouched


class _Mock:
    """A fake engine: records who it served, answers like a P (params) or a D (text)."""

    def __init__(self, name: str, hits: Counter) -> None:
        self.port = free_port(set())
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(req: Request):
            body = await req.json()
            hits[name] += 1
            params = body.get("kv_transfer_params") or {}
            if params.get("do_remote_decode"):
                return {"choices": [{"text": "x"}], "kv_transfer_params": {"from": name}}
            return {"choices": [{"text": f"decoded by {name} after {params.get('from')}"}]}

        @app.get("/health")
        async def health():
            return {}

        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.mark.parametrize("routing", ["round_robin", "least_loaded"])
def test_proxy_spreads_sequential_requests_over_both_pools(routing):
    hits: Counter = Counter()
    mocks = [_Mock(n, hits) for n in ("p0", "p1", "d0", "d1")]
    try:
        app = build_proxy_app([mocks[0].url, mocks[1].url], [mocks[2].url, mocks[3].url], routing)
        proxy = _ProxyThread(app)
        try:
            texts = [
                httpx.post(
                    proxy.url + "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 4},
                    timeout=10,
                ).json()["choices"][0]["text"]
                for _ in range(8)
            ]
        finally:
            proxy.stop()
        assert hits == Counter({"p0": 4, "p1": 4, "d0": 4, "d1": 4})
        # Each decode leg carried the params of its own prefill leg.
        assert all(t.startswith("decoded by d") and t.endswith(("p0", "p1")) for t in texts)
        assert {t.split()[-1] for t in texts} == {"p0", "p1"}
    finally:
        for m in mocks:
            m.stop()


class _ProxyThread:
    def __init__(self, app: FastAPI) -> None:
        self.port = free_port(set())
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
