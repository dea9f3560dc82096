"""`pdkv proxy`: the vLLM P/D proxy protocol in front of prefill and decode engines.

Prefill leg: a copy of the body with max_tokens=1 (and max_completion_tokens=1), stream off,
stream_options/min_tokens removed and kv_transfer_params.do_remote_decode=true, sent to a prefill
engine; its response's kv_transfer_params are copied into the original body, which goes to a
decode engine (streamed when the client streams). Both legs carry the same X-Request-Id.

Before the prefill leg the proxy answers, without contacting P: 400 for a body that is not strict
JSON or that D would reject after the prefill (pdkv.router.validate; a prompt counts as too long
by D's POST /tokenize, asked only when the prompt's UTF-8 size, rendered with the chat template
for a chat when the proxy has the model's (--tokenizer), cannot rule it out), 503 when no healthy
prefill or decode engine is left (pdkv.router.backend_health: periodic GET /health probes, and
legs that found an engine down; with none healthy, the pool is probed again first), and 503
when the chosen P and D have incompatible KV layouts (pdkv.router.backend_info; `/health`
reports the same, with each engine's state). A 4xx/5xx from either leg reaches the client with
its body (a layout mismatch D reports becomes a 503); an unreachable backend is a 502 (logged at
WARNING with the backend, the leg and the error); a failure after streaming started ends the
stream with an error event; a client that disconnects aborts the decode leg. One that
disconnects during the prefill leg does not abort it: P would keep the blocks of a prefill it
finished under a grant only its answer names, until the lease expires; the proxy waits for that
answer in the background (within the leg timeout) and tells P to release the grant at once. So
does a client that leaves between the legs, and a decode leg D never received or refused.
(Protocol: vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py.) The two legs are
`pdkv.router.proxy_pd`; the choice of engine within each pool is `pdkv.router.proxy_routing`.

Colocated mode (`--backends URL,...`, like vLLM's and SGLang's routers' worker URLs): each request
goes whole, unchanged, to one kv_both (or connector-less) instance chosen by the routing policy,
with the same validation, streaming, error pass-through and disconnect handling as the decode leg
above (the same code). prefix_aware computes the request's chunk hashes
(`pdkv.router.prefix_keys`) with each instance's block and pool chunk size (GET /kv_layout).

GET /metrics: the proxy's own counters (`pdkv.router.proxy_metrics`). GET /backends: the engine URLs
it routes to by role (`pdkv bench serve` scrapes their /metrics too). POST /reset_prefix_cache goes
to every backend, and the answer reports each one (`pdkv.router.proxy_admin` lists which admin
routes are deployment-wide).

Every response (or the final chunk of a stream) carries the stitched `pdkv_timings`
(`pdkv.router.timings`): the proxy's own time, each engine's phases and the HTTP residuals.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from pdkv.jsontypes import JSONObject, JSONValue
from pdkv.keepalive import client_limits
from pdkv.router.backend_health import BackendHealth, HealthCheckConfig
from pdkv.router.backend_info import BackendInfos, unknown_model
from pdkv.router.kv_aware import KVAwareConfig
from pdkv.router.kv_index import KVIndexConfig
from pdkv.router.policies import Backend, PrefixAwareConfig
from pdkv.router.pool_record import DEFAULT_MAX_ENTRIES as POOL_RECORD_ENTRIES
from pdkv.router.pool_record import PoolRecord
from pdkv.router.proxy_admin import fan_out
from pdkv.router.proxy_legs import LegSender, describe
from pdkv.router.proxy_metrics import ProxyMetrics
from pdkv.router.proxy_openapi import install_openapi, request_body
from pdkv.router.proxy_pd import BeforeDecodeHook, PDPath
from pdkv.router.proxy_protocol import error_response, releasable, release_prefill
from pdkv.router.proxy_routing import RequestRouter
from pdkv.router.timings import RequestClock
from pdkv.router.validate import BadRequest, LengthCheck, check_body, parse_body
from pdkv.serve.disconnect import ClientDisconnected, until_done_or_disconnect

logger = logging.getLogger(__name__)


SHUTDOWN_WAIT_S = 10.0
"""Seconds the proxy's shutdown waits for background releases and orphaned prefill legs."""


