"""Pool value codec: round trip, and every kind of damage raises CorruptChunk."""

from __future__ import annotations

import struct

import msgspec
import pytest
import xxhash

from pdkv.kvpool.codec import MAGIC, ChunkHeader, CorruptChunk, decode_chunk, encode_chunk

KEY = "pdkv:" + "0" * 32 + ":" + "ab" * 32
G0 = bytes(range(256)) * 3
G1 = b"\x7f" * 100


def _value() -> bytes:
    return encode_chunk(KEY, 16, [G0, memoryview(bytearray(G1))])


def test_round_trip() -> None:
    out = decode_chunk(_value(), KEY, 16, [len(G0), len(G1)])
    assert [bytes(g) for g in out] == [G0, G1]
    assert isinstance(out[0], memoryview)


def test_round_trip_empty_group_and_numpy_like_buffer() -> None:
    import array

    a = array.array("f", [1.0, 2.0, 3.0])
    v = encode_chunk(KEY, 4, [a, b""])
    out = decode_chunk(v, KEY, 4, [12, 0])
    assert bytes(out[0]) == a.tobytes() and bytes(out[1]) == b""


def _flip(value: bytes, index: int) -> bytes:
    b = bytearray(value)
    b[index] ^= 0x01
    return bytes(b)


def _with_header(**fields: object) -> bytes:
    header = {"version": 1, "key": KEY, "num_tokens": 16, "group_lengths": [len(G0), len(G1)],
              "checksum": xxhash.xxh3_64_intdigest(G0 + G1), **fields}
    raw = msgspec.msgpack.encode(header)
    return MAGIC + struct.pack("<I", len(raw)) + raw + G0 + G1


def test_hand_built_value_matches_format() -> None:
    assert _with_header() == _value()
    assert msgspec.msgpack.decode(_value()[8:8 + struct.unpack("<I", _value()[4:8])[0]],
                                  type=ChunkHeader).version == 1


@pytest.mark.parametrize("damage,expect", [
    (lambda v: _flip(v, len(v) - 1), "checksum"),
    (lambda v: _flip(v, len(v) - len(G1) - 5), "checksum"),
    (lambda v: v[:-1], "payload"),
    (lambda v: v[:20], "truncated header"),
    (lambda v: v[:6], "bad magic"),
    (lambda v: b"", "bad magic"),
    (lambda v: v + b"\x00", "payload"),
    (lambda v: b"XDKV" + v[4:], "bad magic"),
    (lambda v: v[:4] + struct.pack("<I", 3) + v[8:], "header"),
    (lambda v: _with_header(version=2), "version"),
    (lambda v: _with_header(key="pdkv:other"), "key"),
    (lambda v: _with_header(num_tokens=15), "num_tokens"),
    (lambda v: _with_header(group_lengths=[len(G1), len(G0)]), "group_lengths"),
    (lambda v: _with_header(checksum="x"), "undecodable"),
])
def test_corruption_raises(damage, expect: str) -> None:
    with pytest.raises(CorruptChunk, match=expect):
        decode_chunk(damage(_value()), KEY, 16, [len(G0), len(G1)])


@pytest.mark.parametrize("key,tokens,lengths,expect", [
    ("pdkv:wrong", 16, [len(G0), len(G1)], "key"),
    (KEY, 32, [len(G0), len(G1)], "num_tokens"),
    (KEY, 16, [len(G0), len(G1) + 1], "group_lengths"),
    (KEY, 16, [len(G0) + len(G1)], "group_lengths"),
])
def test_reader_expectation_mismatch_raises(key: str, tokens: int, lengths: list[int],
                                            expect: str) -> None:
    with pytest.raises(CorruptChunk, match=expect):
        decode_chunk(_value(), key, tokens, lengths)


def test_corrupt_chunk_is_value_error() -> None:
    assert issubclass(CorruptChunk, ValueError)
