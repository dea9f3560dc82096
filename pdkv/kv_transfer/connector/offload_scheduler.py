"""Scheduler half of the OffloadingConnector (torch-free).

Stores (D2H): the block pool's eviction hook reports every cached block popped for reuse while
this step is being scheduled; `build_connector_meta` (end of the same `schedule()`) turns them,
by `eviction_mode`, into copies that the worker half runs at the start of this step, before any
load and before the forward pass, so each block is read while it still holds the evicted content.
A preempted request's full blocks are cached like any others, so when they are reused they are
stored the same way (swap-out), and its resumption finds them on the host (swap-in).

Loads (H2D): for a waiting request, the run of consecutive blocks right after its local prefix
hits that the host holds (whole blocks before its last token) is offered as a synchronous load
(`load_async=False`): the worker copies them into the request's new blocks before the forward
pass of the admitting step; the scheduler counts them as computed. Host slots read by a load are
pinned until the step's output comes back, so a store of the same step never takes them. Host
evictions (LRU) happen only in `build_connector_meta`, after every load of the step is planned,
so a host hit offered by `get_num_new_matched_tokens` is still there in `update_state_after_alloc`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdkv.block_hashing import BlockHash
from pdkv.jsontypes import JSONObject
from pdkv.kv_transfer.connector.base import KVConnectorOutput
from pdkv.kv_transfer.connector.offload_config import OffloadConfig
from pdkv.kv_transfer.connector.offload_index import HostBlockIndex
from pdkv.kv_transfer.connector.offload_messages import BlockCopy, OffloadConnectorMetadata

if TYPE_CHECKING:
    from pdkv.cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from pdkv.request import Request
    from pdkv.sched.output import SchedulerOutput


class OffloadConnectorScheduler:
    """Args:
        offload: parsed settings.
        num_host_slots: host blocks per group.
        block_size: tokens per block.
        num_groups: KV cache groups.
    """

    def __init__(
        self, offload: OffloadConfig, num_host_slots: int, block_size: int, num_groups: int
    ) -> None:
        self.offload = offload
        self.mode = offload.eviction_mode
        self.block_size = block_size
        self.num_groups = num_groups
        self.indexes = [HostBlockIndex(num_host_slots) for _ in range(num_groups)]
        # Blocks evicted while this step is scheduled: (group, hash, block id), in order.
        self._evicted: list[tuple[int, BlockHash, int]] = []
        self._evicted_ids: set[tuple[int, int]] = set()
        self._h2d: list[BlockCopy] = []
        self._pinned: list[BlockCopy] = []  # loads of the step in flight (slots pinned)
        self._stats: dict[str, float] = {}
        self._seen_host_evictions = 0

    def _count(self, key: str, value: float = 1.0) -> None:
        self._stats["offload:" + key] = self._stats.get("offload:" + key, 0.0) + value

    # -------------------------------------------------------------------- stores
    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        """Install the eviction hook on every group's block pool.

        Raises:
            ValueError: prefix caching is off (blocks have no hash, so nothing is offloaded).
        """
        if not kv_cache_manager.enable_caching:
            raise ValueError("OffloadingConnector needs prefix caching (its host store is keyed "
                             "by block hash): drop --no-enable-prefix-caching")
        kv_cache_manager.set_eviction_hook(self.on_evict)

    def on_evict(self, group: int, block_hash: BlockHash, block_id: int) -> None:
        """Eviction hook: remember the block; its copy is planned at the end of this schedule.

        A block id evicted twice in one schedule keeps only its first entry: its content is
        still the first hash's until this step runs (no step wrote the second hash's tokens)."""
        if self.mode == "drop" or (group, block_id) in self._evicted_ids:
            return
        self._evicted_ids.add((group, block_id))
        self._evicted.append((group, block_hash, block_id))

    def _plan_stores(self) -> list[BlockCopy]:
        """Host slots for this step's evicted blocks, by mode (see OffloadConfig)."""
        copies = []
        for group, block_hash, block_id in self._evicted:
            index = self.indexes[group]
            slot = index.slot_of(block_hash)
            if slot is not None:
                index.touch(block_hash)
                if self.mode == "reuse":
                    self._count("reuse_skips")
                    continue
                # save_on_evict: copy again into the slot of the same hash (same bytes).
            else:
                slot = index.allocate(block_hash)
                if slot is None:  # no slot (none configured, or all read by this step's loads)
                    self._count("store_skips")
                    continue
            copies.append(BlockCopy(group, block_id, slot))
        self._evicted = []
        self._evicted_ids = set()
        return copies

    # --------------------------------------------------------------------- loads
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens of the host-held blocks right after the local hits (whole blocks, never the
        last token), loaded synchronously; (0, False) in mode "drop" or on a miss."""
        n = self._num_host_blocks(request, num_computed_tokens)
        return (n * self.block_size, False) if n else (0, False)

    def _num_host_blocks(self, request: Request, num_computed_tokens: int) -> int:
        first = num_computed_tokens // self.block_size
        end = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        n = 0
        for i in range(first, end):
            if not all(request.block_hashes[i] in index for index in self.indexes):
                break
            n += 1
        return n

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the H2D copies of the loaded blocks into the request's first new blocks."""
        if num_external_tokens <= 0:
            return
        first = request.num_computed_tokens // self.block_size
        n = num_external_tokens // self.block_size
        new_ids = blocks.get_block_ids()
        for g, index in enumerate(self.indexes):
            for i in range(n):
                block_hash = request.block_hashes[first + i]
                slot = index.slot_of(block_hash)
                if slot is None:  # cannot happen: host evictions wait for build_connector_meta
                    raise RuntimeError(f"host block {i} of request {request.request_id} vanished")
                index.touch(block_hash)
                index.pin(slot)
                copy = BlockCopy(g, new_ids[g][i], slot)
                self._h2d.append(copy)
                self._pinned.append(copy)
        self._count("hits", n)
        self._count("recompute_tokens_avoided", num_external_tokens)

    # ---------------------------------------------------------------------- step
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadConnectorMetadata:
        meta = OffloadConnectorMetadata(d2h=self._plan_stores(), h2d=self._h2d)
        self._h2d = []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The step ran: its loads are done, their host slots may be reused."""
        for copy in self._pinned:
            self.indexes[copy.group].unpin(copy.slot)
        self._pinned = []

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, JSONObject | None]:
        # Copies finish within the step that plans them: nothing reads the blocks afterwards.
        return False, None

    def take_scheduler_stats(self) -> dict[str, float]:
        evictions = sum(index.num_evictions for index in self.indexes)
        if evictions > self._seen_host_evictions:
            self._count("host_evictions", evictions - self._seen_host_evictions)
            self._seen_host_evictions = evictions
        stats, self._stats = self._stats, {}
        return stats

    def has_pending_metadata(self) -> bool:
        return bool(self._evicted or self._h2d)
