"""The proxy's requests to one engine: the decode leg of a P/D request (or a whole colocated
request), with its error pass-through and stream relay, and the prompt-length check against the
engine's max_model_len. Owned by `pdkv.router.proxy.build_proxy_app` (one per app).

Every answer the proxy turns into a 502 (and every stream that breaks) is logged at WARNING with
the backend, the leg and the exception. A leg that fails on a pooled keep-alive connection the
engine closed as the request went out (no answer at all) is sent once more (`open_leg`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from pdkv.jsontypes import JSONObject, JSONValue
from pdkv.router.backend_health import BackendHealth
from pdkv.router.backend_info import BackendInfos
from pdkv.router.policies import Backend, Claim
from pdkv.router.proxy_metrics import ProxyMetrics
from pdkv.router.proxy_protocol import error_kind, error_response, is_layout_error
from pdkv.router.timings import RequestClock, StreamStitcher, stitch_response
from pdkv.router.validate import LengthCheck

logger = logging.getLogger(__name__)

CLOSED_UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""What httpx raises when the engine closed (or reset) the connection before any answer: the
race of a pooled keep-alive connection that the engine's server closes for idleness just as the
proxy sends a request on it (the engine never read that request)."""

NOT_DELIVERED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""Failures that prove the engine never received the leg (no connection was made)."""


def describe(e: BaseException) -> str:
    """An exception as `Type: message` (httpx's messages alone can be empty)."""
    return f"{type(e).__name__}: {e}"


async def open_leg(client: httpx.AsyncClient, url: str, body: JSONObject,
                   headers: dict[str, str], leg: str) -> httpx.Response:
    """POST `body` to `url` and read the answer's status and headers (the caller reads or
    relays the body, then closes the response). A failure in CLOSED_UNANSWERED is retried once,
    on another connection (the pool discards the failed one): on a reused connection it is the
    keep-alive race (the request was never read); an engine that did read the request and then
    closed without an answer has aborted it, as for a client that left, so nothing runs twice.

    Raises:
        httpx.HTTPError: the leg failed (on the retry, for CLOSED_UNANSWERED).
    """
    try:
        return await client.send(
            client.build_request("POST", url, json=body, headers=headers), stream=True
        )
    except CLOSED_UNANSWERED as e:
        logger.info("%s leg to %s: connection closed before any answer (%s); sending it again",
                    leg, url, describe(e))
    return await client.send(
        client.build_request("POST", url, json=body, headers=headers), stream=True
    )


@dataclass
class LegSender:
    """Args:
        client: the app's shared httpx client (a getter: it exists once the app started).
        infos: what the proxy knows of each engine (layout, max_model_len).
        metrics: the proxy's counters.
        release_soon: tells P to release a grant's blocks in the background (a decode leg that
            D never received, or that D refused).
        health: each engine's health (a refused connection or a timeout marks it down).
    """

    client: Callable[[], httpx.AsyncClient]
    infos: BackendInfos
    metrics: ProxyMetrics
    release_soon: Callable[[JSONValue], None]
    health: BackendHealth

    def unreachable(self, b: Backend, leg: str, rid: str, e: httpx.HTTPError) -> Response:
        """The 502 of request `rid`'s leg that got no answer from `b` (logged, counted, `b`
        marked down when the error says so)."""
        what = {"decode": "decode backend", "prefill": "prefill backend"}.get(leg, "backend")
        logger.warning("502: request %s: %s leg to %s failed: %s", rid, leg, b.url, describe(e))
        self.infos.forget(b.url)
        self.health.leg_failed(b.url, e)
        self.metrics.errors.labels(leg, "unreachable").inc()
        return error_response(f"{what} {b.url} unreachable: {describe(e)}", 502, "BadGateway")

    async def length_check(
        self, d: Backend, length: LengthCheck, headers: dict[str, str]
    ) -> Response | None:
        """400 when prompt + max_tokens does not fit `d`'s max_model_len (D's own message)."""
        client = self.client()
        d_info = self.infos.get(d.url)
        max_len = d_info.max_model_len if d_info else None
        if length.max_tokens is None or max_len is None:
            return None
        count = length.prompt_ids
        if (
            count is None
            and length.upper_bound is not None
            and length.fits(length.upper_bound, max_len) is None
        ):
            return None
        if count is None and length.tokenize_body is not None:
            # D's own count; when D cannot tell, D still enforces the limit on the decode leg.
            try:
                r = await client.post(
                    d.url + "/tokenize", json=length.tokenize_body, headers=headers, timeout=30.0
                )
                if 400 <= r.status_code < 500 and r.status_code != 404:  # P would reject it too
                    return Response(
                        r.content, status_code=r.status_code, media_type="application/json"
                    )
                count = int(r.json()["count"]) if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                count = None
        why = length.fits(count, max_len) if count is not None else None
        return error_response(why, 400, "BadRequestError") if why else None

    async def decode_leg(self, d: Backend, path: str, decode: JSONObject, headers: dict[str, str],
                         params: JSONValue, stream: bool, clock: RequestClock,
                         leg: str = "decode", claim: Claim | None = None) -> Response:
        """The decode leg (P/D) or the whole request (colocated, `leg` "whole", params None).
        P's grant (`params`) is released here when D never received the leg or refused it;
        once D took it, D releases or reads it. `claim` (default: one in-flight leg on `d`)
        holds from the send until the leg ends (its stream included) and is then given D's
        `pdkv_timings`."""
        claim = claim if claim is not None else Claim(d)
        claim.start()
        self.metrics.requests.labels(d.url, leg).inc()
        started = clock.d_sent = time.monotonic()
        try:
            resp = await open_leg(self.client(), d.url + path, decode, headers, leg)
        except BaseException as e:
            return self.not_answered(d, e, params, headers, clock, leg, claim, started)
        return await self.answer(d, resp, params, headers, stream, clock, leg, claim, started)

    def not_answered(self, d: Backend, e: BaseException, params: JSONValue,
                     headers: dict[str, str], clock: RequestClock, leg: str, claim: Claim,
                     started: float) -> Response:
        """A leg to `d` that got no answer (`e`, from `open_leg`): the claim ends; P's grant
        (`params`) is released when D never received the leg; the 502 (`unreachable`).

        Raises:
            BaseException: `e` itself when it is no httpx.HTTPError (cancellation, a bug).
        """
        claim.end()
        self.metrics.latency.labels(leg).observe(time.monotonic() - started)
        if not isinstance(e, httpx.HTTPError):
            raise e
        if isinstance(e, NOT_DELIVERED):
            self.release_soon(params)
        return self.unreachable(d, leg, headers["X-Request-Id"], e)

    async def answer(self, d: Backend, resp: httpx.Response, params: JSONValue,
                     headers: dict[str, str], stream: bool, clock: RequestClock, leg: str,
                     claim: Claim, started: float) -> Response:
        """The client's answer from D's answer `resp` to a leg sent at `started` (its status and
        headers read): D's body stitched, D's error passed through (P's grant `params` released),
        or the relayed stream. `claim` ends with the answer (a stream's: when it ends)."""
        if resp.status_code != 200 or not stream:
            try:
                content = await resp.aread()
            except BaseException as e:  # no answer, or the client left (cancellation)
                claim.end()
                if not isinstance(e, httpx.HTTPError):
                    raise
                return self.unreachable(d, leg, headers["X-Request-Id"], e)
            finally:
                await resp.aclose()
                self.metrics.latency.labels(leg).observe(time.monotonic() - started)
            if resp.status_code == 200:
                try:
                    stitched = stitch_response(clock, content)
                finally:
                    claim.end(clock.d_timings)
                return Response(stitched, status_code=200, media_type="application/json")
            claim.end()
            if resp.status_code >= 500:
                logger.warning("request %s: %s leg to %s answered %d: %s", headers["X-Request-Id"],
                               leg, d.url, resp.status_code,
                               content[:300].decode("utf-8", "replace"))
            self.release_soon(params)
            self.metrics.errors.labels(leg, error_kind(resp.status_code, content)).inc()
            return self.backend_error(d, resp.status_code, content)
        return StreamingResponse(
            self.relay(resp, claim, leg, started, StreamStitcher(clock), headers["X-Request-Id"]),
            media_type="text/event-stream",
            headers={"X-Request-Id": headers["X-Request-Id"]},
        )

    def backend_error(self, d: Backend, status: int, content: bytes) -> Response:
        """D's error, passed through; a layout mismatch is the deployment's fault (503), not the
        client's, and what the proxy knew about the layouts is stale."""
        if status == 400 and is_layout_error(content):
            self.infos.forget(d.url)
            try:
                message = str(json.loads(content)["error"]["message"])
            except (ValueError, KeyError, TypeError):
                message = content.decode("utf-8", "replace")
            return error_response(message, 503, "ServiceUnavailableError")
        return Response(content, status_code=status, media_type="application/json")

    async def relay(self, resp: httpx.Response, claim: Claim, leg: str, started: float,
                    stitcher: StreamStitcher, rid: str) -> AsyncIterator[bytes]:
        d = claim.backend
        # An encoded (compressed) stream is relayed as it comes: its events cannot be read.
        plain = not resp.headers.get("content-encoding")
        try:
            async for chunk in resp.aiter_raw():
                out = stitcher.feed(chunk) if plain else chunk
                if out:
                    yield out
            rest = stitcher.flush()
            if rest:
                yield rest
        except httpx.HTTPError as e:
            logger.warning("request %s: %s stream from %s broke after it started: %s", rid, leg,
                           d.url, describe(e))
            self.health.leg_failed(d.url, e)
            self.metrics.errors.labels(leg, "stream").inc()
            what = "decode stream" if leg == "decode" else "stream"
            err = {
                "error": {
                    "message": f"{what} failed: {e}",
                    "type": "BadGateway",
                    "param": None,
                    "code": 502,
                }
            }
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            claim.end(stitcher.clock.d_timings)
            self.metrics.latency.labels(leg).observe(time.monotonic() - started)
            await resp.aclose()
