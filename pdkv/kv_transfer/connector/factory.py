"""Connectors by name (`kv_transfer_config.kv_connector`)."""

from __future__ import annotations

from typing import Any

from pdkv.cache.specs import KVCacheConfig
from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.base import KVConnectorBase, KVConnectorRole

CONNECTORS = ("P2PConnector",)


def create_connector(config: KVTransferConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig,
                     layout: dict[str, Any], shared: list[Any]) -> KVConnectorBase:
    """Build one half of the connector named in `config`.

    Args:
        shared: start-up values both halves of one engine see (e.g. the control address).

    Raises:
        ValueError: unknown connector name.
    """
    if config.kv_connector == "P2PConnector":
        from pdkv.kv_transfer.connector.p2p import P2PConnector

        return P2PConnector(config, role, kv_cache_config, layout, shared)
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {CONNECTORS}")
