"""Worker half of the KVPoolConnector: copies chunks between the paged KV cache and the pool.

Saves run on the engine thread right after the forward pass (`wait_for_save`): the chunk's
blocks are gathered (one copy, so the blocks may be reused at once), encoded with a checksum and
handed to the store's bounded queue; the store writes them to every tier on its own thread, and
a full queue skips the save (counted) instead of stalling the step. Loads run on `load_threads`
threads: each chunk is read (fastest tier first), verified, and copied into the request's
blocks, which nobody else reads until the scheduler resumes the request. A chunk that is missing
or corrupt ends the load there: its blocks and every later one are reported invalid with a load
error, and the scheduler keeps the chunks before it (kv_load_failure_policy, default recompute).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from pdkv.kv_transfer.connector.pool_config import PoolConnectorConfig
from pdkv.kv_transfer.connector.pool_messages import PoolConnectorMetadata, PoolLoadSpec
from pdkv.kvpool.codec import encode_chunk
from pdkv.kvpool.keys import chunk_key
from pdkv.kvpool.store import KVPoolStore

if TYPE_CHECKING:
    from pdkv.kv_transfer.connector.pool_lookup import PoolLookupServer
from pdkv.kvpool.window import first_stored_block


class PoolConnectorWorker:
    """Args:
        pool: parsed KVPoolConnector settings.
        store: the engine's pool store (shared with the scheduler half; closed here); in a TP/DCP
            worker process, this rank's own store.
        fingerprint: this worker's pool namespace fingerprint (with TP/DCP: its rank's); the
            metadata names chunks by hash, keys are `chunk_key(fingerprint, hash)`.
        block_size: tokens per block in the metadata's block ids (with DCP the logical block:
            block_size × DCP tokens, of which this rank's physical block holds its share).
        sliding_windows: per group its sliding window in tokens or None (default: none); a
            window group's pool value holds only each chunk's tail-window blocks.
    """

    def __init__(self, pool: PoolConnectorConfig, store: KVPoolStore, fingerprint: str,
                 block_size: int, sliding_windows: tuple[int | None, ...] = ()) -> None:
        self.pool = pool
        self.store = store
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.blocks_per_chunk = pool.chunk_size // block_size
        self.sliding_windows = tuple(sliding_windows)
        self._caches: list[torch.Tensor] = []  # per group [num_blocks, block_bytes] uint8 views
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._invalid: set[tuple[int, int]] = set()
        self._errors: dict[str, str] = {}
        self._request_bytes: dict[str, dict[str, float]] = {}
        self._stats: dict[str, float] = {}
        self._seen_store: dict[str, float] = {}
        self._wakeup: Callable[[], None] = lambda: None
        self._executor = ThreadPoolExecutor(pool.load_threads, thread_name_prefix="pdkv-pool-load")
        self._lookup_server: PoolLookupServer | None = None

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    def serve_lookups(self, host: str = "127.0.0.1") -> list[str | int]:
        """Answer the scheduler half's lookups for this rank (a TP/DCP worker process): start a
        `PoolLookupServer` over this store and namespace; its [host, port] (closed at shutdown)."""
        from pdkv.kv_transfer.connector.pool_lookup import PoolLookupServer

        if self._lookup_server is None:
            self._lookup_server = PoolLookupServer(self.store, self.fingerprint, host)
        return self._lookup_server.address

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Per-group caches [num_blocks, num_layers, 2, block_size, heads, head_size]; a block
        is one contiguous row of bytes (the cross-layer layout)."""
        if any(t.device.type != "cpu" for t in kv_caches):
            raise ValueError("KVPoolConnector supports a CPU KV cache only so far")
        self._caches = [t.view(torch.uint8).view(t.shape[0], -1) for t in kv_caches]

    @property
    def _chunk_group_bytes(self) -> list[int]:
        """Bytes per group in one pool value (window groups: the chunk's tail blocks only)."""
        windows = self.sliding_windows or (None,) * len(self._caches)
        return [
            c.shape[1]
            * (self.blocks_per_chunk - first_stored_block(self.pool.chunk_size, self.block_size, w))
            for c, w in zip(self._caches, windows)
        ]

    # -------------------------------------------------------------------- loads
    def start_load_kv(self, meta: PoolConnectorMetadata) -> None:
        for spec in meta.loads:
            deadline = time.monotonic() + self.pool.load_timeout_s
            self._executor.submit(self._load, spec, deadline)

    def _load(self, spec: PoolLoadSpec, deadline: float) -> None:
        error = ""
        failed_at = len(spec.chunks)
        nbytes = 0
        for i, chunk in enumerate(spec.chunks):
            try:
                if time.monotonic() > deadline:
                    error = f"pool load passed its deadline ({self.pool.load_timeout_s:g} s)"
                else:
                    key = chunk_key(self.fingerprint, chunk.chunk_hash)
                    payloads = self.store.get(key, self.pool.chunk_size, self._chunk_group_bytes)
                    if payloads is None:
                        error = f"pool entry {key} is gone (evicted, expired or corrupt)"
                    else:
                        for g, (ids, payload) in enumerate(zip(chunk.block_ids, payloads)):
                            first = chunk.first_blocks[g] if chunk.first_blocks else 0
                            src = _as_blocks(payload, self._caches[g].shape[1])[first:]
                            dst = self._caches[g]
                            for j, block_id in enumerate(
                                ids
                            ):  # row copies: faster than index_copy_ here
                                dst[block_id].copy_(src[j])
                            nbytes += len(ids) * self._caches[g].shape[1]
            except Exception as e:  # a broken tier or a bad value must not kill the loader
                error = f"pool load failed: {type(e).__name__}: {e}"
            if error:
                failed_at = i
                break
        with self._lock:
            if error:
                self._errors[spec.request_id] = error
                for chunk in spec.chunks[failed_at:]:
                    self._invalid.update(
                        (g, b) for g, ids in enumerate(chunk.block_ids) for b in ids
                    )
                self._stats["pool:all:load_failures"] = (
                    self._stats.get("pool:all:load_failures", 0.0) + 1
                )
            self._finished.add(spec.request_id)
            self._request_bytes[spec.request_id] = {"pool": float(nbytes)}
        self._wakeup()

    # -------------------------------------------------------------------- saves
    def wait_for_save(self, meta: PoolConnectorMetadata) -> None:
        """Copy out this step's full chunks and queue them (never waits for the pool)."""
        for spec in meta.saves:
            for chunk in spec.chunks:
                groups = [
                    self._caches[g].index_select(0, torch.tensor(ids, dtype=torch.long)).numpy()
                    for g, ids in enumerate(chunk.block_ids)
                ]
                key = chunk_key(self.fingerprint, chunk.chunk_hash)
                value = encode_chunk(key, self.pool.chunk_size, [a.data.cast("B") for a in groups])
                self.store.save(key, value)

    # ------------------------------------------------------------------ reports
    def get_finished(self) -> set[str]:
        with self._lock:
            done, self._finished = self._finished, set()
        return done

    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        with self._lock:
            bad, self._invalid = self._invalid, set()
        return bad

    def get_load_errors(self) -> dict[str, str]:
        with self._lock:
            errors, self._errors = self._errors, {}
        return errors

    def get_request_bytes(self) -> dict[str, dict[str, float]]:
        with self._lock:
            out, self._request_bytes = self._request_bytes, {}
        return out

    def get_stats(self) -> dict[str, float]:
        """Deltas since the last call of the store's cumulative counters (gauges included, so
        their running sum is the current value) and of this half's own counters."""
        with self._lock:
            out, self._stats = self._stats, {}
        for key, total in self.store.stats().items():
            delta = total - self._seen_store.get(key, 0.0)
            if delta or key not in self._seen_store:  # first report: zeros too (series at 0)
                out[key] = out.get(key, 0.0) + delta
                self._seen_store[key] = total
        return out

    def get_observations(self) -> dict[str, list[float]]:
        return self.store.take_observations()

    def shutdown(self) -> None:
        if self._lookup_server is not None:
            self._lookup_server.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.store.close()


# Pool values are immutable bytes; the views below are only read (copied into the KV cache).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def _as_blocks(payload: memoryview, block_bytes: int) -> torch.Tensor:
    """A chunk's group payload as [blocks, block_bytes] uint8 without a copy (read-only)."""
    return torch.frombuffer(payload, dtype=torch.uint8).view(-1, block_bytes)
