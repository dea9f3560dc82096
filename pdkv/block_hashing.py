"""Reproducible, chained block hashes for prefix caching (torch-free, pure functions).

A full block's hash is

    H_i = sha256(msgpack([H_{i-1} or NONE_HASH, [token ids of block i], [extra keys]]))

as in vLLM's `hash_block_tokens` (vllm/v1/core/kv_cache_utils.py), but with a canonical msgpack
encoding and a fixed chain seed instead of pickle and a random `NONE_HASH`. The result depends
only on the token ids and extra keys, so it is identical across processes, restarts and machines
(the KV pool and P/D depend on that). Extra keys carry everything besides tokens that changes the
KV of a block: `cache_salt` (first block only, as in vLLM) and, later, adapter ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

BlockHash = bytes
"""32-byte sha256 digest of a block."""

ExtraKey = str | int | bytes

NONE_HASH: BlockHash = hashlib.sha256(b"pdkv.block_hash.v1").digest()
"""Chain seed: the parent hash of the first block."""

_encoder = msgspec.msgpack.Encoder()


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    block_token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
) -> BlockHash:
    """Hash one full block given its parent's hash.

    Args:
        parent_block_hash: hash of the previous block, None for the first block.
        block_token_ids: the block's token ids (exactly block_size of them).
        extra_keys: str/int/bytes values that also change the KV (e.g. cache_salt).

    Returns:
        32-byte sha256 digest.
    """
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    payload = _encoder.encode([parent, list(block_token_ids), list(extra_keys)])
    return hashlib.sha256(payload).digest()


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """Extra keys of block `block_index` of a request (the salt goes into the first block only,
    which, by chaining, changes every later hash too)."""
    if block_index == 0 and cache_salt:
        return ("salt", cache_salt)
    return ()


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent_block_hash: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` from block `start_block` on.

    Args:
        token_ids: all tokens of the request (prompt, then outputs).
        block_size: tokens per block.
        cache_salt: optional per-tenant salt (vLLM's `cache_salt`).
        parent_block_hash: hash of block `start_block - 1` (None when start_block == 0).
        start_block: index of the first block to hash.

    Returns:
        One hash per full block, in order; a trailing partial block is not hashed.
    """
    hashes: list[BlockHash] = []
    parent = parent_block_hash
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, block, block_extra_keys(i, cache_salt))
        hashes.append(parent)
    return hashes
