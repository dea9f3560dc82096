"""The KV cache event payload, laid out as vLLM's `KVEventBatch` (torch-free).

Source: vLLM `vllm/distributed/kv_events.py`, the array-like revision (before vLLM PR #42892,
which switched the events, not the batch, to msgpack maps in June 2026; vLLM v0.22 / v0.23 were
still array-like). In that revision every struct is `array_like=True, omit_defaults=True`, the
events are `tag=True` (the class name is the tag), and the fields are:

    KVEventBatch   [ts: float, events: list[event], data_parallel_rank: int | None = None]
    BlockStored    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                    lora_id, medium, lora_name]
    BlockRemoved   ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared ["AllBlocksCleared"]

pdkv matches exactly these fields. Later array-like revisions append defaulted fields
(BlockStored: extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window;
BlockRemoved: group_idx); msgspec fills absent trailing defaults with their default when it
decodes an array-like struct and ignores extra trailing elements, so consumers built on those
revisions, and on the older ones without `lora_name`, decode this payload too.

Block hashes: pdkv's prefix-cache hashes (`pdkv.block_hashing`, 32-byte sha256 digests), sent as
msgpack bin, i.e. the `bytes` form of vLLM's `ExternalBlockHash = bytes | int` (vLLM sends bytes
unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES turns them into ints). They are the same values the
KV cache manager, the KV pool's chunk keys and the router's prefix keys are built from, so a
consumer can match them against `hash_request_tokens` of a prompt.

Who published a batch is never inside the payload: the ZMQ topic frame carries the engine id and
a per-run epoch (`topic_frame` / `parse_topic_frame`).
"""

from __future__ import annotations

import msgspec

from pdkv.block_hashing import BlockHash

MEDIUM_GPU = "GPU"
"""vLLM's medium of an engine's own KV cache (its block pool emits this on every device; pdkv
does too, for the engine's KV cache on CPU or GPU)."""


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the prefix cache (tagged by class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks entered the prefix cache.

    Attributes:
        block_hashes: the blocks' hashes, in token order.
        parent_block_hash: hash of the block before the first one (None: it is block 0).
        token_ids: the blocks' tokens, len(block_hashes) * block_size of them.
        block_size: tokens per block (pdkv's logical block: block_size x DCP size).
        lora_id: adapter id (pdkv has none: None).
        medium: where the blocks live (MEDIUM_GPU: the engine's KV cache).
        lora_name: adapter name (None).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (popped for reuse or found invalid)."""

    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every hash of the prefix cache was dropped (reset_prefix_cache)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events.

    Attributes:
        ts: wall-clock time of the step (time.time(), seconds).
        events: in the order they happened.
        data_parallel_rank: the publisher's DP rank (pdkv: 0; vLLM's publisher fills it in too).
    """

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The payload frame."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Parse a payload frame.

    Raises:
        msgspec.DecodeError: not msgpack, or not a KVEventBatch (ValidationError is a subclass).
    """
    return _decoder.decode(payload)


TOPIC_SEPARATOR = "|"


def topic_frame(topic: str, engine_id: str, epoch: int) -> bytes:
    """The first frame of every published message: `<topic>|<engine id>|<epoch>`. A SUB socket
    subscribed to `topic` (ZMQ matches prefixes) receives it, as with vLLM's bare topic; vLLM's
    own consumers ignore this frame's content."""
    return f"{topic}{TOPIC_SEPARATOR}{engine_id}{TOPIC_SEPARATOR}{epoch}".encode()


def parse_topic_frame(frame: bytes) -> tuple[str, str, int]:
    """(topic, engine id, epoch) of a topic frame made by `topic_frame`.

    Raises:
        ValueError: not of that form.
    """
    parts = frame.decode().rsplit(TOPIC_SEPARATOR, 2)
    if len(parts) != 3 or not parts[1]:
        raise ValueError(f"not a pdkv KV event topic frame: {frame!r}")
    return parts[0], parts[1], int(parts[2])
