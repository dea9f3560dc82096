"""The KV event payload against vLLM's two layouts (vllm/distributed/kv_events.py;
pdkv/kv_events/schema.py says which fields): the map-encoded events of vLLM v0.26+ (after vLLM
PR #42892, the default) and the array-like ones of vLLM <= 0.25 (`event_encoding: "array"`).
The expected bytes / structures are built here field by field from those layouts, independently
of pdkv's structs, and decoded by structs typed like vLLM's; `--kv-events-config` parsing."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest

from pdkv.block_hashing import hash_request_tokens
from pdkv.kv_events.base import create_publisher
from pdkv.kv_events.config import KVEventsConfig
from pdkv.kv_events.schema import (
    EVENT_ENCODINGS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventEncoding,
    KVEventBatch,
    decode_batch,
    encode_batch,
    parse_topic_frame,
    topic_frame,
)

TS = 1796323801.5
H = hash_request_tokens(list(range(32)), 16)  # two chained 32-byte block hashes


def test_all_blocks_cleared_batch_bytes_array() -> None:
    """Literal msgpack: array(3) [float64 ts, array(1) [array(1) [str "AllBlocksCleared"]], 0]."""
    expected = (
        b"\x93" + b"\xcb" + struct.pack(">d", TS)
        + b"\x91" + b"\x91" + bytes([0xA0 | 16]) + b"AllBlocksCleared"
        + b"\x00"
    )
    batch = KVEventBatch(ts=TS, events=[AllBlocksCleared()], data_parallel_rank=0)
    assert encode_batch(batch, "array") == expected
    assert decode_batch(expected, "array") == batch


def test_block_events_follow_vllm_field_order_array() -> None:
    """BlockStored = [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    medium, lora_name]; BlockRemoved = [tag, block_hashes, medium]; hashes as msgpack bin."""
    stored = BlockStored(block_hashes=[H[1]], parent_block_hash=H[0], token_ids=list(range(16, 32)),
                         block_size=16, lora_id=None, medium="GPU", lora_name=None)
    removed = BlockRemoved(block_hashes=[H[0]], medium="GPU")
    plain: list[Any] = [
        TS,
        [
            ["BlockStored", [H[1]], H[0], list(range(16, 32)), 16, None, "GPU", None],
            ["BlockRemoved", [H[0]], "GPU"],
        ],
        0,
    ]
    expected = msgspec.msgpack.encode(plain)
    # The hash really goes out as bin 8 of 32 bytes (vLLM's ExternalBlockHash as bytes).
    assert b"\xc4\x20" + H[1] in expected
    batch = KVEventBatch(ts=TS, events=[stored, removed], data_parallel_rank=0)
    assert encode_batch(batch, "array") == expected
    assert decode_batch(expected, "array") == batch
    assert msgspec.msgpack.decode(encode_batch(batch, "array")) == plain
    # The batch always has its three elements (omit_defaults does not shorten an array-like
    # struct), in both encodings; the publisher sets the rank anyway.
    for encoding in EVENT_ENCODINGS:
        empty = encode_batch(KVEventBatch(ts=TS, events=[]), encoding)
        assert msgspec.msgpack.decode(empty) == [TS, [], None]


# A consumer of a later array-like vLLM revision: extra defaulted trailing fields (extra_keys,
# group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window), which pdkv does not send.
class _Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class _LaterBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


# ... and of an older one (no lora_name): trailing elements it does not know are ignored.
class _OlderBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_LaterBlockStored]
    data_parallel_rank: int | None = None


class _OlderBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_OlderBlockStored]
    data_parallel_rank: int | None = None


def test_other_vllm_revisions_decode_the_array_payload() -> None:
    stored = BlockStored(block_hashes=list(H), parent_block_hash=None, token_ids=list(range(32)),
                         block_size=16, lora_id=None, medium="GPU", lora_name=None)
    payload = encode_batch(KVEventBatch(ts=TS, events=[stored], data_parallel_rank=0), "array")
    later = msgspec.msgpack.decode(payload, type=_Batch).events[0]
    assert (later.block_hashes, later.group_idx, later.extra_keys) == (list(H), None, None)
    older = msgspec.msgpack.decode(payload, type=_OlderBatch).events[0]
    assert (older.block_hashes, older.token_ids, older.medium) == (list(H), list(range(32)), "GPU")


# --- the map encoding (vLLM v0.26+, PR #42892): the default --------------------------------

def stored_and_removed() -> KVEventBatch:
    stored = BlockStored(block_hashes=[H[1]], parent_block_hash=H[0], token_ids=list(range(16, 32)),
                         block_size=16, lora_id=None, medium="GPU", lora_name=None)
    removed = BlockRemoved(block_hashes=[H[0]], medium="GPU")
    return KVEventBatch(ts=TS, events=[stored, removed, AllBlocksCleared()], data_parallel_rank=0)


def test_all_blocks_cleared_batch_bytes_map() -> None:
    """Literal msgpack: array(3) [float64 ts, array(1) [map(1) {"type": "AllBlocksCleared"}], 0]."""
    expected = (
        b"\x93" + b"\xcb" + struct.pack(">d", TS)
        + b"\x91" + b"\x81" + bytes([0xA0 | 4]) + b"type" + bytes([0xA0 | 16]) + b"AllBlocksCleared"
        + b"\x00"
    )
    batch = KVEventBatch(ts=TS, events=[AllBlocksCleared()], data_parallel_rank=0)
    assert encode_batch(batch) == expected  # the default encoding is "map"
    assert encode_batch(batch, "map") == expected
    assert decode_batch(expected) == batch


def test_map_batch_is_vllm_map_layout() -> None:
    """The batch stays positional; each event is a map: the tag under "type", then every field
    that has no default in vLLM's struct (None included); vLLM's defaulted fields (extra_keys,
    group_idx, kv_cache_spec_*) are absent, as vLLM's omit_defaults leaves them while None."""
    stored: dict[str, Any] = {}
    stored["type"] = "BlockStored"
    stored["block_hashes"] = [H[1]]
    stored["parent_block_hash"] = H[0]
    stored["token_ids"] = list(range(16, 32))
    stored["block_size"] = 16
    stored["lora_id"] = None
    stored["medium"] = "GPU"
    stored["lora_name"] = None
    removed: dict[str, Any] = {}
    removed["type"] = "BlockRemoved"
    removed["block_hashes"] = [H[0]]
    removed["medium"] = "GPU"
    cleared = {"type": "AllBlocksCleared"}
    payload = encode_batch(stored_and_removed())
    plain = msgspec.msgpack.decode(payload)
    assert plain == [TS, [stored, removed, cleared], 0]
    # Keys in vLLM's declaration order, tag first (order is not part of the contract, but it is
    # what vLLM's encoder produces, so the bytes can match too).
    assert [list(e) for e in plain[1]] == [list(stored), list(removed), list(cleared)]
    assert payload == msgspec.msgpack.encode([TS, [stored, removed, cleared], 0])
    assert b"\xc4\x20" + H[1] in payload  # hashes as bin 8 of 32 bytes
    assert decode_batch(payload) == stored_and_removed()


