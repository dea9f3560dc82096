"""Scheduler half of the KVPoolConnector (torch-free).

Lookups: a waiting request's loadable chunks (whole chunks before its last token) are looked up
in the pool, local prefix-cache hits included; the hit is the longest run of consecutive pool hits
from the first chunk not fully in the local prefix cache. With in-process tiers only (dram, disk)
the lookup runs inline; with a remote tier (redis, mooncake) it runs on a thread and
`get_num_new_matched_tokens` answers None ("ask again") until it is in, at most
`lookup_timeout_s` (then a miss). Loads: the hit chunks beyond the local prefix cache are loaded
asynchronously into the request's new blocks (one PoolLoadSpec). Saves: every step, each
scheduled request's chunks that became fully computed (prompt only unless save_decode_tokens) and
were not loaded from the pool are sent to the worker half, which copies them out after the
forward pass. A chunk the request's lookup found in the pool is not saved again (a repeat of a
prompt writes nothing); with a full local hit (nothing to load) or a producer-only role the
lookup runs only when it is inline (in-process tiers), so a remote tier is never waited for just
to skip a save. A chunk evicted between that lookup and the save stays missing: a later miss,
never a wrong hit. Sliding-window groups store and load only the blocks of each chunk's tail
window and of the hit's window (`pdkv.kvpool.window`).

An engine with TP/DCP worker processes: every rank stores and loads its own shard of each chunk
(the metadata names chunks by hash; each worker half keys them under its rank's namespace), and
a lookup asks every rank in one round (`pool_lookup.RankLookup`, always on the lookup thread): a
chunk is a hit only if every rank holds its shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdkv.jsontypes import JSONObject
from pdkv.kv_transfer.connector.base import KVConnectorOutput
from pdkv.kv_transfer.connector.pool_config import PoolConnectorConfig
from pdkv.kv_transfer.connector.pool_lookup import PoolLookup
from pdkv.kv_transfer.connector.pool_messages import (
    ChunkRef,
    PoolConnectorMetadata,
    PoolLoadSpec,
    PoolSaveSpec,
)
from pdkv.kvpool.keys import chunk_hashes, max_loadable_tokens
from pdkv.kvpool.window import first_stored_block, load_first_block

if TYPE_CHECKING:
    from pdkv.cache.kv_cache_manager import KVCacheBlocks
    from pdkv.kv_transfer.connector.spec import ConnectorSpec
    from pdkv.request import Request
    from pdkv.sched.output import SchedulerOutput


@dataclass
class _Lookup:
    first_chunk: int
    deadline: float
    future: Future[list[bool]] | None = None
    present: list[bool] | None = None  # per chunk from chunk 0, once the lookup is in
    hits: int | None = None


class PoolConnectorScheduler:
    """Args:
        spec: the connector (role: kv_producer saves only, kv_consumer loads only).
        pool: parsed KVPoolConnector settings.
        lookup: where lookups go (`pool_lookup`: this engine's store, or every TP/DCP rank's).
        block_size: tokens per block.
        num_groups: KV cache groups.
        sliding_windows: per group its sliding window in tokens or None (default: none).
    """

    def __init__(self, spec: ConnectorSpec, pool: PoolConnectorConfig, lookup: PoolLookup,
                 block_size: int, num_groups: int,
                 sliding_windows: tuple[int | None, ...] = ()) -> None:
        self.spec = spec
        self.pool = pool
        self.lookup = lookup
        self.block_size = block_size
        self.num_groups = num_groups
        self.chunk = pool.chunk_size
        self.blocks_per_chunk = pool.chunk_size // block_size
        self.windows = tuple(sliding_windows) or (None,) * num_groups
        # Per group, the first block of a chunk its pool value holds (window groups: the tail).
        self.stored_first = tuple(
            first_stored_block(self.chunk, block_size, w) for w in self.windows
        )
        self._requests: dict[str, Request] = {}
        self._tables: dict[str, list[list[int]]] = {}
        self._saved_chunks: dict[str, int] = {}
        self._held: dict[str, frozenset[int]] = {}  # chunks a lookup found: not saved again
        self._lookups: dict[str, _Lookup] = {}
        self._failed: set[str] = set()
        self._loading: set[str] = set()
        self._to_load: list[PoolLoadSpec] = []
        self._stats: dict[str, float] = {}
        self._wakeup: Callable[[], None] | None = None
        self._executor: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ helpers
    def _count(self, key: str, value: float) -> None:
        self._stats[key] = self._stats.get(key, 0.0) + value

    def _keys(self, request: Request, first_chunk: int, end_chunk: int) -> list[bytes]:
        """The hashes of chunks [first_chunk, end_chunk) of `request` (the pool keys' tails)."""
        hashes = chunk_hashes(
            request.block_hashes, self.block_size, self.chunk, end_chunk * self.chunk
        )
        return hashes[first_chunk:end_chunk]

    def _lookup(self, request: Request, first_chunk: int, keys: list[bytes]) -> int | None:
        """Leading hits among `keys[first_chunk:]` (chunk hashes from chunk 0), or None while a
        remote lookup is in flight."""
        rid = request.request_id
        entry = self._lookups.get(rid)
        if entry is None or entry.first_chunk != first_chunk:
            entry = _Lookup(first_chunk, time.monotonic() + self.pool.lookup_timeout_s)
            self._lookups[rid] = entry
            if self.lookup.all_local:
                entry.present = self.lookup.contains(keys)
            else:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(2, thread_name_prefix="pdkv-pool-lookup")
                entry.future = self._executor.submit(self.lookup.contains, keys)
                if self._wakeup is not None:
                    wake = self._wakeup
                    entry.future.add_done_callback(lambda _f: wake())
        if entry.present is None and entry.future is not None:
            if entry.future.done():
                try:
                    entry.present = entry.future.result()
                except Exception:  # the store counts tier failures; here it is a miss
                    entry.present = [False] * len(keys)
            elif time.monotonic() >= entry.deadline:
                self._count("pool:all:lookup_timeouts", 1)
                entry.present = [False] * len(keys)
            else:
                return None
        if entry.hits is None:
            assert entry.present is not None
            hits = 0
            for p in entry.present[first_chunk:]:
                if not p:
                    break
                hits += 1
            entry.hits = hits
        return entry.hits

    def _note_held(self, rid: str, present: list[bool]) -> None:
        self._held[rid] = frozenset(j for j, p in enumerate(present) if p)

    # ---------------------------------------------------------------- lifecycle
    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid in self._failed:
            return 0, False
        end_chunk = max_loadable_tokens(request.num_tokens, self.chunk) // self.chunk
        first_chunk = num_computed_tokens // self.chunk
        if not self.spec.is_kv_consumer or first_chunk >= end_chunk:
            # Nothing to load; an inline lookup still tells which chunks need no save.
            if self.spec.is_kv_producer and self.lookup.all_local and end_chunk > 0:
                self._note_held(rid, self.lookup.contains(self._keys(request, 0, end_chunk)))
            return 0, False
        keys = self._keys(request, 0, end_chunk)
        hits = self._lookup(request, first_chunk, keys)
        if hits is None:
            return None, False
        num_external = (first_chunk + hits) * self.chunk - num_computed_tokens
        return (num_external, True) if num_external > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        entry = self._lookups.pop(rid, None)
        if entry is not None and entry.present is not None:
            self._note_held(rid, entry.present)
        if entry is not None and entry.hits is not None:
            # Tokens the pool could have served beyond the local prefix cache, and those it did.
            asked = (
                max_loadable_tokens(request.num_tokens, self.chunk) - request.num_computed_tokens
            )
            self._count("pool:all:lookup_tokens", asked)
            self._count("pool:all:hit_tokens", num_external_tokens)
        if num_external_tokens <= 0:
            return
        start = request.num_computed_tokens  # local prefix hits, block-aligned
        end = start + num_external_tokens  # chunk-aligned
        first_block = start // self.block_size
        new_ids = blocks.get_block_ids()
        load_first = [load_first_block(start, end, self.block_size, w) for w in self.windows]
        first_chunk, end_chunk = start // self.chunk, end // self.chunk
        keys = self._keys(request, first_chunk, end_chunk)
        chunks = []
        for j, key in zip(range(first_chunk, end_chunk), keys):
            ids: list[tuple[int, ...]] = []
            firsts: list[int] = []
            for g, ids_g in enumerate(new_ids):
                lo = max(j * self.blocks_per_chunk, load_first[g])
                hi = (j + 1) * self.blocks_per_chunk
                if lo >= hi:  # a window group needs nothing of this chunk
                    ids.append(())
                    firsts.append(0)
                    continue
                offset = lo - j * self.blocks_per_chunk - self.stored_first[g]
                assert offset >= 0, "a loaded window block must lie in its chunk's stored tail"
                ids.append(tuple(ids_g[lo - first_block : hi - first_block]))
                firsts.append(offset)
            chunks.append(ChunkRef(key, tuple(ids), tuple(firsts)))
        self._to_load.append(PoolLoadSpec(rid, tuple(chunks), num_external_tokens))
        self._loading.add(rid)
        self._saved_chunks[rid] = max(self._saved_chunks.get(rid, 0), end_chunk)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PoolConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            self._tables[new.req_id] = [list(g) for g in new.block_ids]
        for cached in scheduler_output.scheduled_cached_reqs:
            table = self._tables.get(cached.req_id)
            if table is not None:
                for g, ids in zip(table, cached.new_block_ids):
                    g.extend(ids)
        saves = self._saves(scheduler_output) if self.spec.is_kv_producer else []
        meta = PoolConnectorMetadata(loads=self._to_load, saves=saves)
        self._to_load = []
        return meta

    def _saves(self, scheduler_output: SchedulerOutput) -> list[PoolSaveSpec]:
        saves = []
        for rid in scheduler_output.num_scheduled_tokens:
            request, table = self._requests.get(rid), self._tables.get(rid)
            if request is None or table is None:
                continue
            done = done_all = request.num_computed_tokens  # already advanced past this step
            if not self.pool.save_decode_tokens:
                done = min(done, request.num_prompt_tokens)
            end_chunk, start = done // self.chunk, self._saved_chunks.get(rid, 0)
            if end_chunk <= start:
                continue
            keys = self._keys(request, start, end_chunk)
            before = done_all - scheduler_output.num_scheduled_tokens[rid]
            held = self._held.get(rid, frozenset())
            skipped = sum(1 for j in range(start, end_chunk) if j in held)
            if skipped:
                self._count("pool:all:save_skips", skipped)
            refs = [(j, c) for j, key in zip(range(start, end_chunk), keys)
                    if j not in held and (c := self._save_ref(table, j, key, before)) is not None]
            if refs:
                saves.append(PoolSaveSpec(rid, tuple(c for _, c in refs)))
                if self.lookup.tier_events is not None:
                    self._describe(request, refs, end_chunk)
            self._saved_chunks[rid] = end_chunk
        return saves

    def _describe(self, request: Request, refs: list[tuple[int, ChunkRef]], end_chunk: int
                  ) -> None:
        """Give the KV events of these chunks their parent hash and tokens (events on only)."""
        events = self.lookup.tier_events
        assert events is not None
        hashes = chunk_hashes(request.block_hashes, self.block_size, self.chunk,
                              end_chunk * self.chunk)
        tokens = request.all_token_ids
        for j, ref in refs:
            events.describe(self.lookup.key(ref.chunk_hash), hashes[j - 1] if j else None,
                            tokens[j * self.chunk:(j + 1) * self.chunk])

    def _save_ref(self, table: list[list[int]], j: int, key: bytes, before: int) -> ChunkRef | None:
        """Chunk j's blocks to store (window groups: its tail window only), or None when a
        window group no longer holds them. `before` is the request's num_computed_tokens at this
        step's allocation, which freed every window-group block whose tokens all lie below
        before - W + 1 (`SlidingWindowManager.remove_skipped_blocks`); `table` still lists those
        ids, and local prefix hits put the null block (id 0) outside the window of the hit. A
        chunk computed in this step always qualifies (before < end_j); an older one (e.g. a
        local prefix hit being saved now) may not and is skipped."""
        ids = []
        for g, (ids_g, window) in enumerate(zip(table, self.windows)):
            lo = j * self.blocks_per_chunk + self.stored_first[g]
            if window is not None and lo < max(0, before - window + 1) // self.block_size:
                return None
            ids.append(tuple(ids_g[lo : (j + 1) * self.blocks_per_chunk]))
        return ChunkRef(key, tuple(ids))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        failed = set(output.load_errors)
        for rid in output.finished_recving:
            self._loading.discard(rid)
            if rid in failed:
                self._failed.add(rid)  # recomputed: never offered the same load again

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, JSONObject | None]:
        rid = request.request_id
        for table in (self._requests, self._tables, self._saved_chunks, self._lookups,
                      self._held):
            table.pop(rid, None)
        self._failed.discard(rid)
        # A load still writing into the blocks: free them only when it ends.
        return rid in self._loading, None

    def take_scheduler_stats(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        for key, value in self.lookup.take_stats().items():
            stats[key] = stats.get(key, 0.0) + value
        return stats

    def next_deadline(self) -> float | None:
        pending = [e.deadline for e in self._lookups.values() if e.hits is None]
        return min(pending) if pending else None

    def has_pending_metadata(self) -> bool:
        return bool(self._to_load)

    def has_pending_work(self) -> bool:
        return bool(self._to_load or self._loading)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self.lookup.close()
