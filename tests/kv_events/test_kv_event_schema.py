"""The KV event payload against vLLM's array-like layout (vllm/distributed/kv_events.py, the
revision before vLLM PR #42892; pdkv/kv_events/schema.py says which fields): the bytes are built
here field by field from that layout, independently of pdkv's structs, and decoded both ways;
`--kv-events-config` parsing."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest

from pdkv.block_hashing import hash_request_tokens
from pdkv.kv_events.base import create_publisher
from pdkv.kv_events.config import KVEventsConfig
from pdkv.kv_events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    parse_topic_frame,
    topic_frame,
)

TS = 1796323801.5
H = hash_request_tokens(list(range(32)), 16)  # two chained 32-byte block hashes


def test_all_blocks_cleared_batch_bytes() -> None:
    """Literal msgpack: array(3) [float64 ts, array(1) [array(1) [str "AllBlocksCleared"]], 0]."""
    expected = (
        b"\x93" + b"\xcb" + struct.pack(">d", TS)
        + b"\x91" + b"\x91" + bytes([0xA0 | 16]) + b"AllBlocksCleared"
        + b"\x00"
    )
    batch = KVEventBatch(ts=TS, events=[AllBlocksCleared()], data_parallel_rank=0)
    assert encode_batch(batch) == expected
    assert decode_batch(expected) == batch


def test_block_events_follow_vllm_field_order() -> None:
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
    assert encode_batch(batch) == expected
    assert decode_batch(expected) == batch
    assert msgspec.msgpack.decode(encode_batch(batch)) == plain


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


def test_other_vllm_revisions_decode_the_payload() -> None:
    stored = BlockStored(block_hashes=list(H), parent_block_hash=None, token_ids=list(range(32)),
                         block_size=16, lora_id=None, medium="GPU", lora_name=None)
    payload = encode_batch(KVEventBatch(ts=TS, events=[stored], data_parallel_rank=0))
    later = msgspec.msgpack.decode(payload, type=_Batch).events[0]
    assert (later.block_hashes, later.group_idx, later.extra_keys) == (list(H), None, None)
    older = msgspec.msgpack.decode(payload, type=_OlderBatch).events[0]
    assert (older.block_hashes, older.token_ids, older.medium) == (list(H), list(range(32)), "GPU")


def test_malformed_payload_is_a_decode_error() -> None:
    for bad in (b"\xc1", msgspec.msgpack.encode([TS, [["NoSuchEvent"]], 0]),
                msgspec.msgpack.encode({"ts": TS, "events": []})):
        with pytest.raises(msgspec.DecodeError):
            decode_batch(bad)


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
