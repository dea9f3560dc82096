"""Connectors by spec (`pdkv.kv_transfer.connector.spec`: one subclass per connector)."""

from __future__ import annotations

from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import KVCacheConfig
from pdkv.kv_transfer.connector.base import KVConnectorBase, KVConnectorRole
from pdkv.kv_transfer.connector.spec import (
    CONNECTORS,
    ConnectorSpec,
    MultiSpec,
    OffloadSpec,
    P2PSpec,
    PoolSpec,
)
from pdkv.kv_transfer.connector.startup import ConnectorStartup


def create_connector(
    spec: ConnectorSpec,
    role: KVConnectorRole,
    kv_cache_config: KVCacheConfig,
    layout: KVLayout,
    startup: ConnectorStartup,
) -> KVConnectorBase:
    """Build one half of the connector `spec` describes.

    Args:
        spec: the connector and its settings (`connector_spec`, parsed once per engine).
        layout: this engine's KV layout.
        startup: the start-up values both halves of one engine share (see ConnectorStartup;
            the worker half is built first and fills in what it binds).

    Raises:
        ValueError: a malformed layout or start-up value, or a connector that cannot move one
            of the KV cache groups (sliding window: P2PConnector and KVPoolConnector only;
            linear state: P2PConnector and KVPoolConnector).
    """
    linear = [g.spec.kind for g in kv_cache_config.groups if g.spec.state_slot]
    if linear and spec.kv_connector not in ("P2PConnector", "KVPoolConnector"):
        raise ValueError(
            f"{spec.kv_connector} does not move per-request state slots ({', '.join(linear)}: "
            "linear-attention state, DeepSeek-V4 compressor state) yet: only P2PConnector (P/D) "
            "and KVPoolConnector are supported on this model; offloading and MultiConnector are "
            "not"
        )
    if spec.kv_connector not in ("P2PConnector", "KVPoolConnector") and any(
        w is not None for w in kv_cache_config.sliding_windows
    ):
        raise ValueError(
            f"{spec.kv_connector} does not move sliding-window KV cache groups yet (P2PConnector "
            "does, and KVPoolConnector at tp 1 and dcp 1, issue 11): run this model without it "
            "or with one of those")
    if isinstance(spec, P2PSpec):
        from pdkv.kv_transfer.connector.p2p import P2PConnector

        if startup.control_address is None:
            startup.control_address = ["127.0.0.1", 0]
        if startup.push_address is None:
            startup.push_address = ["127.0.0.1", 0]
        return P2PConnector(spec, role, kv_cache_config, layout, startup.control_address,
                            startup.dcp_rank, startup.dcp_size, startup.rank, startup.world_size,
                            startup.control_endpoints, startup.push_address)
    if isinstance(spec, PoolSpec):
        from pdkv.kv_transfer.connector.pool import KVPoolConnector

        return KVPoolConnector(spec, role, kv_cache_config, layout, startup)
    if isinstance(spec, MultiSpec):
        from pdkv.kv_transfer.connector.multi import MultiConnector

        return MultiConnector(spec, role, kv_cache_config, layout, startup, create_connector)
    if isinstance(spec, OffloadSpec):
        from pdkv.kv_transfer.connector.offload import OffloadingConnector

        return OffloadingConnector(spec, role, kv_cache_config, layout, startup)
    raise ValueError(f"unknown kv_connector {spec.kv_connector!r}; known: {CONNECTORS}")
