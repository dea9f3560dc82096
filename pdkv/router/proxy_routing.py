"""The proxy's routing step: which engine of a pool gets a request leg.

`RequestRouter` owns the routing policies (one per pool: prefill, decode, or the colocated
instances), the tokenizer the prompt's chunk hashes are computed with (`pdkv.router.prefix_keys`)
and the counting of each decision (`pdkv:proxy_routing_decisions_total`). A policy that wants
chunk hashes gets each backend's, cut at that backend's block and pool chunk size (GET
/kv_layout, `pdkv.router.backend_info`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import httpx

from pdkv.jsontypes import JSONObject
from pdkv.router.backend_info import BackendInfos
from pdkv.router.policies import Backend, Decision, PrefixAwareConfig, RoutingPolicy, make_policy
from pdkv.router.prefix_keys import (
    DEFAULT_BLOCK_SIZE,
    Granularity,
    KeysUnavailable,
    RequestKeyer,
    request_chunk_hashes,
)
from pdkv.router.proxy_metrics import ProxyMetrics
from pdkv.router.validate import LengthCheck, byte_bound

logger = logging.getLogger(__name__)

INLINE_RENDER_CHARS = 65536
"""A chat whose messages are at most this long (characters, as printed) is rendered with the
chat template on the event loop (well under a millisecond); a longer one on a thread."""

LEGS = ("prefill", "decode", "whole")
"""The pools a request leg is routed within: P/D's prefill and decode engines, or colocated
instances ("whole": the request goes whole to one)."""


def cache_salt(body: JSONObject) -> str | None:
    """The request's cache_salt (folded into its first block hash), or None."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) else None


class RequestRouter:
    """Chooses the engine of each request leg and counts the decision.

    Args:
        routing: the policy name (`pdkv.router.policies.POLICIES`), one instance per pool.
        infos: what the proxy knows of each engine (block and pool chunk sizes).
        metrics: the proxy's counters.
        client: the app's shared httpx client (a getter: it exists once the app started).
        tokenizer: the engines' model folder or alias (None: only prompts given as token ids
            get chunk hashes).
        prefix_aware: prefix_aware's bounds.
    Raises:
        ValueError: an unknown policy name.
    """

    def __init__(self, routing: str, infos: BackendInfos, metrics: ProxyMetrics,
                 client: Callable[[], httpx.AsyncClient], tokenizer: str | None = None,
                 prefix_aware: PrefixAwareConfig | None = None) -> None:
        self.infos = infos
        self.metrics = metrics
        self.client = client
        self.keyer = RequestKeyer(tokenizer)
        self.policies: dict[str, RoutingPolicy] = {
            leg: make_policy(routing, prefix_aware) for leg in LEGS}

    async def token_ids(self, body: JSONObject, chat: bool) -> list[int] | None:
        """The prompt's token ids as the engines will see them, or None (routing then falls
        back)."""
        try:
            return await asyncio.to_thread(self.keyer.token_ids, body, chat)
        except KeysUnavailable as e:
            logger.debug("no chunk hashes: %s", e)
            return None

    def granularity(self, url: str) -> Granularity:
        """The block and pool chunk size `url`'s engine cuts prompts at (defaults while unknown)."""
        info = self.infos.get(url)
        block = (info.block_size if info else None) or DEFAULT_BLOCK_SIZE
        return Granularity(block, (info.pool_chunk_size if info else None) or block)

    def hashes(self, ids: list[int], body: JSONObject, pool: list[Backend]
               ) -> dict[str, list[bytes]]:
        """Each backend's chunk hashes of `ids` (its own block / pool chunk size; one hashing per
        distinct size)."""
        salt = cache_salt(body)
        by_gran: dict[Granularity, list[bytes]] = {}
        out: dict[str, list[bytes]] = {}
        for b in pool:
            gran = self.granularity(b.url)
            if gran not in by_gran:
                by_gran[gran] = request_chunk_hashes(ids, gran, salt)
            out[b.url] = by_gran[gran]
        return out

    async def decide(self, leg: str, pool: list[Backend], body: JSONObject, chat: bool,
                     length: LengthCheck) -> tuple[Decision, LengthCheck]:
        """The `leg` policy's choice within `pool` (chunk hashes computed when it wants them),
        counted; the length check learns the prompt's token count when the proxy tokenized it."""
        policy = self.policies[leg]
        hashes = None
        if policy.wants_hashes:
            await self.infos.ensure(self.client(), [b.url for b in pool])
            ids = await self.token_ids(body, chat)
            if ids is not None:
                hashes = await asyncio.to_thread(self.hashes, ids, body, pool)
                if length.prompt_ids is None:
                    length = dataclasses.replace(length, prompt_ids=len(ids))
        decision = policy.decide(pool, hashes)
        self.metrics.decisions.labels(policy.name, decision.reason, leg).inc()
        if decision.matched_chunks and hashes is not None:
            chunk = self.granularity(decision.backend.url).chunk_size
            self.metrics.matched_tokens.labels(decision.backend.url).inc(
                decision.matched_chunks * chunk)
        return decision, length

    async def chat_bound(self, length: LengthCheck, body: JSONObject, chat: bool) -> LengthCheck:
        """`length` with an upper bound on a chat prompt's tokens when the proxy has the model's
        chat template (--tokenizer): the rendered prompt's `byte_bound`, as a text prompt has
        (then a chat that cannot be too long needs no POST /tokenize to D). Unchanged when the
        bound is not needed or the proxy cannot render the chat (D counts it)."""
        if (not chat or length.max_tokens is None or length.prompt_ids is not None
                or length.upper_bound is not None or self.keyer.model is None):
            return length
        messages = body.get("messages")
        size = sum(len(str(m)) for m in messages) if isinstance(messages, list) else 0
        try:
            if self.keyer.loaded and size <= INLINE_RENDER_CHARS:  # a thread hop costs more
                text = self.keyer.chat_text(body)
            else:
                text = await asyncio.to_thread(self.keyer.chat_text, body)
        except KeysUnavailable as e:
            logger.debug("no chat prompt bound: %s", e)
            return length
        return dataclasses.replace(length, upper_bound=byte_bound(text))
