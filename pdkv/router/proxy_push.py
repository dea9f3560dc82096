"""The proxy's push flow (issue 29; `transfer_mode: push` on both P and D): D first.

1. The decode leg goes to D first, with kv_transfer_params {"do_remote_prefill": true,
   "transfer_mode": "push"}: D's scheduler admits the request, allocates its prompt's blocks and
   opens a write window (a `PushGrant`: block ids, nonce, prompt digest, D's data server, lease).
   D's answer (its stream, or its whole body) is what the client gets in the end.
2. Meanwhile the proxy asks D for that window, `GET /v1/kv/push_grant/{request_id}` (waits until
   D admitted the request; pdkv.serve.kv_push), and sends the prefill leg to P with it in
   kv_transfer_params {"do_remote_decode": true, "push_grant": ...}. P writes each layer's KV
   into D's blocks as its forward computes them; P holds nothing afterwards (nothing to release).
   A model with a linear-state group: P's answer carries its sampled token ("first_token"),
   which the proxy gives D (`POST /v1/kv/push_first_token/{request_id}`).
3. D resumes when every layer has landed and relays its tokens; the proxy relays D's answer.
   A window without blocks (D's KV pool or prefix cache holds the whole prompt: a MultiConnector
   on D loads it) needs no P: the proxy sends no prefill leg (`pd_skip_prefill`, counted in
   pdkv:proxy_prefill_legs_skipped), and a pool hit on part of the prompt shrinks the window to
   the blocks after it.

The push flow runs when GET /kv_layout of both engines reports transfer_mode "push" with one block
size (or both report `push_block_sizes` "any": P re-blocks into D's blocks) and the request asks
for one choice (n = 1); otherwise the pull flow of `pdkv.router.proxy_pd` runs (a push-mode engine
still takes pull requests; the pull converts block sizes).

Failures: D refusing the decode leg (its error reaches the client, P never sees the request); no
window within the proxy's leg timeout (503; D's leg is abandoned, which aborts the request
there); P failing or unreachable (P's error or 502, as in the pull flow; D's leg is abandoned). A
client that leaves abandons D's leg (D aborts the request and frees the window) and lets a
prefill leg already sent end in the background. D's window lease bounds everything else: when
P's writes stop reaching D while P's leg still answers (D's data link cut), D's request follows
`kv_load_failure_policy` at the lease (recompute: D computes the prompt itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from fastapi.responses import Response

from pdkv.jsontypes import JSONObject, JSONValue
from pdkv.router.proxy_legs import open_leg
from pdkv.router.proxy_protocol import (
    error_kind,
    error_response,
    prefill_params,
    prefill_timings,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from pdkv.router.backend_info import BackendInfos
    from pdkv.router.policies import Claim, Decision
    from pdkv.router.proxy_legs import LegSender
    from pdkv.router.proxy_metrics import ProxyMetrics
    from pdkv.router.proxy_routing import RequestRouter
    from pdkv.router.timings import RequestClock


class PDPath(Protocol):
    """What the push flow uses of the proxy's P/D path (`pdkv.router.proxy_pd.PDPath`)."""

    @property
    def infos(self) -> BackendInfos: ...
    @property
    def client(self) -> Callable[[], httpx.AsyncClient]: ...
    @property
    def sender(self) -> LegSender: ...
    @property
    def router(self) -> RequestRouter: ...
    @property
    def metrics(self) -> ProxyMetrics: ...
    @property
    def background(self) -> Callable[[asyncio.Future[Any]], None]: ...
    @property
    def pulled_pairs(self) -> set[tuple[str, str]]: ...

    async def prefill_leg(self, claim: Claim, path: str, body: JSONObject,
                          headers: dict[str, str], params: JSONObject | None = None
                          ) -> tuple[int, bytes]: ...

logger = logging.getLogger(__name__)

MAX_WINDOW_WAIT_S = 600.0
"""The longest wait for D's window the proxy asks for (D's route caps it there too)."""


def wants_push(pd: PDPath, p_url: str, d_url: str, body: JSONObject) -> bool:
    """Whether this request takes the push flow: both engines push (GET /kv_layout), with one
    block size or both able to push across block sizes (`push_block_sizes` "any": P re-blocks
    into D's blocks), and it asks for one choice. A pair of other block sizes that cannot is
    pulled (the pull converts what it can), and said once per pair."""
    ip, idd = pd.infos.get(p_url), pd.infos.get(d_url)
    if ip is None or idd is None or ip.transfer_mode != "push" or idd.transfer_mode != "push":
        return False
    if ip.block_size != idd.block_size and not (ip.push_block_sizes == "any"
                                                and idd.push_block_sizes == "any"):
        if (p_url, d_url) not in pd.pulled_pairs:  # said once per pair, not per request
            pd.pulled_pairs.add((p_url, d_url))
            logger.warning("push needs one block size here: %s (block size %d, push_block_sizes "
                           "%r) and %s (%d, %r) are both in push mode but not both able to push "
                           "across block sizes; their requests are pulled (a pull converts "
                           "block sizes)", p_url, ip.block_size, ip.push_block_sizes, d_url,
                           idd.block_size, idd.push_block_sizes)
        return False
    n = body.get("n")
    return n is None or n == 1


async def _abandon(leg: asyncio.Task[httpx.Response]) -> None:
    """Drop D's leg: cancel it while unanswered, else close its answer (D sees its client gone
    and aborts the request)."""
    if not leg.done():
        leg.cancel()
        with contextlib.suppress(BaseException):
            await leg
        return
    if not leg.cancelled() and leg.exception() is None:
        await leg.result().aclose()


