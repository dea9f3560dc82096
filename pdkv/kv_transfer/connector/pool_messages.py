"""Typed scheduler → worker metadata of the KVPoolConnector (msgspec Structs)."""

from __future__ import annotations

import msgspec

from pdkv.kv_transfer.connector.base import KVConnectorMetadata


class ChunkRef(msgspec.Struct, frozen=True):
    """One pool chunk and the local blocks it maps to.

    Attributes:
        key: the pool key (`pdkv.kvpool.keys.chunk_key`).
        block_ids: per KV cache group, the local block ids of the chunk's blocks, in order.
        first_block: for a load, how many of the chunk's leading blocks are skipped (already
            in the local prefix cache); `block_ids` then map to blocks first_block.. of the chunk.
    """

    key: str
    block_ids: tuple[tuple[int, ...], ...]
    first_block: int = 0


class PoolLoadSpec(msgspec.Struct, frozen=True):
    """Load these chunks into a request's blocks (one asynchronous load per request)."""

    request_id: str
    chunks: tuple[ChunkRef, ...]
    num_tokens: int


class PoolSaveSpec(msgspec.Struct, frozen=True):
    """Copy these chunks out of the KV cache after this step's forward pass and store them."""

    request_id: str
    chunks: tuple[ChunkRef, ...]


class PoolConnectorMetadata(KVConnectorMetadata, kw_only=True):
    """One step's work for the worker half."""

    loads: list[PoolLoadSpec] = msgspec.field(default_factory=list)
    saves: list[PoolSaveSpec] = msgspec.field(default_factory=list)
