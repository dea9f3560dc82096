"""`pdkv proxy`: the vLLM P/D proxy protocol in front of prefill and decode engines.

Prefill leg: a copy of the body with max_tokens=1 (and max_completion_tokens=1), stream off,
stream_options/min_tokens removed and kv_transfer_params.do_remote_decode=true, sent to a prefill
engine; its response's kv_transfer_params are copied into the original body, which goes to a
decode engine (streamed when the client streams). Both legs carry the same X-Request-Id. A 4xx/5xx
from either leg reaches the client with its body; an unreachable backend is a 502; a failure after
streaming started ends the stream with an error event; a client that disconnects aborts both legs.
(Protocol: vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdkv.router.policies import Backend, RoutingPolicy, make_policy
from pdkv.serve.disconnect import ClientDisconnected, until_done_or_disconnect

logger = logging.getLogger(__name__)


def _error(message: str, status: int, err_type: str) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body (see module docstring)."""
    p = copy.deepcopy(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p.pop("min_tokens", None)
    p.pop("min_completion_tokens", None)
    p["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return p


def build_proxy_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    routing: str = "round_robin",
    timeout: float = 600.0,
) -> FastAPI:
    """The proxy app; one httpx.AsyncClient shared by all requests and one routing policy
    instance per pool (prefill, decode).

    Raises:
        ValueError: an empty pool or an unknown routing policy.
    """
    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one prefill and one decode URL")
    prefills = [Backend(u.rstrip("/")) for u in prefill_urls]
    decodes = [Backend(u.rstrip("/")) for u in decode_urls]
    prefill_policy: RoutingPolicy = make_policy(routing)
    decode_policy: RoutingPolicy = make_policy(routing)
    state: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), limits=limits)
        yield
        await state["client"].aclose()

    app = FastAPI(title="pdkv proxy", lifespan=lifespan)

    @app.get("/ping")
    async def ping() -> Response:
        """Liveness of the proxy itself (/health also checks every backend)."""
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        client = state["client"]
        for b in prefills + decodes:
            try:
                r = await client.get(b.url + "/health", timeout=5.0)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                return _error(f"backend {b.url} is not healthy", 503, "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            r = await state["client"].get(decodes[0].url + "/v1/models", timeout=10.0)
        except httpx.HTTPError as e:
            return _error(f"decode backend unreachable: {e}", 502, "BadGateway")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await _route(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await _route(raw, "/v1/chat/completions")

    async def _route(raw: Request, path: str) -> Response:
        try:
            body = await raw.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error("request body is not valid JSON", 400, "BadRequestError")
        if not isinstance(body, dict):
            return _error("request body must be a JSON object", 400, "BadRequestError")
        rid = raw.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": rid}
        if "authorization" in raw.headers:
            headers["Authorization"] = raw.headers["authorization"]
        try:
            return await until_done_or_disconnect(_legs(body, path, headers), raw)
        except ClientDisconnected:  # during the prefill leg or a non-streamed decode leg
            return _error("client disconnected", 499, "ClientClosedRequest")

    async def _legs(body: dict[str, Any], path: str, headers: dict[str, str]) -> Response:
        client = state["client"]
        p = prefill_policy.choose(prefills)
        p.inflight += 1
        try:
            r = await client.post(p.url + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            return _error(f"prefill backend {p.url} unreachable: {e}", 502, "BadGateway")
        finally:
            p.inflight -= 1
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        decode = dict(body)
        params = r.json().get("kv_transfer_params")
        decode["kv_transfer_params"] = params
        d = decode_policy.choose(decodes)
        d.inflight += 1
        if not body.get("stream"):
            try:
                r = await client.post(d.url + path, json=decode, headers=headers)
            except httpx.HTTPError as e:
                await _release(params)
                return _error(f"decode backend {d.url} unreachable: {e}", 502, "BadGateway")
            finally:
                d.inflight -= 1
            if r.status_code != 200:
                await _release(params)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        try:
            req = client.build_request("POST", d.url + path, json=decode, headers=headers)
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            d.inflight -= 1
            await _release(params)
            return _error(f"decode backend {d.url} unreachable: {e}", 502, "BadGateway")
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            d.inflight -= 1
            await _release(params)
            return Response(content, status_code=resp.status_code, media_type="application/json")
        return StreamingResponse(_relay(resp, d), media_type="text/event-stream",
                                 headers={"X-Request-Id": headers["X-Request-Id"]})

    async def _relay(resp: httpx.Response, d: Backend) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            err = {"error": {"message": f"decode stream failed: {e}", "type": "BadGateway", "param": None, "code": 502}}
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            d.inflight -= 1
            await resp.aclose()

    return app


async def _release(params: dict[str, Any] | None) -> None:
    """The decode leg failed before D could pull: tell P to free the held blocks now instead of
    at lease expiry (best effort; the lease still bounds the hold)."""
    if not params or not params.get("remote_host"):
        return
    from pdkv.kv_transfer.connector.p2p_messages import send_release

    await asyncio.to_thread(send_release, str(params["remote_host"]), int(params["remote_port"]),
                            str(params["remote_request_id"]), 5.0, str(params.get("remote_nonce", "")))


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prefill", required=True, help="prefill engine URL(s), comma-separated")
    parser.add_argument("--decode", required=True, help="decode engine URL(s), comma-separated")
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=8000, help="bind port")
    parser.add_argument("--routing", default="round_robin", choices=["round_robin", "least_loaded"],
                        help="policy within each pool")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-leg timeout (s)")
    parser.add_argument("--log-level", default="info", help="uvicorn log level (info logs each request)")
    return parser


def main(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_proxy_app(
        [u for u in args.prefill.split(",") if u], [u for u in args.decode.split(",") if u],
        args.routing, args.timeout,
    )
    print(f"pdkv proxy on http://{args.host}:{args.port}: prefill {args.prefill} decode {args.decode} "
          f"({args.routing})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