# A consumer typed like current vLLM (map-era structs: no array_like on the events, tag=True
# with msgspec's default tag field, omit_defaults; the batch still array-like).
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared]
    data_parallel_rank: int | None = None


def test_current_vllm_decoder_reads_the_map_payload() -> None:
    got = msgspec.msgpack.decode(encode_batch(stored_and_removed()), type=_MapBatch)
    assert (got.ts, got.data_parallel_rank) == (TS, 0)
    stored, removed, cleared = got.events
    assert isinstance(stored, _MapBlockStored) and isinstance(removed, _MapBlockRemoved)
    assert isinstance(cleared, _MapAllBlocksCleared)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size,
            stored.lora_id, stored.medium, stored.lora_name) == (
        [H[1]], H[0], list(range(16, 32)), 16, None, "GPU", None)
    assert (stored.extra_keys, stored.group_idx, stored.kv_cache_spec_kind,
            stored.kv_cache_spec_sliding_window) == (None, None, None, None)
    assert (removed.block_hashes, removed.medium, removed.group_idx) == ([H[0]], "GPU", None)
    # ... and is why "map" is the default: current vLLM's decoder cannot read the array form,
    # nor the older array-like decoders the map form.
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(encode_batch(stored_and_removed(), "array"), type=_MapBatch)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(encode_batch(stored_and_removed(), "map"), type=_Batch)