def build_proxy_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    routing: str = "round_robin",
    timeout: float = 600.0,
    info_ttl: float = 5.0,
    before_decode: BeforeDecodeHook | None = None,
    backend_urls: list[str] | None = None,
    tokenizer: str | None = None,
    prefix_aware: PrefixAwareConfig | None = None,
    kv_aware: KVAwareConfig | None = None,
    kv_index: KVIndexConfig | None = None,
    skip_prefill_on_pool_hit: bool = False,
    pool_record_entries: int = POOL_RECORD_ENTRIES,
    health_check: HealthCheckConfig | None = None,
) -> FastAPI:
    """The proxy app; one httpx.AsyncClient shared by all requests and one routing policy
    instance per pool (prefill, decode; or the colocated instances).

    Args:
        prefill_urls, decode_urls: engine base URLs (P/D mode; empty in colocated mode).
        routing: policy name within each pool (`pdkv.router.policies.POLICIES`).
        timeout: per-leg timeout (s).
        info_ttl: seconds after which a backend's layout / max_model_len are refetched in the
            background when a request uses them (every /health probe refetches them too).
        before_decode: test seam, awaited with P's kv_transfer_params between the legs.
        backend_urls: colocated mode: the instances each request goes to whole.
        tokenizer: the engines' model folder or alias: prefix_aware hashes with its tokenizer
            and chat template, the length check bounds a chat prompt by its rendered size (None:
            only prompts given as token ids get chunk hashes; D counts every chat prompt).
        prefix_aware: prefix_aware's bounds.
        kv_aware, kv_index: kv_aware's cost weight, and its KV event index's medium weights and
            bound (`pdkv.router.proxy_routing`: the proxy follows each engine's KV events).
        skip_prefill_on_pool_hit: P/D with a shared KV pool: send a request straight to D when
            the proxy's record (`pdkv.router.pool_record`) says the pool holds every loadable
            chunk of its prompt (needs chunk hashes: a tokenizer, or token-id prompts).
        pool_record_entries: chunk hashes that record remembers.
        health_check: the probes of every engine's GET /health (defaults: HealthCheckConfig).
    Raises:
        ValueError: an empty pool, both modes at once, an unknown routing policy, or
            skip_prefill_on_pool_hit in colocated mode.
    """
    colocated = [Backend(u.rstrip("/")) for u in backend_urls or []]
    if colocated and (prefill_urls or decode_urls):
        raise ValueError(
            "give either --backends (colocated) or --prefill and --decode (P/D), not both"
        )
    if not colocated and (not prefill_urls or not decode_urls):
        raise ValueError("the proxy needs at least one prefill and one decode URL, or --backends")
    prefills = [Backend(u.rstrip("/")) for u in prefill_urls]
    decodes = [Backend(u.rstrip("/")) for u in decode_urls]
    if skip_prefill_on_pool_hit and colocated:
        raise ValueError(
            "--skip-prefill-on-pool-hit is for P/D (--prefill/--decode) with a shared pool"
        )
    pool_record = PoolRecord(pool_record_entries) if skip_prefill_on_pool_hit else None
    infos = BackendInfos(info_ttl)
    metrics = ProxyMetrics()
    state: dict[str, httpx.AsyncClient] = {}
    router = RequestRouter(routing, infos, metrics, lambda: state["client"], tokenizer,
                           prefix_aware, kv_aware, kv_index)
    roles = ([("backend", b) for b in colocated] if colocated else
             [("prefill", b) for b in prefills] + [("decode", b) for b in decodes])
    health_state = BackendHealth(roles, health_check or HealthCheckConfig(),
                                 metrics.backend_healthy)
    releases: set[asyncio.Future[Any]] = set()

    probing: dict[str, asyncio.Future[bool]] = {}

    async def probe_now(url: str) -> bool:
        ok = await health_state.probe(state["client"], url)
        if ok:
            await infos.refresh(state["client"], url)
            await router.follow(url)
        else:
            infos.forget(url)
            router.unfollow(url)
        return ok

    async def probe(url: str) -> bool:
        """Probe one engine (joining a probe of it already under way); refresh what is known of
        it when healthy, else forget it."""
        task = probing.get(url)
        if task is None:
            task = probing[url] = asyncio.ensure_future(probe_now(url))
            task.add_done_callback(lambda t: probing.pop(url) if probing.get(url) is t else None)
        return await asyncio.shield(task)

    async def live(pool: list[Backend]) -> list[Backend]:
        """The healthy backends of `pool`; when none is, each is probed first (an engine that
        just came back, e.g. restarted, is routed to at once rather than at the next periodic
        probe)."""
        healthy = health_state.healthy(pool)
        if healthy:
            return healthy
        await asyncio.gather(*(probe(b.url) for b in pool))
        return health_state.healthy(pool)

    async def probe_all() -> None:
        await asyncio.gather(*(probe(u) for u in dict.fromkeys(b.url for _, b in roles)))

    async def probe_forever() -> None:
        while True:
            await probe_all()
            await asyncio.sleep(health_state.config.interval_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # An idle leg connection is dropped before the engine closes it (pdkv.keepalive).
        limits = client_limits(max_connections=1000, max_keepalive_connections=200)
        state["client"] = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=5.0), limits=limits
        )
        prober = asyncio.ensure_future(probe_forever())
        if router.keyer.model is not None:  # not on the first request's path (hundreds of ms)
            background(asyncio.ensure_future(asyncio.to_thread(router.keyer.load)))
        yield
        prober.cancel()
        if releases:
            await asyncio.wait(releases, timeout=SHUTDOWN_WAIT_S)
        for task in list(releases):
            task.cancel()
        await router.aclose()
        await infos.aclose()
        await state["client"].aclose()

    app = FastAPI(title="pdkv proxy", lifespan=lifespan)
    install_openapi(app)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("proxy error")
        return error_response(f"proxy error: {type(e).__name__}: {e}", 500, "InternalServerError")

    def background(task: asyncio.Future[Any]) -> None:
        """Keep `task` until it ends (shutdown waits for it)."""
        releases.add(task)
        task.add_done_callback(releases.discard)

    def release_soon(params: JSONValue) -> None:
        """Release P's blocks in the background (survives the request's cancellation)."""
        if not releasable(params):
            return
        background(asyncio.ensure_future(asyncio.to_thread(release_prefill, params)))

    sender = LegSender(lambda: state["client"], infos, metrics, release_soon, health_state)

    def no_healthy(leg: str, pool: list[Backend]) -> Response:
        """503 before any leg: no engine of `pool` is healthy (each one's reason named)."""
        metrics.errors.labels(leg, "unavailable").inc()
        what = {"prefill": "prefill backend", "decode": "decode backend"}.get(leg, "backend")
        return error_response(f"no healthy {what}: {health_state.why_down(pool)}", 503,
                              "ServiceUnavailableError")

    pd = PDPath(prefills, decodes, lambda: state["client"], infos, health_state, metrics,
                sender, router, live, no_healthy, background, release_soon, pool_record,
                before_decode)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The proxy's own metrics (Prometheus text)."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/backends")
    async def backends() -> dict[str, list[str]]:
        """The engine URLs this proxy routes to, by role (P/D: prefill, decode; colocated:
        backends)."""
        return {"prefill": [b.url for b in prefills], "decode": [b.url for b in decodes],
                "backends": [b.url for b in colocated]}

    @app.get("/ping")
    async def ping() -> Response:
        """Liveness of the proxy itself (/health also checks every backend)."""
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        """Probes every backend now. 200 when every backend is healthy and every (P, D) pair's KV
        layouts agree; else 503 naming the backend or both layout values. The body lists each
        backend's state under "backends" (`pdkv.router.backend_health.BackendState`)."""
        await probe_all()
        report = health_state.report()
        down = [b for b in report if not b["healthy"]]
        why = (f"backend {down[0]['url']} is not healthy ({down[0]['error']})" if down
               else pd.first_mismatch())
        if why:
            error = {"message": why, "type": "ServiceUnavailableError", "param": None,
                     "code": 503}
            return JSONResponse({"error": error, "backends": report}, status_code=503)
        return JSONResponse({"backends": report}, status_code=200)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw: Request) -> Response:
        """Every backend forgets its prefix cache (pdkv.router.proxy_admin: each one's answer; a
        409 from one that has blocks in use)."""
        headers = (
            {"Authorization": raw.headers["authorization"]}
            if "authorization" in raw.headers
            else {}
        )
        roles = ([("backend", b.url) for b in colocated] if colocated else
                 [("prefill", b.url) for b in prefills] + [("decode", b.url) for b in decodes])
        return await fan_out(state["client"], roles, "/reset_prefix_cache", headers)

    @app.get("/v1/models")
    async def models() -> Response:
        url = (decodes or colocated)[0].url
        try:
            r = await state["client"].get(url + "/v1/models", timeout=10.0)
        except httpx.HTTPError as e:
            logger.warning("502: GET /v1/models from %s failed: %s", url, describe(e))
            return error_response(f"backend {url} unreachable: {describe(e)}", 502, "BadGateway")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/tokenize", openapi_extra=request_body("/tokenize"))
    @app.post("/detokenize", openapi_extra=request_body("/detokenize"))
    async def tokens(raw: Request) -> Response:
        """Passed to the first decode engine (or instance): every engine serves one model."""
        headers = (
            {"Authorization": raw.headers["authorization"]}
            if "authorization" in raw.headers
            else {}
        )
        url = (decodes or colocated)[0].url
        try:
            r = await state["client"].post(
                url + raw.url.path,
                content=await raw.body(),
                headers={"Content-Type": "application/json", **headers},
                timeout=30.0,
            )
        except httpx.HTTPError as e:
            logger.warning("502: POST %s to %s failed: %s", raw.url.path, url, describe(e))
            return error_response(f"backend {url} unreachable: {describe(e)}", 502, "BadGateway")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/completions", openapi_extra=request_body("/v1/completions"))
    async def completions(raw: Request) -> Response:
        return await _route(raw, "/v1/completions")

    @app.post("/v1/chat/completions", openapi_extra=request_body("/v1/chat/completions"))
    async def chat(raw: Request) -> Response:
        return await _route(raw, "/v1/chat/completions")

    async def _route(raw: Request, path: str) -> Response:
        clock = RequestClock(mode="colocated" if colocated else "pd")
        try:
            body = parse_body(await raw.body())
            length = check_body(body, chat=path.endswith("chat/completions"))
        except BadRequest as e:
            metrics.errors.labels("proxy", "client").inc()
            return error_response(str(e), 400, "BadRequestError")
        except ClientDisconnect:  # gone while its body was still coming in
            metrics.client_disconnects.labels("before").inc()
            return error_response("client disconnected", 499, "ClientClosedRequest")
        clock.mark("body")
        # An unknown model is the client's error: 404 as vLLM answers it, before any leg. (Not
        # asking unhealthy engines: one that does not answer would delay every request.)
        reach = [b.url for b in health_state.healthy(colocated or [*prefills, *decodes])]
        await infos.ensure(state["client"], reach)
        missing = unknown_model(body.get("model"), [infos.get(u) for u in reach])
        if missing is not None:
            metrics.errors.labels("proxy", "client").inc()
            return error_response(missing, 404, "NotFoundError", param="model")
        clock.mark("models")
        rid = raw.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": rid}
        if "authorization" in raw.headers:
            headers["Authorization"] = raw.headers["authorization"]
        chat = path.endswith("chat/completions")
        work = (_whole(body, path, headers, length, chat, clock) if colocated
                else pd.serve(body, path, headers, length, chat, clock))
        try:
            return await until_done_or_disconnect(work, raw)
        except ClientDisconnected:  # during the prefill leg or a non-streamed decode leg
            metrics.client_disconnects.labels(_phase(clock)).inc()
            return error_response("client disconnected", 499, "ClientClosedRequest")

    def _phase(clock: RequestClock) -> str:
        """What the proxy was doing for a request whose client just left (its work cancelled
        but not yet unwound)."""
        if clock.d_sent is not None:
            return "decode"
        if clock.p_sent is not None:
            return "prefill" if clock.p_done is None else "between"
        return "before"

    async def _whole(body: JSONObject, path: str, headers: dict[str, str], length: LengthCheck,
                     chat: bool, clock: RequestClock) -> Response:
        """Colocated mode: the whole request to one instance."""
        instances = await live(colocated)
        if not instances:
            return no_healthy("whole", colocated)
        decision, length = await router.decide("whole", instances, body, chat, length)
        b = decision.backend
        clock.mark("route")
        await infos.ensure(state["client"], [b.url])
        length = await router.chat_bound(length, body, chat)
        refused = await sender.length_check(b, length, headers)
        if refused is not None:
            return refused
        clock.mark("length")
        return await sender.decode_leg(
            b, path, body, headers, None, bool(body.get("stream")), clock, leg="whole",
            claim=router.claim("whole", decision)
        )

    return app
