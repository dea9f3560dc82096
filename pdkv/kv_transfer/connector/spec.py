"""What one engine's KV connector is, parsed once from `--kv-transfer-config` at the top.

`connector_spec(config, block_size)` turns the user's `KVTransferConfig` (vLLM's fields, with a
free-form `kv_connector_extra_config` dict) into a frozen, typed `ConnectorSpec`: the connector's
name, role, engine id and load-failure policy, plus its own parsed settings (`P2PConfig`,
`PoolConnectorConfig`, `OffloadConfig`, or a MultiConnector's children). The engine builds it
once (a TP/DCP worker process builds it once from the copy it is sent); the factory and the
connectors receive only the spec, never the engine's configuration, so a bad setting is refused
before the model loads and every connector reads its settings from one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.offload_config import OffloadConfig
from pdkv.kv_transfer.connector.p2p_config import P2PConfig
from pdkv.kv_transfer.connector.pool_config import PoolConnectorConfig

CONNECTORS = ("P2PConnector", "KVPoolConnector", "MultiConnector", "OffloadingConnector")
"""The registered connector names (`kv_connector`)."""

POOL_CONNECTORS = ("KVPoolConnector",)
"""Connectors whose loads are best effort (default load-failure policy "recompute")."""

_CHILD_FIELDS = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy")


@dataclass(frozen=True)
class ConnectorSpec:
    """The settings every connector shares (a subclass per connector adds its own).

    Attributes:
        kv_connector: the connector's name (one of CONNECTORS).
        kv_role: "kv_producer", "kv_consumer" or "kv_both".
        engine_id: this engine's id in kv_transfer_params.
        load_failure_policy: the kv_load_failure_policy in force, "recompute" or "fail" (the
            configured one, else the connector's default: "recompute" for a KV pool connector (a
            pool never guarantees a hit, so a lost entry is recomputed), "fail" for P/D (vLLM's
            default for a decode engine).
    """

    kv_connector: str
    kv_role: str
    engine_id: str
    load_failure_policy: str

    @property
    def is_kv_producer(self) -> bool:
        """Saves or serves KV (kv_producer or kv_both)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """Loads KV (kv_consumer or kv_both)."""
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class P2PSpec(ConnectorSpec):
    """A P2PConnector (P/D): `p2p` holds its transfer and lease settings."""

    p2p: P2PConfig


@dataclass(frozen=True)
class PoolSpec(ConnectorSpec):
    """A KVPoolConnector: `pool` holds its chunk size, tiers and timeouts."""

    pool: PoolConnectorConfig


@dataclass(frozen=True)
class OffloadSpec(ConnectorSpec):
    """An OffloadingConnector (CPU offload; kv_role is always kv_both)."""

    offload: OffloadConfig


@dataclass(frozen=True)
class MultiSpec(ConnectorSpec):
    """A MultiConnector: its children in order (each with the parent's engine_id)."""

    children: tuple[ConnectorSpec, ...]


def connector_spec(config: KVTransferConfig, block_size: int) -> ConnectorSpec:
    """Parse `config` into the spec of its connector.

    Args:
        config: the engine's `--kv-transfer-config`.
        block_size: tokens per block of the scheduler (cache_config.block_size × the DCP
            size: `EngineConfig.scheduler_block_size`); a pool's chunk_size must be a multiple
            of it.

    Raises:
        ValueError: an unknown connector name, unknown or malformed settings (named), an
            OffloadingConnector whose kv_role is not kv_both, or a malformed MultiConnector
            child list (see `_children`).
    """
    name, extra = config.kv_connector, config.kv_connector_extra_config
    base = (name, config.kv_role, config.engine_id, _policy(config))
    if name == "P2PConnector":
        return P2PSpec(*base, p2p=P2PConfig.from_extra(extra))
    if name == "KVPoolConnector":
        return PoolSpec(*base, pool=PoolConnectorConfig.from_extra(extra, block_size))
    if name == "OffloadingConnector":
        if config.kv_role != "kv_both":
            raise ValueError(f"OffloadingConnector needs kv_role 'kv_both', got {config.kv_role!r}")
        return OffloadSpec(*base, offload=OffloadConfig.from_extra(extra))
    if name == "MultiConnector":
        return MultiSpec(*base, children=tuple(
            connector_spec(child, block_size) for child in _children(config)))
    raise ValueError(f"unknown kv_connector {name!r}; known: {CONNECTORS}")


def _policy(config: KVTransferConfig) -> str:
    """The policy in force (see ConnectorSpec.load_failure_policy)."""
    if config.kv_load_failure_policy:
        return config.kv_load_failure_policy
    return "recompute" if config.kv_connector in POOL_CONNECTORS else "fail"


def _children(config: KVTransferConfig) -> list[KVTransferConfig]:
    """A MultiConnector's children as configs of their own: a child's kv_role defaults to the
    parent's, its engine_id is the parent's.

    Raises:
        ValueError: no children, a child that is not an object, a nested MultiConnector, or an
            unknown field (named).
    """
    extra: Mapping[str, object] = config.kv_connector_extra_config
    specs = extra.get("connectors")
    if not isinstance(specs, list) or not specs or not all(isinstance(s, dict) for s in specs):
        raise ValueError(
            "MultiConnector needs kv_connector_extra_config.connectors: a non-empty "
            'list of connector configs such as {"kv_connector": "KVPoolConnector", ...}'
        )
    unknown = sorted(set(extra) - {"connectors"})
    if unknown:
        raise ValueError(f"unknown MultiConnector settings {unknown}; known: ['connectors']")
    out = []
    for spec in specs:
        bad = sorted(set(spec) - set(_CHILD_FIELDS))
        if bad:
            raise ValueError(
                f"unknown fields {bad} in a MultiConnector child; known: {sorted(_CHILD_FIELDS)}"
            )
        if spec.get("kv_connector") in (None, "MultiConnector"):
            raise ValueError(
                "each MultiConnector child needs a kv_connector other than MultiConnector"
            )
        out.append(
            KVTransferConfig(
                kv_connector=str(spec["kv_connector"]),
                kv_role=str(spec.get("kv_role", config.kv_role)),
                engine_id=config.engine_id,
                kv_connector_extra_config=dict(spec.get("kv_connector_extra_config") or {}),
                kv_load_failure_policy=str(spec.get("kv_load_failure_policy", "")),
            )
        )
    return out
