"""KVPoolConnector: KV reuse across requests and instances through a tiered pool.

`--kv-transfer-config '{"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"chunk_size": 256, "tiers": [{"name": "dram", "capacity_bytes":
1073741824}, {"name": "disk", "capacity_bytes": 4294967296}, {"name": "redis", "url":
"redis://127.0.0.1:6379/0"}]}}'` (the role of vLLM-Ascend's AscendStoreConnector and of LMCache's
LMCacheConnectorV1). kv_producer saves only, kv_consumer loads only, kv_both does both. Settings:
`pool_config.PoolConnectorConfig`. Keys: `pdkv.kvpool.keys` (chained chunk hash + a fingerprint
of everything that changes KV); values: `pdkv.kvpool.codec` (typed header + checksum).

Both halves of one engine use one `KVPoolStore`, created by whichever half is built first and
shared through the start-up values (`ConnectorStartup.pool_store`); the worker half closes it.
With TP/DCP worker processes each rank's worker half opens its own store and stores its own shard
of every chunk under its rank's namespace (the fingerprint has its tp/dcp rank and size); the
scheduler half opens no store and asks every rank's lookup server (`pool_lookup`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from pdkv.kv_transfer.connector.base import (
    KVConnectorRole,
    RoleDelegatingConnector,
)
from pdkv.kv_transfer.connector.pool_config import PoolConnectorConfig
from pdkv.kv_transfer.connector.pool_lookup import PoolLookup, RankLookup, StoreLookup
from pdkv.kv_transfer.connector.pool_messages import PoolConnectorMetadata
from pdkv.kv_transfer.connector.pool_scheduler import PoolConnectorScheduler
from pdkv.kvpool.events import PoolEventQueue, PoolTierEvents
from pdkv.kvpool.keys import PoolNamespace
from pdkv.kvpool.store import KVPoolStore
from pdkv.kvpool.tiers.factory import create_tier

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from pdkv.cache.kv_cache_manager import KVCacheManager
    from pdkv.cache.kv_layout import KVLayout
    from pdkv.cache.specs import KVCacheConfig
    from pdkv.kv_transfer.connector.pool_worker import PoolConnectorWorker
    from pdkv.kv_transfer.connector.spec import PoolSpec
    from pdkv.kv_transfer.connector.startup import ConnectorStartup
    from pdkv.request import Request


def build_store(pool: PoolConnectorConfig) -> KVPoolStore:
    """The store over the configured tiers, fastest first.

    Raises:
        ValueError: a bad tier spec (named), or a tier that cannot start (e.g. no redis client).
    """
    tiers = []
    try:
        for spec in pool.tiers:
            tiers.append(create_tier(spec, pool.default_dir))
    except Exception:
        for t in tiers:
            t.close()
        raise
    return KVPoolStore(tiers, save_queue_size=pool.save_queue_size,
                       retry_after_s=pool.tier_retry_after_s)


def check_multi_rank_groups(kinds: Iterable[str]) -> None:
    """Refuse the KV cache group kinds the pool does not store per rank yet.

    Args:
        kinds: the engine's KV cache group kinds (`KVCacheSpec.kind`).

    Raises:
        ValueError: a kind other than full_attention (named), with what to do instead.
    """
    other = sorted(set(kinds) - {"full_attention"})
    if other:
        raise ValueError(
            f"KVPoolConnector with TP/DCP worker processes supports full-attention KV cache "
            f"groups only so far, not {other}; run this model with tp 1 and dcp 1 for the pool")


def _describe(spec: Mapping[str, object]) -> str:
    """A tier spec for the start-up log line (name and where it lives, no secrets in URLs)."""
    where = spec.get("path") or spec.get("master") or str(spec.get("url", "")).split("@")[-1]
    size = spec.get("capacity_bytes")
    gib = f" {size / 2**30:g} GiB" if isinstance(size, int | float) and size else ""
    return f"{spec['name']}" + (f" {where}" if where else "") + gib


class KVPoolConnector(RoleDelegatingConnector):
    """Delegates to PoolConnectorScheduler or PoolConnectorWorker by role.

    Raises:
        ValueError: a bad tier spec (`build_store`; the other settings were checked when the
            spec was parsed, `connector_spec`).
    """

    def __init__(
        self,
        spec: PoolSpec,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        layout: KVLayout,
        startup: ConnectorStartup,
    ) -> None:
        super().__init__(spec, role, kv_cache_config, layout)
        self.pool = spec.pool
        # A TP/DCP engine: the scheduler half (engine process) asks the ranks' lookup servers;
        # each worker process stores and loads its own shard under its rank's namespace.
        ranks = startup.pool_lookup_endpoints
        multi_rank = bool(ranks) or (startup.world_size or 1) > 1
        if multi_rank:
            check_multi_rank_groups(g.spec.kind for g in kv_cache_config.groups)
        # Blocks in the metadata are the scheduler's (with DCP: block_size × DCP tokens, each
        # rank's physical block holding its share).
        block_size = kv_cache_config.groups[0].spec.block_size
        if role == KVConnectorRole.WORKER:
            block_size *= startup.dcp_size
        # A linear-state group is stored and loaded like a window of 2 tokens (pdkv.kvpool.window):
        # chunk j keeps only its last block's slot, the checkpoint after end_j; a hit of L loads
        # the slot of block (L - 1) // bs, the state the request resumes from.
        self.linear = any(g.spec.state_slot for g in kv_cache_config.groups)
        windows = tuple(2 if g.spec.state_slot else w
                        for g, w in zip(kv_cache_config.groups, kv_cache_config.sliding_windows))
        self.scheduler: PoolConnectorScheduler | None = None
        self.worker: PoolConnectorWorker | None = None
        self.store: KVPoolStore | None = None
        self.namespace: PoolNamespace | None = None
        lookup: PoolLookup
        if role == KVConnectorRole.SCHEDULER and ranks:
            lookup = RankLookup(ranks, self.pool.lookup_timeout_s)
            logger.info("KV pool (%s): chunk %d tokens, %d ranks each storing its shard, tiers %s",
                        spec.kv_role, self.pool.chunk_size, len(ranks),
                        ", ".join(_describe(t) for t in self.pool.tiers))
        else:
            store = startup.pool_store
            if store is None:
                store = startup.pool_store = build_store(self.pool)
                if not multi_rank:
                    logger.info("KV pool (%s): chunk %d tokens, tiers %s", spec.kv_role,
                                self.pool.chunk_size,
                                ", ".join(_describe(t) for t in self.pool.tiers))
            self.store = store
            self.namespace = PoolNamespace.from_layout(
                layout, kv_cache_config, self.pool.chunk_size,
                tp_rank=startup.tp_rank, tp_size=startup.tp_size,
                dcp_rank=startup.dcp_rank, dcp_size=startup.dcp_size)
            lookup = StoreLookup(store, self.namespace.fingerprint)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = PoolConnectorScheduler(
                spec, self.pool, lookup, block_size, len(kv_cache_config.groups), windows)
        else:
            from pdkv.kv_transfer.connector.pool_worker import PoolConnectorWorker

            assert self.store is not None and self.namespace is not None
            self.worker = PoolConnectorWorker(self.pool, self.store, self.namespace.fingerprint,
                                              block_size, windows)
            if multi_rank:
                startup.pool_lookup_address = self.worker.serve_lookups(startup.node_host)

    @classmethod
    def metadata_type(cls) -> type[PoolConnectorMetadata]:
        return PoolConnectorMetadata

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Raises:
            ValueError: a linear-state model without prefix caching (no checkpoint slot per block
                to store at a chunk's end)."""
        if self.linear and not kv_cache_manager.enable_caching:
            raise ValueError("KVPoolConnector on a model with linear-attention state needs prefix "
                             "caching (a state checkpoint per block): set enable_prefix_caching "
                             "(the default)")

    # ---------------------------------------------------------------- scheduler
    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def next_deadline(self) -> float | None:
        return self.scheduler.next_deadline() if self.scheduler is not None else None

    def report_tier_events(self, queue: PoolEventQueue) -> None:
        """Every tier of the store reports its chunks (medium: the tier's name upper-cased,
        block size: the chunk size) into `queue`; descriptions are kept for the saves that can
        wait in the store's queue at once, and more."""
        if self.store is None or self.namespace is None:  # the stores live in the ranks
            return
        self.store.set_tier_events(PoolTierEvents(
            queue, self.namespace.fingerprint, self.pool.chunk_size,
            max_described=max(256, 4 * self.pool.save_queue_size)))

    # ------------------------------------------------------------------- worker
    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        if self.scheduler is not None:
            self.scheduler.set_wakeup(wakeup)
        if self.worker is not None:
            self.worker.set_wakeup(wakeup)

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        assert self.worker is not None
        if isinstance(self._metadata, PoolConnectorMetadata):
            self.worker.start_load_kv(self._metadata)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        if isinstance(self._metadata, PoolConnectorMetadata):
            self.worker.wait_for_save(self._metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.worker is not None
        return set(), self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def get_load_errors(self) -> dict[str, str]:
        assert self.worker is not None
        return self.worker.get_load_errors()

    def get_request_bytes(self) -> dict[str, dict[str, float]]:
        assert self.worker is not None
        return self.worker.get_request_bytes()

    def get_stats(self) -> tuple[dict[str, float], list[float]]:
        assert self.worker is not None
        return self.worker.get_stats(), []

    def get_observations(self) -> dict[str, list[float]]:
        assert self.worker is not None
        return self.worker.get_observations()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
