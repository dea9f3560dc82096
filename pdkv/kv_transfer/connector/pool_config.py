"""Typed settings of the KVPoolConnector (`kv_connector_extra_config`), parsed once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdkv.model.registry import cache_dir

_KNOWN = ("chunk_size", "tiers", "save_queue_size", "lookup_timeout_s", "load_timeout_s",
          "save_decode_tokens", "load_threads", "tier_retry_after_s")


@dataclass(frozen=True)
class PoolConnectorConfig:
    """KVPoolConnector settings.

    Attributes:
        chunk_size: tokens per pool entry, a multiple of the block size (LMCache's 256).
        tiers: tier specs, fastest first, each {"name": "dram" | "disk" | "redis" |
            "mooncake", ...} (see `pdkv.kvpool.tiers.factory.create_tier`).
        save_queue_size: chunks queued for the asynchronous writer; when full a save is
            skipped and counted (a step never waits for the pool).
        lookup_timeout_s: how long a request waits for a remote lookup before it is treated
            as a miss (s).
        load_timeout_s: deadline of one request's load from the pool (s); a load past it is a
            load error (handled by kv_load_failure_policy).
        save_decode_tokens: also store full chunks of generated tokens (default: prompt only).
        load_threads: threads that read chunks from the pool into blocks.
        tier_retry_after_s: how long a tier that failed as unavailable is skipped (s).
        default_dir: base directory of a disk tier without "path" ($PDKV_CACHE; the files go to
            $PDKV_CACHE/kvpool).
    """

    chunk_size: int = 256
    tiers: tuple[Mapping[str, Any], ...] = field(
        default_factory=lambda: ({"name": "dram", "capacity_bytes": 1 << 30},))
    save_queue_size: int = 32
    lookup_timeout_s: float = 5.0
    load_timeout_s: float = 30.0
    save_decode_tokens: bool = False
    load_threads: int = 2
    tier_retry_after_s: float = 1.0
    default_dir: str = ""

    @staticmethod
    def from_extra(extra: Mapping[str, Any], block_size: int) -> PoolConnectorConfig:
        """Parse and check `kv_connector_extra_config`.

        Raises:
            ValueError: unknown keys, a chunk size that is not a positive multiple of
                `block_size`, no tiers, or a bad number (the message names the key).
        """
        unknown = sorted(set(extra) - set(_KNOWN))
        if unknown:
            raise ValueError(f"unknown KVPoolConnector settings {unknown}; known: {sorted(_KNOWN)}")
        kw: dict[str, Any] = {}
        for key in ("chunk_size", "save_queue_size", "load_threads"):
            if key in extra:
                kw[key] = _number(extra, key, int, minimum=1)
        for key in ("lookup_timeout_s", "load_timeout_s", "tier_retry_after_s"):
            if key in extra:
                kw[key] = _number(extra, key, float, minimum=0.0)
        if "save_decode_tokens" in extra:
            kw["save_decode_tokens"] = bool(extra["save_decode_tokens"])
        if "tiers" in extra:
            tiers = extra["tiers"]
            if (
                not isinstance(tiers, list)
                or not tiers
                or not all(isinstance(t, dict) for t in tiers)
            ):
                raise ValueError("KVPoolConnector 'tiers' must be a non-empty list of objects "
                                 'such as {"name": "dram", "capacity_bytes": 1073741824}')
            kw["tiers"] = tuple(dict(t) for t in tiers)
        cfg = PoolConnectorConfig(**kw, default_dir=cache_dir())
        if cfg.chunk_size % block_size:
            raise ValueError(f"KVPoolConnector chunk_size {cfg.chunk_size} must be a multiple of "
                             f"the block size {block_size}")
        return cfg


def _number(extra: Mapping[str, Any], key: str, kind: type, minimum: float) -> Any:
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ValueError(f"KVPoolConnector {key} must be a number >= {minimum}, got {value!r}")
    if kind is int and int(value) != value:
        raise ValueError(f"KVPoolConnector {key} must be an integer, got {value!r}")
    return kind(value)