async def _window(pd: PDPath, d_url: str, rid: str, headers: dict[str, str],
                  timeout_s: float) -> JSONObject | str:
    """D's write window for request `rid` (the grant, as D sent it), or why there is none."""
    try:
        r = await pd.client().get(f"{d_url}/v1/kv/push_grant/{rid}",
                                  params={"timeout": timeout_s}, headers=headers,
                                  timeout=timeout_s + 10.0)
    except httpx.HTTPError as e:
        return f"asking {d_url} for the write window failed: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return f"{d_url} opened no write window: {r.status_code} {r.text[:300]}"
    try:
        grant = r.json()["push_grant"]
    except (ValueError, KeyError, TypeError):
        return f"{d_url} answered its write window with {r.text[:200]!r}"
    if not isinstance(grant, dict):
        return f"{d_url} answered its write window with {r.text[:200]!r}"
    return grant


async def _hand_first_token(pd: PDPath, d_url: str, rid: str, headers: dict[str, str],
                            token: JSONValue) -> None:
    """A linear-state model: give D P's sampled token (D's window waits for it). A failure is
    logged: D's window then ends at its lease and D follows kv_load_failure_policy."""
    try:
        r = await pd.client().post(f"{d_url}/v1/kv/push_first_token/{rid}",
                                   json={"first_token": token}, headers=headers, timeout=30.0)
        if r.status_code == 200:
            return
        why = f"{r.status_code} {r.text[:300]}"
    except httpx.HTTPError as e:
        why = f"{type(e).__name__}: {e}"
    logger.warning("request %s: handing P's first token to %s failed: %s", rid, d_url, why)


async def serve_push(pd: PDPath, p_decision: Decision, d_decision: Decision, path: str,
                     body: JSONObject, headers: dict[str, str], clock: RequestClock) -> Response:
    """One request through the push flow (module doc): D's leg first, D's window, P's leg with
    it, then D's answer."""
    d, p = d_decision.backend, p_decision.backend
    rid = headers["X-Request-Id"]
    stream = bool(body.get("stream"))
    decode = dict(body)
    decode["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_mode": "push"}
    claim = pd.router.claim("decode", d_decision)
    claim.start()
    pd.metrics.requests.labels(d.url, "decode").inc()
    started = clock.d_sent = time.monotonic()
    d_leg = asyncio.ensure_future(open_leg(pd.client(), d.url + path, decode, headers, "decode"))
    wait_s = min(MAX_WINDOW_WAIT_S, pd.client().timeout.read or MAX_WINDOW_WAIT_S)
    window = asyncio.ensure_future(_window(pd, d.url, rid, headers, wait_s))
    handed_over = False  # D's leg belongs to the answer (its claim and response)
    try:
        pending: set[asyncio.Future[object]] = {d_leg, window}  # type: ignore[arg-type]
        while window in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if d_leg in done:
                if d_leg.exception() is not None:
                    handed_over = True
                    return pd.sender.not_answered(d, d_leg.exception(),  # type: ignore[arg-type]
                                                  None, headers, clock, "decode", claim, started)
                resp = d_leg.result()
                if resp.status_code != 200 or not stream:  # refused, or over without a push
                    if resp.status_code == 200:  # D answered with no write from P: a whole hit
                        pd.metrics.prefill_skipped.inc()
                        clock.mode = "pd_skip_prefill"
                    handed_over = True
                    return await pd.sender.answer(d, resp, None, headers, stream, clock,
                                                  "decode", claim, started)
        grant = window.result()
        if isinstance(grant, str):
            logger.warning("503: request %s: %s", rid, grant)
            pd.metrics.errors.labels("decode", "no_window").inc()
            return error_response(f"decode backend {grant}", 503, "ServiceUnavailableError")
        blocks = grant.get("block_ids")
        if isinstance(blocks, list) and not any(blocks):
            # D holds the whole prompt (its KV pool, its prefix cache): P has nothing to write.
            pd.metrics.prefill_skipped.inc()
            clock.mode = "pd_skip_prefill"
            handed_over = True
            try:
                resp = await d_leg
            except httpx.HTTPError as e:
                return pd.sender.not_answered(d, e, None, headers, clock, "decode", claim,
                                              started)
            return await pd.sender.answer(d, resp, None, headers, stream, clock, "decode",
                                          claim, started)
        clock.p_sent = time.monotonic()
        leg = asyncio.ensure_future(pd.prefill_leg(
            pd.router.claim("prefill", p_decision), path, body, headers,
            {"do_remote_decode": True, "push_grant": grant}))
        try:
            status, content = await asyncio.shield(leg)
        except asyncio.CancelledError:
            pd.background(leg)  # P holds nothing after a push: the leg just ends
            raise
        except httpx.HTTPError as e:
            return pd.sender.unreachable(p, "prefill", rid, e)
        finally:
            clock.p_done = time.monotonic()
        if status != 200:
            pd.metrics.errors.labels("prefill", error_kind(status, content)).inc()
            return Response(content, status_code=status, media_type="application/json")
        clock.p_timings = prefill_timings(status, content)
        params = prefill_params(status, content)
        if isinstance(params, dict) and "first_token" in params:
            await _hand_first_token(pd, d.url, rid, headers, params["first_token"])
        try:
            resp = await d_leg
        except httpx.HTTPError as e:
            handed_over = True
            return pd.sender.not_answered(d, e, None, headers, clock, "decode", claim, started)
        handed_over = True
        return await pd.sender.answer(d, resp, None, headers, stream, clock, "decode", claim,
                                      started)
    finally:
        window.cancel()
        if not handed_over:
            claim.end()
            await asyncio.shield(_abandon(d_leg))
