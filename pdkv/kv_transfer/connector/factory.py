"""Connectors by name (`kv_transfer_config.kv_connector`)."""

from __future__ import annotations

from typing import Any

from pdkv.cache.specs import KVCacheConfig
from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.base import KVConnectorBase, KVConnectorRole

CONNECTORS = ("P2PConnector", "KVPoolConnector", "MultiConnector", "OffloadingConnector")


def create_connector(config: KVTransferConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig,
                     layout: dict[str, Any], shared: dict[str, Any]) -> KVConnectorBase:
    """Build one half of the connector named in `config`.

    Args:
        shared: start-up values both halves of one engine see, by name: "control_address"
            (P2P: the producer's [host, port], filled in by the worker half), "control_endpoints"
            (P2P, multi-process engine: every rank's [host, port], set by the executor), "dcp_rank" and
            "dcp_size" (this worker's DCP rank and size, set by the model runner; default 0 / 1),
            "rank" and "world_size" (this worker's global rank and the engine's worker count; default
            dcp_rank / dcp_size) and "pool_store"
            (KVPoolConnector: the store, created by the worker half, which is built first).

    Raises:
        ValueError: unknown connector name, invalid connector settings, or a connector that
            cannot move one of the KV cache groups (sliding window: P2PConnector and
            KVPoolConnector only; linear state: P2PConnector and KVPoolConnector).
    """
    linear = [g.spec.kind for g in kv_cache_config.groups if g.spec.kind == "linear_state"]
    if linear and config.kv_connector not in ("P2PConnector", "KVPoolConnector"):
        raise ValueError(
            f"{config.kv_connector} does not move linear-attention state (Gated DeltaNet: one state "
            "slot per request) yet: only P2PConnector (P/D) and KVPoolConnector are supported on "
            "this model (issue 11); offloading and MultiConnector are not")
    if config.kv_connector not in ("P2PConnector", "KVPoolConnector") and any(w is not None for w in kv_cache_config.sliding_windows):
        raise ValueError(
            f"{config.kv_connector} does not move sliding-window KV cache groups yet (P2PConnector "
            "and KVPoolConnector do, issue 11): run this model without it or with one of those")
    if config.kv_connector == "P2PConnector":
        from pdkv.kv_transfer.connector.p2p import P2PConnector

        address = shared.setdefault("control_address", ["127.0.0.1", 0])
        dcp_rank, dcp_size = int(shared.get("dcp_rank", 0)), int(shared.get("dcp_size", 1))
        return P2PConnector(config, role, kv_cache_config, layout, address, dcp_rank, dcp_size,
                            int(shared.get("rank", dcp_rank)), int(shared.get("world_size", dcp_size)),
                            shared.get("control_endpoints"))
    if config.kv_connector == "KVPoolConnector":
        from pdkv.kv_transfer.connector.pool import KVPoolConnector

        return KVPoolConnector(config, role, kv_cache_config, layout, shared)
    if config.kv_connector == "MultiConnector":
        from pdkv.kv_transfer.connector.multi import MultiConnector

        return MultiConnector(config, role, kv_cache_config, layout, shared, create_connector)
    if config.kv_connector == "OffloadingConnector":
        from pdkv.kv_transfer.connector.offload import OffloadingConnector

        return OffloadingConnector(config, role, kv_cache_config, layout)
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {CONNECTORS}")
