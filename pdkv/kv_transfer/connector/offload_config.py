"""Typed settings of the OffloadingConnector (`kv_connector_extra_config`), parsed once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdkv.cache.specs import KVCacheConfig

_KNOWN = ("cpu_bytes_to_use", "eviction_mode")
EVICTION_MODES = ("drop", "reuse", "save_on_evict")


@dataclass(frozen=True)
class OffloadConfig:
    """OffloadingConnector settings (vLLM's names where vLLM has one).

    Attributes:
        cpu_bytes_to_use: bytes of host memory for offloaded blocks, per engine (vLLM's
            `cpu_bytes_to_use` and its rule): with worker processes (TP / DCP) each rank keeps
            the host copies of its own shard of a block, and all ranks' host buffers together
            take at most this many bytes. Every KV cache group gets `num_host_slots` slots,
            the same number on every rank and in the scheduler half.
        eviction_mode: what happens to a cached block the engine evicts from its prefix cache
            (or a preempted request's blocks when they are reused):
            "drop": no host copy (the tokens are recomputed later); 0 copies.
            "reuse": copy it unless the host store already holds that block hash (then only its
            LRU position is refreshed): one copy per hash while it stays on the host.
            "save_on_evict": copy it at every eviction, the first and any later one of a hash
            that was loaded back and evicted again: one copy per eviction.
    """

    cpu_bytes_to_use: int = 1 << 30
    eviction_mode: str = "reuse"

    def num_host_slots(
        self, kv_cache_config: KVCacheConfig, world_size: int = 1, dcp_size: int = 1
    ) -> int:
        """Host blocks per group: cpu_bytes_to_use // (one rank's bytes of a block summed over
        groups × world_size), so that both halves of every rank agree.

        Args:
            kv_cache_config: a worker's own KV cache (blocks of block_size tokens, its KV heads),
                or the scheduler's logical view, whose blocks hold every DCP rank's share
                (pdkv.worker.kv_cache.scheduler_view): then pass `dcp_size`.
            world_size: worker ranks, each holding a host buffer of its shard.
            dcp_size: DCP ranks sharing one block of `kv_cache_config` (1 for a worker's own).

        Raises:
            ValueError: a block whose bytes `dcp_size` does not divide.
        """
        per_block = sum(kv_cache_config.block_bytes(g) for g in range(len(kv_cache_config.groups)))
        if per_block % dcp_size:
            raise ValueError(f"a block of {per_block} bytes is not split over {dcp_size} DCP ranks")
        return self.cpu_bytes_to_use // (per_block // dcp_size * world_size)

    @staticmethod
    def from_extra(extra: Mapping[str, Any]) -> OffloadConfig:
        """Parse and check `kv_connector_extra_config`.

        Raises:
            ValueError: unknown keys, a negative or non-integer byte count, or an unknown
                eviction mode (the message names the key and the allowed values).
        """
        unknown = sorted(set(extra) - set(_KNOWN))
        if unknown:
            raise ValueError(
                f"unknown OffloadingConnector settings {unknown}; known: {sorted(_KNOWN)}"
            )
        kw: dict[str, Any] = {}
        if "cpu_bytes_to_use" in extra:
            value = extra["cpu_bytes_to_use"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"OffloadingConnector cpu_bytes_to_use must be an integer >= 0, got {value!r}"
                )
            kw["cpu_bytes_to_use"] = value
        if "eviction_mode" in extra:
            mode = extra["eviction_mode"]
            if mode not in EVICTION_MODES:
                raise ValueError(
                    f"OffloadingConnector eviction_mode must be one of {EVICTION_MODES}, "
                    f"got {mode!r}"
                )
            kw["eviction_mode"] = mode
        return OffloadConfig(**kw)