def test_map_payload_of_vllm_with_its_extra_fields_decodes() -> None:
    """What vLLM itself sends (group_idx, kv_cache_spec_kind set) decodes with pdkv's structs:
    unknown keys are ignored."""
    sent = _MapBatch(ts=TS, data_parallel_rank=0, events=[_MapBlockStored(
        block_hashes=[H[0]], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
        lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0,
        kv_cache_spec_kind="full_attention")])
    got = decode_batch(msgspec.msgpack.encode(sent))
    assert got.events == [BlockStored(block_hashes=[H[0]], parent_block_hash=None,
                                      token_ids=list(range(16)), block_size=16, lora_id=None,
                                      medium="GPU", lora_name=None)]


@pytest.mark.parametrize("encoding", EVENT_ENCODINGS)
def test_malformed_payload_is_a_decode_error(encoding: EventEncoding) -> None:
    for bad in (b"\xc1", msgspec.msgpack.encode([TS, [["NoSuchEvent"]], 0]),
                msgspec.msgpack.encode([TS, [{"type": "NoSuchEvent"}], 0]),
                msgspec.msgpack.encode({"ts": TS, "events": []})):
        with pytest.raises(msgspec.DecodeError):
            decode_batch(bad, encoding)


def test_unknown_encoding_is_an_error() -> None:
    batch = KVEventBatch(ts=TS, events=[])
    with pytest.raises(ValueError, match="event_encoding"):
        encode_batch(batch, "json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="event_encoding"):
        decode_batch(encode_batch(batch), "json")  # type: ignore[arg-type]


def test_topic_frame_round_trip() -> None:
    frame = topic_frame("kv|events", "engine-1", 1796323800692)
    assert frame.startswith(b"kv|events")  # a SUB on the bare topic still matches
    assert parse_topic_frame(frame) == ("kv|events", "engine-1", 1796323800692)
    with pytest.raises(ValueError):
        parse_topic_frame(b"kv-events")


def test_config_defaults_off_and_loopback() -> None:
    c = KVEventsConfig()
    assert (c.enable_kv_cache_events, c.publisher, c.active) == (False, "null", False)
    assert c.endpoint == "tcp://127.0.0.1:5557" and c.replay_endpoint is None
    assert create_publisher(c, "e") is None
    on = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert (on.publisher, on.active, on.topic) == ("zmq", True, "kv-events")
    assert on.buffer_steps == 10_000
    assert c.event_encoding == on.event_encoding == "map"  # current vLLM's (v0.26+)
    assert KVEventsConfig.from_json('{"event_encoding": "array"}').event_encoding == "array"
    # vLLM's explicit null publisher records nothing even with events enabled.
    assert not KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "null"}').active


@pytest.mark.parametrize("text, named", [
    ("{", "not valid JSON"),
    ("[]", "JSON object"),
    ('{"enable_kv_cache_events": true, "endpoints": "x"}', "endpoints"),
    ('{"publisher": "kafka"}', "publisher"),
    ('{"buffer_steps": 0}', "buffer_steps"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ('{"enable_kv_cache_events": true, "event_encoding": "positional"}', "event_encoding"),
    ('{"event_encoding": null}', "event_encoding"),
])
def test_config_errors_name_the_field(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        KVEventsConfig.from_json(text)


def test_cli_flag_reaches_engine_args() -> None:
    """`--kv-events-config JSON` is an engine flag (pdkv serve parses it with EngineArgs)."""
    from pdkv.cli_parser import PdkvArgumentParser
    from pdkv.engine.arg_utils import EngineArgs

    text = '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://127.0.0.1:5558"}'
    args = EngineArgs.add_cli_args(PdkvArgumentParser()).parse_args(["--kv-events-config", text])
    assert EngineArgs.from_cli_args(args).kv_events_config == text
    assert EngineArgs().kv_events_config is None  # off by default
