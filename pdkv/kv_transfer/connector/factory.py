"""Connectors by name (`kv_transfer_config.kv_connector`)."""

from __future__ import annotations

from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import KVCacheConfig
from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.base import KVConnectorBase, KVConnectorRole
from pdkv.kv_transfer.connector.startup import ConnectorStartup

CONNECTORS = ("P2PConnector", "KVPoolConnector", "MultiConnector", "OffloadingConnector")


def create_connector(
    config: KVTransferConfig,
    role: KVConnectorRole,
    kv_cache_config: KVCacheConfig,
    layout: KVLayout,
    startup: ConnectorStartup,
) -> KVConnectorBase:
    """Build one half of the connector named in `config`.

    Args:
        layout: this engine's KV layout.
        startup: the start-up values both halves of one engine share (see ConnectorStartup;
            the worker half is built first and fills in what it binds).

    Raises:
        ValueError: unknown connector name, invalid connector settings, a malformed layout or
            start-up value, or a connector that cannot move one of the KV cache groups (sliding
            window: P2PConnector and KVPoolConnector only; linear state: P2PConnector and
            KVPoolConnector).
    """
    linear = [g.spec.kind for g in kv_cache_config.groups if g.spec.kind == "linear_state"]
    if linear and config.kv_connector not in ("P2PConnector", "KVPoolConnector"):
        raise ValueError(
            f"{config.kv_connector} does not move linear-attention state (Gated DeltaNet: one "
            "state slot per request) yet: only P2PConnector (P/D) and KVPoolConnector are "
            "supported on this model (issue 11); offloading and MultiConnector are not"
        )
    if config.kv_connector not in ("P2PConnector", "KVPoolConnector") and any(
        w is not None for w in kv_cache_config.sliding_windows
    ):
        raise ValueError(
            f"{config.kv_connector} does not move sliding-window KV cache groups yet (P2PConnector "
            "and KVPoolConnector do, issue 11): run this model without it or with one of those")
    if config.kv_connector not in CONNECTORS:
        raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {CONNECTORS}")
    lay = layout
    if config.kv_connector == "P2PConnector":
        from pdkv.kv_transfer.connector.p2p import P2PConnector

        if startup.control_address is None:
            startup.control_address = ["127.0.0.1", 0]
        return P2PConnector(config, role, kv_cache_config, lay, startup.control_address,
                            startup.dcp_rank, startup.dcp_size, startup.rank, startup.world_size,
                            startup.control_endpoints)
    if config.kv_connector == "KVPoolConnector":
        from pdkv.kv_transfer.connector.pool import KVPoolConnector

        return KVPoolConnector(config, role, kv_cache_config, lay, startup)
    if config.kv_connector == "MultiConnector":
        from pdkv.kv_transfer.connector.multi import MultiConnector

        return MultiConnector(config, role, kv_cache_config, lay, startup, create_connector)
    if config.kv_connector == "OffloadingConnector":
        from pdkv.kv_transfer.connector.offload import OffloadingConnector

        return OffloadingConnector(config, role, kv_cache_config, lay)
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {CONNECTORS}")
