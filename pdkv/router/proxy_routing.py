"""The proxy's routing step: which engine of a pool gets a request leg.

`RequestRouter` owns the routing policies (one per pool: prefill, decode, or the colocated
instances), the tokenizer the prompt's chunk hashes are computed with (`pdkv.router.prefix_keys`)
and the counting of each decision (`pdkv:proxy_routing_decisions_total`). A policy that wants
chunk hashes gets each backend's, cut at that backend's block and pool chunk size (GET
/kv_layout, `pdkv.router.backend_info`), or at its block size (kv_aware).

kv_aware (`pdkv.router.kv_aware`): the router follows every backend's KV events
(`pdkv.router.kv_subscriber` into one `pdkv.router.kv_index.KVIndex`): `follow` reads the
backend's GET /kv_events after each health probe that found it up and subscribes again when its
engine id, epoch or endpoints changed (a restart); a probe that finds it down stops following it
and forgets what it held. A backend without KV events (404) is routed to as holding nothing
(warned once). Each leg's `Claim` keeps its prompt blocks in the backend's `active_blocks` until
it ends, then compares the engine's own prefix-cache hit (`pdkv_timings.tokens`: cached −
external) with the prediction (`pdkv:proxy_kv_predictions_total`). kv_aware_oracle asks every
engine what it holds (POST /kv_events/held) before each decision instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping

import httpx

from pdkv.jsontypes import JSONObject
from pdkv.router.backend_info import BackendInfos
from pdkv.router.kv_aware import KVAware, KVAwareConfig, KVAwareOracle
from pdkv.router.kv_index import KVIndex, KVIndexConfig
from pdkv.router.kv_subscriber import EventSource, KVEventSubscriber
from pdkv.router.policies import (
    Backend,
    Claim,
    Decision,
    PrefixAwareConfig,
    RoutingPolicy,
    make_policy,
)
from pdkv.router.prefix_keys import (
    DEFAULT_BLOCK_SIZE,
    Granularity,
    KeysUnavailable,
    RequestKeyer,
    request_chunk_hashes,
)
from pdkv.router.proxy_metrics import KVEventsState, ProxyMetrics
from pdkv.router.validate import LengthCheck, byte_bound

logger = logging.getLogger(__name__)

INLINE_RENDER_CHARS = 65536
"""A chat whose messages are at most this long (characters, as printed) is rendered with the
chat template on the event loop (well under a millisecond); a longer one on a thread."""

KV_INFO_TIMEOUT_S = 5.0
"""Seconds a GET /kv_events or POST /kv_events/held may take."""

LEGS = ("prefill", "decode", "whole")
"""The pools a request leg is routed within: P/D's prefill and decode engines, or colocated
instances ("whole": the request goes whole to one)."""


def cache_salt(body: JSONObject) -> str | None:
    """The request's cache_salt (folded into its first block hash), or None."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) else None


