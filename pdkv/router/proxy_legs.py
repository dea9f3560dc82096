"""The proxy's requests to one engine: the decode leg of a P/D request (or a whole colocated
request), with its error pass-through and stream relay, and the prompt-length check against the
engine's max_model_len. Owned by `pdkv.router.proxy.build_proxy_app` (one per app)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from pdkv.jsontypes import JSONObject, JSONValue
from pdkv.router.backend_info import BackendInfos
from pdkv.router.policies import Backend
from pdkv.router.proxy_metrics import ProxyMetrics
from pdkv.router.proxy_protocol import error_kind, error_response, is_layout_error
from pdkv.router.timings import RequestClock, StreamStitcher, stitch_response
from pdkv.router.validate import LengthCheck


@dataclass
class LegSender:
    """Args:
        client: the app's shared httpx client (a getter: it exists once the app started).
        infos: what the proxy knows of each engine (layout, max_model_len).
        metrics: the proxy's counters.
        release_soon: tells P to release a grant's blocks in the background (a decode leg that
            failed before D took the request).
    """

    client: Callable[[], httpx.AsyncClient]
    infos: BackendInfos
    metrics: ProxyMetrics
    release_soon: Callable[[JSONValue], None]

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
                         leg: str = "decode") -> Response:
        """The decode leg (P/D) or the whole request (colocated, `leg` "whole", params None)."""
        client = self.client()
        what = "decode backend" if leg == "decode" else "backend"
        d.inflight += 1
        self.metrics.requests.labels(d.url, leg).inc()
        started = clock.d_sent = time.monotonic()
        if not stream:
            try:
                r = await client.post(d.url + path, json=decode, headers=headers)
            except httpx.HTTPError as e:
                self.infos.forget(d.url)
                self.release_soon(params)
                self.metrics.errors.labels(leg, "unreachable").inc()
                return error_response(f"{what} {d.url} unreachable: {e}", 502, "BadGateway")
            finally:
                d.inflight -= 1
                self.metrics.latency.labels(leg).observe(time.monotonic() - started)
            if r.status_code != 200:
                self.release_soon(params)
                self.metrics.errors.labels(leg, error_kind(r.status_code, r.content)).inc()
                return self.backend_error(d, r.status_code, r.content)
            return Response(stitch_response(clock, r.content), status_code=r.status_code,
                            media_type="application/json")
        try:
            req = client.build_request("POST", d.url + path, json=decode, headers=headers)
            resp = await client.send(req, stream=True)
        except BaseException as e:
            d.inflight -= 1
            self.metrics.latency.labels(leg).observe(time.monotonic() - started)
            if not isinstance(e, httpx.HTTPError):
                raise
            self.infos.forget(d.url)
            self.release_soon(params)
            self.metrics.errors.labels(leg, "unreachable").inc()
            return error_response(f"{what} {d.url} unreachable: {e}", 502, "BadGateway")
        if resp.status_code != 200:
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
                d.inflight -= 1
                self.metrics.latency.labels(leg).observe(time.monotonic() - started)
            self.release_soon(params)
            self.metrics.errors.labels(leg, error_kind(resp.status_code, content)).inc()
            return self.backend_error(d, resp.status_code, content)
        return StreamingResponse(
            self.relay(resp, d, leg, started, StreamStitcher(clock)),
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

    async def relay(self, resp: httpx.Response, d: Backend, leg: str, started: float,
                     stitcher: StreamStitcher) -> AsyncIterator[bytes]:
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
            d.inflight -= 1
            self.metrics.latency.labels(leg).observe(time.monotonic() - started)
            await resp.aclose()
