"""The proxy's push flow (pdkv/router/proxy_push.py) against fake engines that report
transfer_mode "push": D's leg goes first, the proxy asks D for its window and hands it to P; D's
refusal, a window that never opens and P's failure each end the request without leaving D's leg
open; a client that leaves abandons D's leg; n > 1 takes the pull flow. No model."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

sys.path.insert(0, os.path.dirname(__file__))

from fake_engines import LAYOUT, ServerThread  # noqa: E402

from pdkv.router.proxy import build_proxy_app  # noqa: E402

GRANT = {"engine_id": "e-d", "request_id": "?", "nonce": "n0", "block_ids": [[5, 6]],
         "first_block": 0, "prompt_digest": "d", "host": "127.0.0.1", "port": 1, "lease_s": 30.0,
         "num_tokens": 20, "block_size": 16, "layout": LAYOUT}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "X", "param": None,
                                   "code": status}}, status_code=status)


class PushPair:
    """A fake P and D in push mode. D's request waits until P "pushed" (P received the grant D
    issued) and records whether its client left first; `events` is the order things happened."""

    def __init__(self, d_mode: str = "push", d_block_size: int = 16,
                 push_block_sizes: tuple[str | None, str | None] = (None, None)) -> None:
        self.d_block_size = d_block_size
        self.push_block_sizes = push_block_sizes  # (P's, D's) in GET /kv_layout; None: unsaid
        self.events: list[str] = []
        self.pushed = threading.Event()
        self.d_gone = threading.Event()  # D saw its decode leg's client leave
        self.d_refuse: tuple[int, str] | None = None
        self.no_window = False
        self.d_whole_hit = False  # D holds the whole prompt: it answers without waiting for P
        self.window_hold: threading.Event | None = None  # the window route waits for it
        self.p_status = 200
        self.p_hold: threading.Event | None = None
        self.p_params: list[Any] = []
        self.d_params: list[Any] = []
        self.windows: dict[str, dict[str, Any]] = {}
        self.first_token: int | None = None  # P's answer carries it (a linear-state model)
        self.tokens_given: list[tuple[str, Any]] = []  # what D got on push_first_token
        self.p = ServerThread(self._p_app())
        self.d = ServerThread(self._d_app(d_mode))

    def _layout(self, role: str, mode: str) -> dict[str, Any]:
        layout = dict(LAYOUT, block_size=self.d_block_size) if role == "kv_consumer" else LAYOUT
        info = {"kv_role": role, "engine_id": "e-" + role, "layout": layout,
                "pool_chunk_size": None, "transfer_mode": mode}
        sizes = self.push_block_sizes[role == "kv_consumer"]
        return info if sizes is None else {**info, "push_block_sizes": sizes}

    def _common(self, app: FastAPI, role: str, mode: str) -> None:
        app.get("/kv_layout")(lambda: self._layout(role, mode))
        app.get("/health")(lambda: {})
        app.get("/v1/models")(lambda: {"object": "list", "data": [
            {"id": "smollm2", "max_model_len": 512}]})

    def _p_app(self) -> FastAPI:
        app = FastAPI()
        self._common(app, "kv_producer", "push")

        @app.post("/v1/completions")
        async def prefill(req: Request) -> Any:
            params = (await req.json()).get("kv_transfer_params") or {}
            self.p_params.append(params)
            self.events.append("prefill")
            if self.p_hold is not None:
                await asyncio.to_thread(self.p_hold.wait, 30)
            if self.p_status != 200:
                return _error(self.p_status, "prefill failed")
            if "push_grant" in params:
                self.pushed.set()
                answer = {"transfer_mode": "push", "do_remote_prefill": False}
                if self.first_token is not None:
                    answer["first_token"] = self.first_token
                return {"choices": [{"text": "x"}], "kv_transfer_params": answer}
            return {"choices": [{"text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_host": None, "remote_port": 0}}

        return app

    def _d_app(self, mode: str) -> FastAPI:
        app = FastAPI()
        self._common(app, "kv_consumer", mode)

        @app.post("/v1/completions")
        async def decode(req: Request) -> Any:
            body = await req.json()
            params = body.get("kv_transfer_params") or {}
            self.d_params.append(params)
            self.events.append("decode")
            if self.d_refuse is not None:
                return _error(*self.d_refuse)
            rid = req.headers["X-Request-Id"]
            if params.get("transfer_mode") == "push" and not self.no_window:
                self.windows[rid] = {**GRANT, "request_id": rid}
            if self.d_whole_hit:
                self.windows[rid] = {**GRANT, "request_id": rid, "block_ids": [[]]}
                return {"choices": [{"text": "pushed"}]}
            if params.get("transfer_mode") == "push":
                deadline = time.monotonic() + 30
                while not self.pushed.is_set():
                    if await req.is_disconnected() or time.monotonic() > deadline:
                        self.d_gone.set()
                        return _error(499, "client gone")
                    await asyncio.sleep(0.01)
            if body.get("stream"):
                async def chunks() -> Any:
                    yield b'data: {"choices": [{"index": 0, "text": "pushed"}]}\n\n'
                    yield b"data: [DONE]\n\n"
                return StreamingResponse(chunks(), media_type="text/event-stream")
            return {"choices": [{"text": "pushed"}]}

        @app.post("/v1/kv/push_first_token/{rid}")
        async def first_token(rid: str, req: Request) -> Any:
            self.events.append("first_token")
            self.tokens_given.append((rid, (await req.json())["first_token"]))
            return {}

        @app.get("/v1/kv/push_grant/{rid}")
        async def window(rid: str, timeout: float) -> Any:
            self.events.append("window")
            if self.window_hold is not None:
                await asyncio.to_thread(self.window_hold.wait, 30)
            deadline = time.monotonic() + min(timeout, 0.5)
            while rid not in self.windows:
                if time.monotonic() > deadline:
                    return _error(504, f"no write window opened for request {rid!r}")
                await asyncio.sleep(0.01)
            return {"push_grant": self.windows[rid]}

        return app

    def stop(self) -> None:
        self.p.stop()
        self.d.stop()


@pytest.fixture
def pair():
    pair = PushPair()
    proxy = ServerThread(build_proxy_app([pair.p.url], [pair.d.url]))
    pair.proxy_url = proxy.url
    yield pair
    proxy.stop()
    pair.stop()


def _post(pair: PushPair, **body: Any) -> httpx.Response:
    return httpx.post(pair.proxy_url + "/v1/completions", timeout=60,
                      json={"model": "smollm2", "prompt": "x", "max_tokens": 4, **body})


def test_d_first_then_p_with_ds_window_then_ds_answer(pair):
    r = _post(pair, stream=False)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "pushed"
    assert r.json()["pdkv_timings"]["mode"] == "pd_push"
    assert pair.d_params == [{"do_remote_prefill": True, "transfer_mode": "push"}]
    (p_params,) = pair.p_params
    grant = p_params["push_grant"]
    assert p_params["do_remote_decode"] is True
    assert grant == pair.windows[grant["request_id"]]  # D's window, as D issued it
    assert pair.events.index("decode") < pair.events.index("prefill")
    with httpx.stream("POST", pair.proxy_url + "/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": "x", "max_tokens": 4, "stream": True}) as s:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                       if line.startswith("data: {") and "choices" in line)
    assert text == "pushed" and len(pair.p_params) == 2


def test_ps_first_token_is_handed_to_d_before_ds_answer_is_relayed(pair):
    pair.first_token = 4242
    r = _post(pair)
    assert r.status_code == 200
    (grant,) = [p["push_grant"] for p in pair.p_params]
    assert pair.tokens_given == [(grant["request_id"], 4242)]
    assert pair.events.index("prefill") < pair.events.index("first_token")


def test_a_decode_answer_before_its_window_is_a_skipped_prefill(pair):
    """D held the whole prompt and answered before the proxy read its window (held here until
    the end): no prefill leg went to P, so the answer says pd_skip_prefill and the skip is
    counted, as when the window comes first with no blocks."""
    pair.d_whole_hit = True
    pair.window_hold = threading.Event()
    try:
        r = _post(pair)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "pushed"
        assert r.json()["pdkv_timings"]["mode"] == "pd_skip_prefill"
        assert pair.p_params == []
        metrics = httpx.get(pair.proxy_url + "/metrics").text
        assert "pdkv:proxy_prefill_legs_skipped_total 1.0" in metrics
    finally:
        pair.window_hold.set()


def test_ds_refusal_reaches_the_client_and_p_never_sees_the_request(pair):
    pair.d_refuse = (400, "prompt too long for D")
    r = _post(pair)
    assert r.status_code == 400 and "too long" in r.json()["error"]["message"]
    assert pair.p_params == []


@pytest.mark.parametrize("stream", [False, True])
def test_no_window_is_a_503_and_ds_leg_is_abandoned(pair, stream):
    pair.no_window = True
    r = _post(pair, stream=stream)
    assert r.status_code == 503 and "no write window" in r.json()["error"]["message"]
    assert pair.p_params == []
    assert pair.d_gone.wait(20), "D's decode leg stayed open"


def test_ps_failure_reaches_the_client_and_abandons_ds_leg(pair):
    pair.p_status = 500
    r = _post(pair)
    assert r.status_code == 500 and "prefill failed" in r.json()["error"]["message"]
    assert pair.d_gone.wait(20), "D's decode leg stayed open"


def test_a_client_that_leaves_during_ps_leg_abandons_ds_leg(pair):
    pair.p_hold = threading.Event()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(pair.proxy_url + "/v1/completions", timeout=2.0,
                   json={"model": "smollm2", "prompt": "x", "max_tokens": 4})
    assert pair.d_gone.wait(20), "D's decode leg stayed open after its client left"
    pair.p_hold.set()  # P's leg ends in the background


def test_n_above_one_takes_the_pull_flow(pair):
    r = _post(pair, n=2)
    assert r.status_code == 200
    assert "push_grant" not in pair.p_params[0]
    assert pair.d_params[0].get("transfer_mode") != "push"
    assert r.json()["pdkv_timings"]["mode"] == "pd"


@pytest.mark.parametrize("d", [dict(d_mode="pull"), dict(d_block_size=32),
                               dict(d_block_size=32, push_block_sizes=("any", "equal")),
                               dict(d_block_size=32, push_block_sizes=("equal", "any"))])
def test_a_pull_decode_engine_or_another_block_size_takes_the_pull_flow(d, caplog):
    """Another block size is pulled unless both engines push across block sizes (an engine
    that does not say so, e.g. one from before, cannot)."""
    pair = PushPair(**d)
    proxy = ServerThread(build_proxy_app([pair.p.url], [pair.d.url]))
    try:
        with caplog.at_level(logging.WARNING, logger="pdkv.router.proxy_push"):
            for _ in range(2):
                r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                               json={"model": "smollm2", "prompt": "x", "max_tokens": 4})
                assert r.status_code == 200 and "push_grant" not in pair.p_params[-1]
        assert pair.events == ["prefill", "decode"] * 2
        said = [r.getMessage() for r in caplog.records if "one block size" in r.getMessage()]
        if "d_block_size" in d:  # the pair is named once, with both block sizes
            assert len(said) == 1 and "(block size 16," in said[0] and "(32," in said[0]
        else:
            assert said == []
    finally:
        proxy.stop()
        pair.stop()


def test_another_block_size_takes_the_push_flow_when_both_engines_push_across_sizes(caplog):
    pair = PushPair(d_block_size=32, push_block_sizes=("any", "any"))
    proxy = ServerThread(build_proxy_app([pair.p.url], [pair.d.url]))
    try:
        with caplog.at_level(logging.WARNING, logger="pdkv.router.proxy_push"):
            r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                           json={"model": "smollm2", "prompt": "x", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["pdkv_timings"]["mode"] == "pd_push"
        (p_params,) = pair.p_params
        assert p_params["push_grant"] == pair.windows[p_params["push_grant"]["request_id"]]
        assert pair.events.index("decode") < pair.events.index("prefill")
        assert not [m for m in caplog.messages if "one block size" in m]
    finally:
        proxy.stop()
        pair.stop()
