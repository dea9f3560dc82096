"""The KV pool part of `pdkv up --pool`: the tier's spec with its stated defaults, the server it
needs (redis-server; mooncake_master plus its store process; `pdkv.launch.services` starts it),
and the engines' `--kv-transfer-config` (KVPoolConnector, kv_both).

Defaults: dram 1 GiB in each engine's process; disk 4 GiB under `$PDKV_CACHE/kvpool` (kept
across runs: hits survive a restart); redis: a redis-server without persistence; mooncake: a
master plus a store process mounting 1 GiB.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Protocol

from pdkv.model.registry import cache_dir

POOL_TIERS = ("dram", "disk", "redis", "mooncake")
DRAM_CAPACITY_BYTES = 1 << 30
DISK_CAPACITY_BYTES = 4 << 30
MOONCAKE_SEGMENT_BYTES = 1 << 30
DEFAULT_CHUNK_SIZE = 256


class PoolServer(Protocol):
    """What the launcher needs of a started server (`pdkv.launch.services.Service`)."""

    address: str

    @property
    def pids(self) -> list[int]: ...

    def alive(self) -> bool: ...

    def stop(self, timeout_s: float = 5.0) -> None: ...


def pool_tier_spec(tier: str, server: PoolServer | None) -> dict[str, str | int]:
    """The tier's spec for `kv_connector_extra_config["tiers"]` with the stated defaults.

    Raises:
        ValueError: unknown tier, or redis/mooncake without its server.
    """
    if tier == "dram":
        return {"name": "dram", "capacity_bytes": DRAM_CAPACITY_BYTES}
    if tier == "disk":
        return {"name": "disk", "path": os.path.join(cache_dir(), "kvpool"),
                "capacity_bytes": DISK_CAPACITY_BYTES}
    if tier not in ("redis", "mooncake"):
        raise ValueError(f"unknown pool tier {tier!r}; known: {', '.join(POOL_TIERS)}")
    if server is None:
        raise ValueError(f"the {tier} tier needs its server started first")
    if tier == "redis":
        return {"name": "redis", "url": server.address}
    return {"name": "mooncake", "master": server.address}


def pool_kv_transfer_config(spec: Mapping[str, str | int],
                            chunk_size: int = DEFAULT_CHUNK_SIZE) -> str:
    """`--kv-transfer-config` JSON of a kv_both KVPoolConnector with one tier."""
    return json.dumps({"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"chunk_size": chunk_size, "tiers": [spec]}})


def pd_kv_transfer_config(role: str, p2p_extra: Mapping[str, object], load_failure_policy: str,
                          pool_config: str | None = None) -> dict[str, object]:
    """`--kv-transfer-config` of a P/D engine (as a dict): a P2PConnector with `role`
    (kv_producer / kv_consumer) and `p2p_extra` as its kv_connector_extra_config; with a pool
    (`pool_config`, a KVPoolConnector's JSON) a MultiConnector: P = [P2P producer, pool
    producer] (P saves into the pool), D = [pool consumer, P2P consumer] (D loads from it
    first)."""
    cfg: dict[str, object] = {"kv_connector": "P2PConnector", "kv_role": role,
                              "kv_load_failure_policy": load_failure_policy,
                              "kv_connector_extra_config": dict(p2p_extra)}
    if pool_config is None:
        return cfg
    pool = dict(json.loads(pool_config), kv_role=role)
    children = [cfg, pool] if role == "kv_producer" else [pool, cfg]
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": children}}
