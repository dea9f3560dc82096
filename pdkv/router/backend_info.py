"""What the proxy knows about each engine: KV role, engine id, layout and pool chunk size
(GET /kv_layout) and max_model_len (GET /v1/models), refreshed when the engine (re)becomes
healthy and in the background once stale (never on a request's path once known), and the pair
check that asks the connector whether a prefill and a decode engine can exchange KV."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from pdkv.jsontypes import JSONObject, JSONValue, as_int
from pdkv.kv_transfer.connector.p2p_messages import conversion_error, layout_mismatch

PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class BackendInfo:
    """One engine's answers.

    Attributes:
        kv_role: its kv_role, or None when it has no kv connector (GET /kv_layout is 404).
        engine_id: its kv engine id (None without a connector).
        layout: its KV cache layout dict (None without a connector).
        max_model_len: from /v1/models (None when not reported).
        fetched_at: time.monotonic() of the fetch.
        pool_chunk_size: tokens per KV pool chunk (None: no pool, or not reported).
        model_ids: the served model names from /v1/models (None when not reported).
        transfer_mode: "push" when its P2PConnector takes push-mode requests (GET /kv_layout's
            `transfer_mode`), else "pull" (also when not reported).
        push_block_sizes: "any" when it pushes to (or takes pushes from) an engine of another
            block size (GET /kv_layout's `push_block_sizes`), else "equal" (also when not
            reported: an engine from before pushes re-blocked).
        kv_cache_groups: its number of KV cache groups (GET /kv_layout's `kv_cache_groups`; 1
            when not reported): a decode engine re-blocks a producer of another block size only
            with one group.
    """

    kv_role: str | None
    engine_id: str | None
    layout: JSONObject | None
    max_model_len: int | None
    fetched_at: float
    pool_chunk_size: int | None = None
    model_ids: tuple[str, ...] | None = None
    transfer_mode: str = "pull"
    push_block_sizes: str = "equal"
    kv_cache_groups: int = 1

    @property
    def block_size(self) -> int | None:
        """Tokens per KV block from the layout (None when unknown)."""
        try:
            return as_int(self.layout["block_size"]) if self.layout else None
        except (KeyError, TypeError, ValueError):
            return None


async def fetch_info(
    client: httpx.AsyncClient, url: str, timeout: float = 5.0
) -> BackendInfo | None:
    """GET url/kv_layout and url/v1/models; None when the engine is unreachable or answers
    anything unexpected (then nothing is known and the caller asks again later)."""
    try:
        lay, models = await asyncio.gather(client.get(url + "/kv_layout", timeout=timeout),
                                           client.get(url + "/v1/models", timeout=timeout))
    except httpx.HTTPError:
        return None
    chunk: int | None = None
    mode, sizes, groups = "pull", "equal", 1
    if lay.status_code == 404:
        role, engine_id, layout = None, None, None
    elif lay.status_code == 200:
        try:
            data = lay.json()
            role, engine_id, layout = (
                str(data["kv_role"]),
                str(data["engine_id"]),
                dict(data["layout"]),
            )
            raw_chunk = data.get("pool_chunk_size")
            chunk = int(raw_chunk) if raw_chunk is not None else None
            mode = "push" if data.get("transfer_mode") == "push" else "pull"
            sizes = "any" if data.get("push_block_sizes") == "any" else "equal"
            groups = int(data.get("kv_cache_groups", 1))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
    else:
        return None
    max_len = None
    model_ids: tuple[str, ...] | None = None
    if models.status_code == 200:
        try:
            cards = models.json()["data"]
            model_ids = tuple(str(c["id"]) for c in cards) or None
            max_len = int(cards[0]["max_model_len"])
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            max_len = None
    return BackendInfo(role, engine_id, layout, max_len, time.monotonic(), chunk, model_ids,
                       mode, sizes, groups)


def unknown_model(model: JSONValue, infos: list[BackendInfo | None]) -> str | None:
    """Why no backend serves `model` (vLLM's "does not exist" message naming what is served), or
    None: no model asked for (None), or one of them serves it, or none has reported its names
    yet (the engine then decides)."""
    if model is None:
        return None
    served = [m for info in infos if info is not None and info.model_ids for m in info.model_ids]
    if not served or model in served:
        return None
    names = ", ".join(f"`{m}`" for m in dict.fromkeys(served))
    return f"The model `{model}` does not exist; this deployment serves {names}."


def pair_mismatch(
    p_url: str, p: BackendInfo | None, d_url: str, d: BackendInfo | None
) -> str | None:
    """Why prefill engine `p` and decode engine `d` cannot work together, naming both values
    (the connector's own layout check), or None when they can or not enough is known."""
    if p is None or d is None:
        return None
    if p.kv_role is not None and p.kv_role not in PRODUCER_ROLES:
        return f"prefill backend {p_url} has kv_role={p.kv_role!r}, not a producer"
    if d.kv_role is not None and d.kv_role not in CONSUMER_ROLES:
        return f"decode backend {d_url} has kv_role={d.kv_role!r}, not a consumer"
    if p.layout is None or d.layout is None:
        return None
    message = layout_mismatch(d.layout, p.layout) or conversion_error(d.layout, p.layout)
    if message is None and d.kv_cache_groups != 1 and p.block_size != d.block_size:
        # the decode engine's own refusal (p2p_compat.shard_error), known before P runs
        message = (f"decode block_size={d.block_size} differs from the producer's "
                   f"block_size={p.block_size}: re-blocking needs one KV cache group (the "
                   f"decode engine has {d.kv_cache_groups})")
    if message is None:
        return None
    return f"{message}; prefill {p_url}, decode {d_url}"


class BackendInfos:
    """Per-URL BackendInfo, fetched when a request needs an engine nothing is known about,
    refreshed in the background once older than `ttl` seconds, and on every health probe. One
    fetch per URL at a time (concurrent callers share it). Used from the proxy's event loop
    only."""

    def __init__(self, ttl: float = 5.0) -> None:
        self.ttl = ttl
        self._infos: dict[str, BackendInfo] = {}
        self._fetching: dict[str, asyncio.Future[BackendInfo | None]] = {}

    def get(self, url: str) -> BackendInfo | None:
        """What is known about `url` (None: nothing yet)."""
        return self._infos.get(url)

    def forget(self, url: str) -> None:
        """Drop what is known (the engine went away or answered unexpectedly)."""
        self._infos.pop(url, None)

    async def _fetch(self, client: httpx.AsyncClient, url: str) -> BackendInfo | None:
        info = await fetch_info(client, url)
        if info is None:
            self.forget(url)
        else:
            self._infos[url] = info
        return info

    def _start(self, client: httpx.AsyncClient, url: str) -> asyncio.Future[BackendInfo | None]:
        """The fetch of `url` under way, or a new one."""
        task = self._fetching.get(url)
        if task is None:
            task = self._fetching[url] = asyncio.ensure_future(self._fetch(client, url))
            task.add_done_callback(
                lambda t: self._fetching.pop(url) if self._fetching.get(url) is t else None)
        return task

    async def refresh(self, client: httpx.AsyncClient, url: str) -> BackendInfo | None:
        """Fetch now (joining a fetch under way); an unreachable engine is forgotten."""
        return await asyncio.shield(self._start(client, url))

    async def ensure(self, client: httpx.AsyncClient, urls: list[str]) -> None:
        """Fetch the unknown ones now (concurrently; the caller waits, up to fetch_info's
        timeout), and start a background refetch of those older than `ttl` (the caller goes on
        with what is known: a request does not wait for engines the proxy already knows)."""
        now = time.monotonic()
        unknown = []
        for u in urls:
            info = self._infos.get(u)
            if info is None:
                unknown.append(self._start(client, u))
            elif now - info.fetched_at > self.ttl:
                self._start(client, u)
        if unknown:
            await asyncio.gather(*(asyncio.shield(t) for t in unknown))

    async def aclose(self) -> None:
        """Cancel the fetches under way (at shutdown, before the client closes)."""
        tasks = list(self._fetching.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
