"""OffloadingConnector: a host-side block store under one engine (vLLM's OffloadingConnector role).

`--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"cpu_bytes_to_use": 1073741824, "eviction_mode": "reuse"}}'`.
Blocks the engine evicts from its prefix cache (including a preempted request's blocks once they
are reused) are copied to a host buffer (D2H, by `eviction_mode`); a later request whose next
blocks after its local prefix hits are on the host gets them copied back into its new blocks
(H2D) instead of recomputing them, and so does a preempted request when it resumes (swap-in: at
most one block of tokens is recomputed). The host store is LRU, `cpu_bytes_to_use` bytes, keyed
by (group, block hash). Settings: `offload_config.OffloadConfig`; scheduler half:
`offload_scheduler`; worker half: `offload_worker`. Counters: "offload:<name>" in
KVConnectorOutput.stats / take_scheduler_stats, exported as `pdkv:kv_offload_*`.

With worker processes (TP / DCP) the scheduler half stays in the engine process, on the
scheduler's logical blocks, and every rank runs a worker half on its own KV cache: the same
metadata (block ids, host slots) reaches every rank, and rank r's physical block b holds its
shard of logical block b (its KV heads under TP, its tokens under DCP), so each rank's host
slot s holds its shard of the block the scheduler put in slot s. The host slot count is the
same in every half (`OffloadConfig.num_host_slots`); the worker halves' counters also come per
rank ("offload:rank<r>:<name>").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdkv.kv_transfer.connector.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    RoleDelegatingConnector,
)
from pdkv.kv_transfer.connector.offload_messages import OffloadConnectorMetadata
from pdkv.kv_transfer.connector.offload_scheduler import OffloadConnectorScheduler

if TYPE_CHECKING:
    import torch

    from pdkv.cache.kv_cache_manager import KVCacheManager
    from pdkv.cache.kv_layout import KVLayout
    from pdkv.cache.specs import KVCacheConfig
    from pdkv.kv_transfer.connector.spec import OffloadSpec
    from pdkv.kv_transfer.connector.startup import ConnectorStartup


class OffloadingConnector(RoleDelegatingConnector):
    """Delegates to OffloadConnectorScheduler or OffloadConnectorWorker by role.

    The settings (and kv_role kv_both) were checked when `spec` was parsed (`connector_spec`).

    Args:
        kv_cache_config: the scheduler's logical view (role SCHEDULER) or this rank's own KV
            cache (role WORKER).
        layout: the engine's KV layout (its TP / DCP sizes size the host slots).
        startup: a worker half's global rank (`rank`, None in a single-process engine) labels
            its per-rank counters.
    """

    def __init__(
        self,
        spec: OffloadSpec,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        layout: KVLayout,
        startup: ConnectorStartup | None = None,
    ) -> None:
        super().__init__(spec, role, kv_cache_config, layout)
        self.offload = spec.offload
        self.scheduler: OffloadConnectorScheduler | None = None
        self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            # A logical block holds every DCP rank's share: one rank's bytes are 1/dcp of it.
            self.num_host_slots = self.offload.num_host_slots(
                kv_cache_config, layout.world_size, layout.dcp)
            block_size = kv_cache_config.groups[0].spec.block_size
            self.scheduler = OffloadConnectorScheduler(
                self.offload, self.num_host_slots, block_size, len(kv_cache_config.groups)
            )
        else:
            from pdkv.kv_transfer.connector.offload_worker import OffloadConnectorWorker

            self.num_host_slots = self.offload.num_host_slots(kv_cache_config, layout.world_size)
            rank = startup.rank if startup is not None else None
            self.worker = OffloadConnectorWorker(self.num_host_slots, rank)

    @classmethod
    def metadata_type(cls) -> type[KVConnectorMetadata]:
        return OffloadConnectorMetadata

    # ---------------------------------------------------------------- scheduler
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        assert self.scheduler is not None
        self.scheduler.bind(kv_cache_manager)

    # ------------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        assert self.worker is not None
        if isinstance(self._metadata, OffloadConnectorMetadata):
            self.worker.start_load_kv(self._metadata)

    def get_stats(self) -> tuple[dict[str, float], list[float]]:
        assert self.worker is not None
        return self.worker.get_stats(), []
