"""Typed scheduler → worker metadata of the OffloadingConnector (msgspec Structs)."""

from __future__ import annotations

import msgspec

from pdkv.kv_transfer.connector.base import KVConnectorMetadata


class BlockCopy(msgspec.Struct, frozen=True):
    """One block copy between the engine's KV cache and the host store.

    Attributes:
        group: KV cache group index.
        block_id: block id in that group's KV cache.
        slot: slot in that group's host buffer.
    """

    group: int
    block_id: int
    slot: int


class OffloadConnectorMetadata(KVConnectorMetadata, kw_only=True):
    """One step's copies, run by the worker half before the forward pass, in this order:
    every D2H (blocks evicted during this step's scheduling, still holding their old content),
    then every H2D (host hits into the requests' new blocks, which may be those same blocks)."""

    d2h: list[BlockCopy] = msgspec.field(default_factory=list)
    h2d: list[BlockCopy] = msgspec.field(default_factory=list)
