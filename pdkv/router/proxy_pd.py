"""The proxy's P/D path: one request's prefill leg to a prefill engine, then its decode leg to a
decode engine (the protocol of `pdkv.router.proxy`'s module doc; vLLM's
tests/v1/kv_connector/nixl_integration/toy_proxy_server.py).

What it owns: the choice of the (P, D) pair (routing, then the layout and prompt-length checks
before anything reaches P), the pool record's skip of the prefill leg
(`pdkv.router.pool_record`), the prefill leg itself (in-flight on P until it ends, also when its
client left), and the release of P's grant whenever nobody else would: a client gone during the
prefill leg or between the legs, a decode leg D never received or refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import Response

from pdkv.jsontypes import JSONObject, JSONValue
from pdkv.router.backend_health import BackendHealth
from pdkv.router.backend_info import BackendInfos, pair_mismatch
from pdkv.router.policies import Backend, Claim
from pdkv.router.pool_record import PoolRecord, loadable_chunks
from pdkv.router.prefix_keys import DEFAULT_BLOCK_SIZE, Granularity, request_chunk_hashes
from pdkv.router.proxy_legs import LegSender, open_leg
from pdkv.router.proxy_metrics import ProxyMetrics
from pdkv.router.proxy_protocol import (
    error_kind,
    error_response,
    prefill_body,
    prefill_params,
    prefill_timings,
    releasable,
)
from pdkv.router.proxy_push import serve_push, wants_push
from pdkv.router.proxy_routing import RequestRouter, cache_salt
from pdkv.router.timings import RequestClock
from pdkv.router.validate import LengthCheck

logger = logging.getLogger(__name__)

BeforeDecodeHook = Callable[[JSONValue], Awaitable[None]]
"""Awaited with P's kv_transfer_params (as P sent them) between the legs."""


