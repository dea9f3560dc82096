"""Pool tiers by name, from the connector's `tiers` config list (torch-free).

Specs (JSON objects in `kv_connector_extra_config["tiers"]`):

    {"name": "dram", "capacity_bytes": int}                  default 1 GiB
    {"name": "disk", "path": str, "capacity_bytes": int, "fsync": bool}
                                                             default 4 GiB under
                                                             f"{default_dir}/kvpool", fsync on
    {"name": "redis", "url": str, "ttl_s": float, "timeout_s": float}
    {"name": "mooncake", "master": "host:port", ...}         keys as MooncakeTier takes them

The redis and mooncake modules import their client libraries, so they are imported only when
such a tier is asked for.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pdkv.kvpool.tiers.base import Tier

GiB = 1 << 30
DEFAULT_DRAM_CAPACITY_BYTES = 1 * GiB
DEFAULT_DISK_CAPACITY_BYTES = 4 * GiB

_KNOWN_KEYS: dict[str, frozenset[str]] = {
    "dram": frozenset({"name", "capacity_bytes"}),
    "disk": frozenset({"name", "path", "capacity_bytes", "fsync"}),
    "redis": frozenset({"name", "url", "ttl_s", "timeout_s"}),
}
TIER_NAMES = ("dram", "disk", "redis", "mooncake")


def create_tier(spec: Mapping[str, Any], default_dir: str) -> Tier:
    """Build one tier from its spec.

    Args:
        spec: {"name": ..., tier-specific keys} (see the module docstring).
        default_dir: base directory for the disk tier's default path (e.g. $PDKV_CACHE).

    Raises:
        ValueError: unknown tier name, unknown keys (both named with the known ones), or a value
            of the wrong type.
    """
    name = spec.get("name")
    if name not in TIER_NAMES:
        raise ValueError(f"unknown pool tier {name!r}; known: {', '.join(TIER_NAMES)}")
    known = _KNOWN_KEYS.get(name)
    if known is not None:
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"unknown keys {unknown} for pool tier {name!r}; known: {sorted(known)}"
            )
    if name == "dram":
        from pdkv.kvpool.tiers.dram import DramTier

        return DramTier(_capacity(spec, DEFAULT_DRAM_CAPACITY_BYTES))
    if name == "disk":
        from pdkv.kvpool.tiers.disk import DiskTier

        path = spec.get("path", os.path.join(default_dir, "kvpool"))
        if not isinstance(path, str) or not path:
            raise ValueError(f"disk tier path must be a non-empty string, got {path!r}")
        fsync = spec.get("fsync", True)
        if not isinstance(fsync, bool):
            raise ValueError(f"disk tier fsync must be true or false, got {fsync!r}")
        return DiskTier(path, _capacity(spec, DEFAULT_DISK_CAPACITY_BYTES), fsync=fsync)
    if name == "redis":
        # Lazy: imports the redis client library.
        from pdkv.kvpool.tiers.redis import RedisTier

        url = spec.get("url")
        if not isinstance(url, str) or not url:
            raise ValueError(f"redis tier needs a url string, got {url!r}")
        ttl_s = spec.get("ttl_s")
        redis_tier: Tier = RedisTier(
            url,
            ttl_s=None if ttl_s is None else _number(spec, "ttl_s"),
            timeout_s=_number(spec, "timeout_s") if "timeout_s" in spec else 1.0,
        )
        return redis_tier
    # name == "mooncake". Lazy: imports the mooncake wheel. MooncakeTier validates its own keys
    # (a TypeError for an unknown keyword becomes a ValueError naming the spec).
    from pdkv.kvpool.tiers.mooncake import MooncakeTier

    kwargs = {k: v for k, v in spec.items() if k != "name"}
    try:
        mooncake_tier: Tier = MooncakeTier(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad mooncake tier spec {dict(spec)}: {e}") from e
    return mooncake_tier


def _capacity(spec: Mapping[str, Any], default: int) -> int:
    value = spec.get("capacity_bytes", default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{spec.get('name')} tier capacity_bytes must be a positive int, got {value!r}"
        )
    return value


def _number(spec: Mapping[str, Any], key: str) -> float:
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{spec.get('name')} tier {key} must be a positive number, got {value!r}")
    return float(value)
