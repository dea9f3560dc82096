"""Worker half of the OffloadingConnector: the host buffer and the copies.

Host buffer: per KV cache group one tensor [num_host_slots, block_bytes] of bytes, separate
from the engine's paged KV cache (a block is one contiguous row in both, the cross-layer
layout). Each step's copies run in `start_load_kv`, before the forward pass: first every D2H
(blocks evicted while the step was scheduled: they still hold the evicted content, and this
step's loads or forward pass may overwrite them), then every H2D (host hits into the requests'
new blocks). On CPU the copies run synchronously on the engine thread, so they are complete
before the forward pass writes anything; the time they take is the wait the step is exposed to
(`exposed_wait_seconds`). Device caches are not supported yet (`register_kv_caches` refuses a
KV cache that is not on the CPU): a GPU version would run the same plan on a copy stream ordered
by events, so that only the event wait is exposed; that is not written.

Counters: "offload:<name>" (bytes, copies, queue depth, exposed wait); in an engine with worker
processes the engine adds every rank's values up, so the worker half of rank r also reports
each one as "offload:rank<r>:<name>" (per-rank series).
"""

from __future__ import annotations

import time

import torch

from pdkv.kv_transfer.connector.offload_messages import BlockCopy, OffloadConnectorMetadata


class OffloadConnectorWorker:
    """Args:
        num_host_slots: host blocks per group.
        rank: this worker's global rank in an engine with worker processes (its counters are
            reported per rank too), None in a single-process engine.
    """

    def __init__(self, num_host_slots: int, rank: int | None = None) -> None:
        self.num_host_slots = num_host_slots
        self._rank_prefix = f"offload:rank{rank}:" if rank is not None else None
        self._device: list[torch.Tensor] = []  # per group [num_blocks, block_bytes] uint8 views
        self.host: list[torch.Tensor] = []  # per group [num_host_slots, block_bytes] uint8
        self._stats: dict[str, float] = {}
        self._last_queue_depth = 0

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Per-group caches [num_blocks, num_layers, 2, block_size, heads, head_size]; allocates
        the host buffer with the same bytes per block.

        Raises:
            ValueError: a cache that is not on the CPU (device copies are not written yet).
        """
        if any(t.device.type != "cpu" for t in kv_caches):
            raise ValueError("OffloadingConnector supports a CPU KV cache only so far")
        self._device = [t.view(torch.uint8).view(t.shape[0], -1) for t in kv_caches]
        self.host = [
            torch.empty((self.num_host_slots, d.shape[1]), dtype=torch.uint8) for d in self._device
        ]

    def _count(self, key: str, value: float) -> None:
        for prefix in ("offload:", self._rank_prefix):
            if prefix is not None:
                self._stats[prefix + key] = self._stats.get(prefix + key, 0.0) + value

    def start_load_kv(self, meta: OffloadConnectorMetadata) -> None:
        """Run this step's copies: D2H first, then H2D (see the module docstring)."""
        depth = len(meta.d2h) + len(meta.h2d)
        # queue_depth is a gauge: report the change, so the running sum is the current value.
        if depth != self._last_queue_depth:
            self._count("queue_depth", depth - self._last_queue_depth)
            self._last_queue_depth = depth
        if not depth:
            return
        t0 = time.perf_counter()
        nbytes = self._copy(meta.d2h, to_host=True)
        self._count("copies_d2h", len(meta.d2h))
        self._count("bytes_d2h", nbytes)
        nbytes = self._copy(meta.h2d, to_host=False)
        self._count("copies_h2d", len(meta.h2d))
        self._count("bytes_h2d", nbytes)
        self._count("exposed_wait_seconds", time.perf_counter() - t0)

    def _copy(self, copies: list[BlockCopy], to_host: bool) -> int:
        """Copy block rows one by one (a row is contiguous: one memcpy each, about 20x faster
        on CPU than a uint8 index_select + index_copy_ through a temporary); returns the bytes
        moved."""
        nbytes = 0
        for c in copies:
            dev, host = self._device[c.group][c.block_id], self.host[c.group][c.slot]
            if to_host:
                host.copy_(dev)
            else:
                dev.copy_(host)
            nbytes += dev.numel()
        return nbytes

    def get_stats(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        return stats