@dataclass
class PDPath:
    """The P/D path of one proxy app (its fields are the app's shared parts).

    Attributes:
        prefills, decodes: the engines of each pool.
        client: the app's shared httpx client (a getter).
        infos, health, metrics, sender, router: the app's engine info, health, counters, leg
            sender and routing.
        live: the healthy engines of a pool (probing them first when none is).
        no_healthy: the 503 of a leg whose pool has no healthy engine.
        background: keeps a task until it ends (the app's shutdown waits for it).
        release_soon: tells P to release a grant's blocks in the background.
        pool_record: the pool record (--skip-prefill-on-pool-hit), or None.
        before_decode: test seam, awaited with P's kv_transfer_params between the legs.
        pulled_pairs: (P url, D url) pairs both in push mode that are pulled anyway (their block
            sizes differ), each logged once.
    """

    prefills: list[Backend]
    decodes: list[Backend]
    client: Callable[[], httpx.AsyncClient]
    infos: BackendInfos
    health: BackendHealth
    metrics: ProxyMetrics
    sender: LegSender
    router: RequestRouter
    live: Callable[[list[Backend]], Awaitable[list[Backend]]]
    no_healthy: Callable[[str, list[Backend]], Response]
    background: Callable[[asyncio.Future[Any]], None]
    release_soon: Callable[[JSONValue], None]
    pool_record: PoolRecord | None = None
    before_decode: BeforeDecodeHook | None = None
    pulled_pairs: set[tuple[str, str]] = field(default_factory=set)

    def first_mismatch(self) -> str | None:
        """Why some (P, D) pair's KV layouts disagree, or None."""
        for p in self.prefills:
            for d in self.decodes:
                why = pair_mismatch(p.url, self.infos.get(p.url), d.url, self.infos.get(d.url))
                if why:
                    return why
        return None

    async def _precheck(
        self, p: Backend, d: Backend, length: LengthCheck, headers: dict[str, str]
    ) -> Response | None:
        """The layout and prompt-length checks, before anything reaches P."""
        await self.infos.ensure(self.client(), [p.url, d.url])
        why = pair_mismatch(p.url, self.infos.get(p.url), d.url, self.infos.get(d.url))
        if why:
            return error_response(why, 503, "ServiceUnavailableError")
        return await self.sender.length_check(d, length, headers)

    async def _pool_chunks(self, p: Backend, d: Backend, body: JSONObject,
                           chat: bool) -> tuple[int, int, list[bytes]] | None:
        """(prompt tokens, chunk size, the prompt's full-chunk hashes) when P and D use one pool
        chunking, else None (then nothing is skipped or recorded)."""
        ip, idd = self.infos.get(p.url), self.infos.get(d.url)
        if (
            ip is None
            or idd is None
            or not ip.pool_chunk_size
            or ip.pool_chunk_size != idd.pool_chunk_size
        ):
            return None
        block = ip.block_size or DEFAULT_BLOCK_SIZE
        if (idd.block_size or DEFAULT_BLOCK_SIZE) != block:
            return None
        ids = await self.router.token_ids(body, chat)
        if ids is None:
            return None
        gran = Granularity(block, ip.pool_chunk_size)
        hashes = await asyncio.to_thread(request_chunk_hashes, ids, gran, cache_salt(body))
        return len(ids), ip.pool_chunk_size, hashes

    async def prefill_leg(self, claim: Claim, path: str, body: JSONObject,
                          headers: dict[str, str], params: JSONObject | None = None
                          ) -> tuple[int, bytes]:
        """Send the prefill leg of `body` (`prefill_body`; with kv_transfer_params `params`
        when given: the push flow's) to `claim.backend`; (status, body) of P's answer. The claim
        holds until the leg ends, also when it ends in the background after its client left,
        and is given P's `pdkv_timings`.

        Raises:
            httpx.HTTPError: P gave no answer.
        """
        p = claim.backend
        claim.start()
        self.metrics.requests.labels(p.url, "prefill").inc()
        started = time.monotonic()
        answer: JSONValue = None
        try:
            leg_body = prefill_body(body)
            if params is not None:
                leg_body["kv_transfer_params"] = params
            r = await open_leg(self.client(), p.url + path, leg_body, headers, "prefill")
            try:
                status, content = r.status_code, await r.aread()
            finally:
                await r.aclose()
            answer = prefill_timings(status, content)
            return status, content
        finally:
            claim.end(answer)
            self.metrics.latency.labels("prefill").observe(time.monotonic() - started)

    def _release_orphaned(
        self, p: Backend, rid: str
    ) -> Callable[[asyncio.Task[tuple[int, bytes]]], None]:
        """The done callback of a prefill leg whose client left: release the grant P's answer
        names (nothing else would before the lease expires)."""

        def done(leg: asyncio.Task[tuple[int, bytes]]) -> None:
            if leg.cancelled() or leg.exception() is not None:
                return  # no answer: P aborted the request, or a held grant's lease ends it
            params = prefill_params(*leg.result())
            if releasable(params):
                logger.info("request %s: client left during the prefill leg; releasing its "
                            "grant on %s", rid, p.url)
                self.release_soon(params)

        return done

    async def serve(self, body: JSONObject, path: str, headers: dict[str, str],
                    length: LengthCheck, chat: bool, clock: RequestClock) -> Response:
        """Both legs of one request (or the decode leg alone when the pool holds its prompt)."""
        live_p = self.health.healthy(self.prefills)
        live_d = self.health.healthy(self.decodes)
        if not live_p or not live_d:  # probe first (both pools at once); else no task to wait on
            live_p, live_d = await asyncio.gather(self.live(self.prefills),
                                                  self.live(self.decodes))
        if not live_p:
            return self.no_healthy("prefill", self.prefills)
        if not live_d:  # before the prefill leg: P spends nothing on a request D cannot take
            return self.no_healthy("decode", self.decodes)
        p_decision, length = await self.router.decide("prefill", live_p, body, chat, length)
        p = p_decision.backend
        # Prefer decode engines known to fit this P; when none does, the check below names why.
        await self.infos.ensure(self.client(), [p.url] + [b.url for b in live_d])
        fits = [
            b
            for b in live_d
            if pair_mismatch(p.url, self.infos.get(p.url), b.url, self.infos.get(b.url)) is None
        ]
        decision, length = await self.router.decide("decode", fits or live_d, body, chat, length)
        d = decision.backend
        clock.mark("route")
        length = await self.router.chat_bound(length, body, chat)
        refused = await self._precheck(p, d, length, headers)
        if refused is not None:
            return refused
        clock.mark("length")
        record = self.pool_record
        pool_chunks = await self._pool_chunks(p, d, body, chat) if record is not None else None
        if pool_chunks and record is not None:
            n_tokens, chunk, hashes = pool_chunks
            if record.covers(hashes[: loadable_chunks(n_tokens, chunk)]):
                # The pool holds the prompt (as far as the proxy knows): D loads it, no P leg.
                self.metrics.prefill_skipped.inc()
                clock.mode = "pd_skip_prefill"
                return await self.sender.decode_leg(
                    d, path, body, headers, None, bool(body.get("stream")), clock,
                    claim=self.router.claim("decode", decision)
                )
        if wants_push(self, p.url, d.url, body):
            clock.mode = "pd_push"
            return await serve_push(self, p_decision, decision, path, body, headers, clock)
        clock.p_sent = time.monotonic()
        leg = asyncio.ensure_future(self.prefill_leg(self.router.claim("prefill", p_decision),
                                                      path, body, headers))
        try:
            status, content = await asyncio.shield(leg)
        except asyncio.CancelledError:
            # The client left during the prefill leg. Aborting it would leave a prefill P already
            # finished holding its blocks until the lease expires (only P's answer names the
            # grant): let the leg end in the background and release what it names.
            leg.add_done_callback(self._release_orphaned(p, headers["X-Request-Id"]))
            self.background(leg)
            raise
        except httpx.HTTPError as e:
            return self.sender.unreachable(p, "prefill", headers["X-Request-Id"], e)
        finally:
            clock.p_done = time.monotonic()
        if status != 200:
            if status >= 500:
                logger.warning("request %s: prefill leg to %s answered %d: %s",
                               headers["X-Request-Id"], p.url, status,
                               content[:300].decode("utf-8", "replace"))
            self.metrics.errors.labels("prefill", error_kind(status, content)).inc()
            return Response(content, status_code=status, media_type="application/json")
        try:
            answer = json.loads(content)
            params: JSONValue = answer.get("kv_transfer_params")
            clock.p_timings = answer.get("pdkv_timings")
        except (ValueError, AttributeError):
            logger.warning("502: request %s: prefill leg to %s answered 200 without a JSON "
                           "object: %r", headers["X-Request-Id"], p.url, content[:300])
            self.metrics.errors.labels("prefill", "bad_response").inc()
            return error_response(
                f"prefill backend {p.url} answered 200 without a JSON object", 502, "BadGateway"
            )
        if pool_chunks and record is not None:
            record.add(pool_chunks[2])  # P saved the prompt's full chunks into the pool
        decode = dict(body)
        decode["kv_transfer_params"] = params
        sent = False
        try:
            if self.before_decode is not None:
                await self.before_decode(params)
            sent = True
            return await self.sender.decode_leg(
                d, path, decode, headers, params, bool(body.get("stream")), clock,
                claim=self.router.claim("decode", decision)
            )
        except BaseException:  # the client left (cancellation) or a bug
            if not sent:  # D never saw the request: nobody else will release P's blocks
                self.release_soon(params)
            raise