def prediction_outcome(predicted_blocks: int, block_size: int,
                       tokens: object) -> tuple[int, int] | None:
    """(predicted, reported) prefix-cache hit tokens of one leg, or None when the engine's
    `pdkv_timings.tokens` (`pdkv.serve.timings.PromptTokens`) is missing or malformed. The
    prediction is capped as the engine caps a hit: never the block holding the last prompt token
    (it is computed to sample), i.e. at most (prompt - 1) // block_size blocks."""
    if not isinstance(tokens, dict):
        return None
    try:
        prompt, cached, external = (int(tokens[k]) for k in ("prompt", "cached", "external"))
    except (KeyError, TypeError, ValueError):
        return None
    cap = max(0, (prompt - 1) // block_size)
    return min(predicted_blocks, cap) * block_size, max(0, cached - external)


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
        kv_aware: kv_aware's (and kv_aware_oracle's) cost weight.
        kv_index: the KV event index's medium weights and bound (kv_aware).
    Raises:
        ValueError: an unknown policy name.
    """

    def __init__(self, routing: str, infos: BackendInfos, metrics: ProxyMetrics,
                 client: Callable[[], httpx.AsyncClient], tokenizer: str | None = None,
                 prefix_aware: PrefixAwareConfig | None = None,
                 kv_aware: KVAwareConfig | None = None,
                 kv_index: KVIndexConfig | None = None) -> None:
        self.infos = infos
        self.metrics = metrics
        self.client = client
        self.keyer = RequestKeyer(tokenizer)
        self.subscriber: KVEventSubscriber | None = None
        self._sources: dict[str, EventSource] = {}
        self._silent: set[str] = set()  # backends that publish no KV events (warned once)
        def sizes(url: str) -> int:
            return self.granularity(url).block_size

        self.policies: dict[str, RoutingPolicy]
        if routing == "kv_aware":
            index = KVIndex(kv_index)
            self.subscriber = KVEventSubscriber(index)
            self.policies = {leg: KVAware(index, kv_aware, sizes) for leg in LEGS}
            metrics.watch_kv_events(self._kv_states)
        elif routing == "kv_aware_oracle":
            self.policies = {leg: KVAwareOracle(kv_aware, sizes) for leg in LEGS}
        else:
            self.policies = {leg: make_policy(routing, prefix_aware) for leg in LEGS}

    @property
    def follows_kv_events(self) -> bool:
        """Whether the router subscribes to the backends' KV events (kv_aware)."""
        return self.subscriber is not None

    def _kv_states(self) -> dict[str, KVEventsState]:
        sub = self.subscriber
        if sub is None:
            return {}
        # A followed engine that holds nothing reads 0, not a missing series.
        return {url: (sub.counters(url),
                      sub.index.num_blocks(url) or ({"GPU": 0} if url in self._sources else {}))
                for url in sub.counted()}

    async def follow(self, url: str) -> None:
        """Follow `url`'s KV events as its GET /kv_events says now (kv_aware; else nothing):
        subscribe again when its engine id, epoch or endpoints changed, stop when it has none."""
        if self.subscriber is None:
            return
        try:
            r = await self.client().get(url + "/kv_events", timeout=KV_INFO_TIMEOUT_S)
        except httpx.HTTPError as e:
            logger.debug("GET %s/kv_events failed: %s", url, e)
            return  # the health probe decides whether it is down
        if r.status_code == 404:
            if url not in self._silent:
                self._silent.add(url)
                logger.warning("kv_aware: %s publishes no KV events (start it with "
                               "--kv-events-config): routed to as holding nothing", url)
            self.unfollow(url)
            return
        try:
            r.raise_for_status()
            source = EventSource.from_info(url, r.json())
        except (httpx.HTTPError, ValueError, TypeError) as e:
            logger.warning("kv_aware: GET %s/kv_events unusable: %s", url, e)
            return
        self._silent.discard(url)
        if self._sources.get(url) != source:
            logger.info("kv_aware: following the KV events of %s (engine %s, epoch %d) at %s",
                        url, source.engine_id, source.epoch or 0, source.endpoint)
            self._sources[url] = source
            self.subscriber.add(source)

    def unfollow(self, url: str) -> None:
        """Stop following `url` and forget what it held (it went down)."""
        if self.subscriber is not None and self._sources.pop(url, None) is not None:
            self.subscriber.remove(url)

    async def aclose(self) -> None:
        """Stop following every backend."""
        if self.subscriber is not None:
            await self.subscriber.close()

    def claim(self, leg: str, decision: Decision) -> Claim:
        """The load claim of a leg sent as `decision` says; for kv_aware and kv_aware_oracle it
        also checks the prediction against the engine's report when the leg ends."""
        policy = self.policies[leg]
        b = decision.backend
        if not isinstance(policy, KVAware) or decision.reason == "fallback":
            return Claim(b, decision.load_blocks)
        block_size = self.granularity(b.url).block_size
        predicted_blocks = decision.matched_chunks

        def check(answer: object) -> None:
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            got = prediction_outcome(predicted_blocks, block_size, tokens)
            if got is None:
                return
            predicted, reported = got
            outcome = ("exact" if predicted == reported else
                       "over" if predicted > reported else "under")
            self.metrics.kv_predictions.labels(b.url, outcome).inc()
            self.metrics.kv_predicted_tokens.labels(b.url).inc(predicted)
            self.metrics.kv_reported_tokens.labels(b.url).inc(reported)

        return Claim(b, decision.load_blocks, check)

    async def _ask_held(self, oracle: KVAwareOracle, pool: list[Backend],
                        hashes: Mapping[str, list[bytes]]) -> None:
        """kv_aware_oracle: each engine's held prefix of the prompt, asked now (an engine that
        does not answer holds nothing)."""

        async def ask(b: Backend) -> None:
            mine = hashes.get(b.url, [])
            held = 0
            try:
                r = await self.client().post(b.url + "/kv_events/held",
                                             json={"block_hashes": [h.hex() for h in mine]},
                                             timeout=KV_INFO_TIMEOUT_S)
                r.raise_for_status()
                held = int(r.json()["held_blocks"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                if b.url not in self._silent:  # once per engine, until it answers again
                    self._silent.add(b.url)
                    why = e.response.text[:200] if isinstance(e, httpx.HTTPStatusError) else e
                    logger.warning("kv_aware_oracle: POST %s/kv_events/held failed (%s): "
                                   "routed to as holding nothing", b.url, why)
            else:
                self._silent.discard(b.url)
            oracle.set_held(b.url, mine[:held], self.granularity(b.url).block_size)

        await asyncio.gather(*(ask(b) for b in pool))

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

    def hashes(self, ids: list[int], body: JSONObject, pool: list[Backend],
               per_block: bool = False) -> dict[str, list[bytes]]:
        """Each backend's chunk hashes of `ids` (its own block / pool chunk size, or block size
        alone when `per_block`; one hashing per distinct size)."""
        salt = cache_salt(body)
        by_gran: dict[Granularity, list[bytes]] = {}
        out: dict[str, list[bytes]] = {}
        for b in pool:
            gran = self.granularity(b.url)
            if per_block:
                gran = Granularity(gran.block_size, gran.block_size)
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
                hashes = await asyncio.to_thread(self.hashes, ids, body, pool,
                                                 policy.block_hashes)
                if length.prompt_ids is None:
                    length = dataclasses.replace(length, prompt_ids=len(ids))
        if isinstance(policy, KVAwareOracle) and hashes is not None:
            await self._ask_held(policy, pool, hashes)
        decision = policy.decide(pool, hashes)
        self.metrics.decisions.labels(policy.name, decision.reason, leg).inc()
        if decision.matched_chunks and hashes is not None:
            gran = self.granularity(decision.backend.url)
            chunk = gran.block_size if policy.block_hashes else gran.chunk_size
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
