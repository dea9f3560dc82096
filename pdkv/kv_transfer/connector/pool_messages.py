"""Typed scheduler → worker metadata of the KVPoolConnector (msgspec Structs)."""

from __future__ import annotations

import msgspec

from pdkv.kv_transfer.connector.base import KVConnectorMetadata


class ChunkRef(msgspec.Struct, frozen=True):
    """One pool chunk and the local blocks it maps to.

    Attributes:
        chunk_hash: the chunk's hash (`pdkv.kvpool.keys.chunk_hashes`); the worker half keys it
            under its own namespace (`chunk_key`), so every TP/DCP rank stores and loads its own
            shard of the chunk from one metadata.
        block_ids: per KV cache group, the local block ids of the blocks the chunk's value holds
            (save) or that are loaded from it (load), in order. A sliding-window group's value
            holds only the chunk's blocks from `pdkv.kvpool.window.first_stored_block` on.
        first_blocks: for a load, per group, how many of the blocks stored in the value are
            skipped (in the local prefix cache, or outside the window a window group needs);
            `block_ids[g]` then map to stored blocks first_blocks[g].. (empty: all zero).
    """

    chunk_hash: bytes
    block_ids: tuple[tuple[int, ...], ...]
    first_blocks: tuple[int, ...] = ()


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
