"""The KV cache event payload, laid out as vLLM's `KVEventBatch` (torch-free), in either of the
two encodings vLLM has used (`KVEventsConfig.event_encoding`).

Source: vLLM `vllm/distributed/kv_events.py`. The batch is a positional msgpack array in every
vLLM version, `[ts, events, data_parallel_rank]` (`array_like=True`; msgspec's omit_defaults
does not shorten an array-like struct, so a None rank is sent as nil). The events differ by
vLLM version:

- "map" (default; vLLM v0.26 and later): vLLM PR #42892 (merged 2026-06-09) removed
  `array_like=True` from the event structs only, so each event is a msgpack map keyed by field
  name. The structs keep `tag=True` with msgspec's default tag field, so the class name sits
  under the key "type", and `omit_defaults=True`, so a field that has a default is left out
  while it holds it; fields without a default are always there, None or not:

      BlockStored      {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                        "block_size", "lora_id", "medium", "lora_name"}
      BlockRemoved     {"type": "BlockRemoved", "block_hashes", "medium"}
      AllBlocksCleared {"type": "AllBlocksCleared"}

  vLLM's map-era BlockStored also has the defaulted fields extra_keys, group_idx,
  kv_cache_spec_kind and kv_cache_spec_sliding_window (BlockRemoved: group_idx); pdkv never sets
  them, and a decoder typed like vLLM's structs fills them with their default (None) when the
  key is absent, which is what vLLM itself sends while they hold None. Observed on the wire of
  vLLM v0.26 in volcano-sh/kthena issue #1535; consumers that read both encodings:
  llm-d-kv-cache >= v0.9.0 (llm-d/llm-d-kv-cache PR #661), Dynamo's kv-router.
- "array" (vLLM 0.25 and earlier, and consumers that only read positional events): every event
  struct is `array_like=True, omit_defaults=True, tag=True`, the tag (class name) first:

      BlockStored      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                        lora_id, medium, lora_name]
      BlockRemoved     ["BlockRemoved", block_hashes, medium]
      AllBlocksCleared ["AllBlocksCleared"]

  Later array-like revisions append the same defaulted fields; msgspec fills absent trailing
  defaults when it decodes an array-like struct and ignores extra trailing elements, so
  decoders of those revisions, and of the older ones without `lora_name`, read this too.

The structs below (what the block pool records) are the map-era ones; the array form is made
from them when a batch is encoded (`encode_batch(batch, "array")`).

Block hashes: pdkv's prefix-cache hashes (`pdkv.block_hashing`, 32-byte sha256 digests), sent as
msgpack bin, i.e. the `bytes` form of vLLM's `ExternalBlockHash = bytes | int` (vLLM sends bytes
unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES turns them into ints). They are the same values the
KV cache manager, the KV pool's chunk keys and the router's prefix keys are built from, so a
consumer can match them against `hash_request_tokens` of a prompt.

Who published a batch is never inside the payload: the ZMQ topic frame carries the engine id and
a per-run epoch (`topic_frame` / `parse_topic_frame`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from pdkv.block_hashing import BlockHash

EventEncoding = Literal["map", "array"]
EVENT_ENCODINGS: tuple[EventEncoding, ...] = ("map", "array")
"""`KVEventsConfig.event_encoding`: "map" (vLLM >= 0.26, the default) or "array" (<= 0.25)."""

MEDIUM_GPU = "GPU"
"""vLLM's medium of an engine's own KV cache (its block pool emits this on every device; pdkv
does too, for the engine's KV cache on CPU or GPU)."""

TAG_FIELD = "type"
"""Key of the event's tag in the map encoding (msgspec's default tag field, which vLLM keeps)."""


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, tag_field=TAG_FIELD):
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


# The array encoding: the same fields, positional (vLLM <= 0.25). Private: the block pool and
# every caller use the structs above; these exist only between encode/decode and the bytes.
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


_ArrayEventT = _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_ArrayEventT]
    data_parallel_rank: int | None = None


_TO_ARRAY: dict[type[KVCacheEvent], type[_ArrayEvent]] = {
    BlockStored: _ArrayBlockStored, BlockRemoved: _ArrayBlockRemoved,
    AllBlocksCleared: _ArrayAllBlocksCleared}
_FROM_ARRAY: dict[type[_ArrayEvent], type[KVCacheEvent]] = {v: k for k, v in _TO_ARRAY.items()}

_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_array_decoder = msgspec.msgpack.Decoder(_ArrayBatch)


def _check(encoding: str) -> None:
    if encoding not in EVENT_ENCODINGS:
        raise ValueError(f"event_encoding must be one of {EVENT_ENCODINGS}, got {encoding!r}")


def encode_batch(batch: KVEventBatch, encoding: EventEncoding = "map") -> bytes:
    """The payload frame, events as maps ("map") or positional arrays ("array").

    Raises:
        ValueError: unknown encoding.
    """
    _check(encoding)
    if encoding == "map":
        return _encoder.encode(batch)
    # Same fields in the same order: each event is rebuilt as its array-like twin.
    events: list[Any] = [_TO_ARRAY[type(e)](*msgspec.structs.astuple(e)) for e in batch.events]
    return _encoder.encode(_ArrayBatch(batch.ts, events, batch.data_parallel_rank))


def decode_batch(payload: bytes, encoding: EventEncoding = "map") -> KVEventBatch:
    """Parse a payload frame made with `encoding`.

    Raises:
        ValueError: unknown encoding.
        msgspec.DecodeError: not msgpack, or not a KVEventBatch in that encoding
            (ValidationError is a subclass).
    """
    _check(encoding)
    if encoding == "map":
        return _map_decoder.decode(payload)
    raw = _array_decoder.decode(payload)
    events: list[Any] = [_FROM_ARRAY[type(e)](*msgspec.structs.astuple(e)) for e in raw.events]
    return KVEventBatch(raw.ts, events, raw.data_parallel_rank)


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
