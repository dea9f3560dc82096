"""Pool value format (torch-free, no pickle).

    value = b"PDKV" | u32 little-endian header length | msgpack ChunkHeader | payload

The payload is every KV cache group's bytes for the chunk's tokens, concatenated in group order;
the header carries the format version, the key (so a value stored under the wrong name is caught),
the token count, each group's byte length and an xxh3-64 checksum of the payload. A value that
does not match what the reader expects in every respect raises `CorruptChunk`: the pool turns
that into a miss, never into wrong KV.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgspec
import xxhash

MAGIC = b"PDKV"
VERSION = 1
_LEN = struct.Struct("<I")
_PREFIX = len(MAGIC) + _LEN.size


class CorruptChunk(ValueError):
    """A pool value failed verification (magic, version, header, key, token count, group lengths,
    length or checksum); the message names what differs."""


class ChunkHeader(msgspec.Struct, frozen=True, kw_only=True):
    """Typed header of a pool value.

    Attributes:
        version: value format version (VERSION).
        key: the pool key the value was stored under.
        num_tokens: tokens in the chunk.
        group_lengths: payload bytes per KV cache group, in group order.
        checksum: xxhash.xxh3_64_intdigest of the whole payload.
    """

    version: int = VERSION
    key: str
    num_tokens: int
    group_lengths: list[int]
    checksum: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ChunkHeader)


def encode_chunk(key: str, num_tokens: int, groups: Sequence[bytes | memoryview]) -> bytes:
    """Encode one chunk: header + the groups' bytes concatenated in order.

    Args:
        key: the pool key (`pdkv.kvpool.keys.chunk_key`).
        num_tokens: tokens in the chunk.
        groups: each KV cache group's bytes for those tokens (C-contiguous buffers).

    Returns:
        The value (len = 8 + header length + sum of group lengths).
    """
    views = [memoryview(g).cast("B") for g in groups]
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    header = _encoder.encode(ChunkHeader(
        key=key, num_tokens=num_tokens, group_lengths=[v.nbytes for v in views],
        checksum=h.intdigest(),
    ))
    return b"".join([MAGIC, _LEN.pack(len(header)), header, *views])


def decode_chunk(
    value: bytes, key: str, num_tokens: int, group_lengths: Sequence[int]
) -> list[memoryview]:
    """Verify a value and return each group's payload (zero-copy views into `value`).

    Args:
        value: the stored value.
        key, num_tokens, group_lengths: what the reader expects (all must match the header).

    Raises:
        CorruptChunk: bad magic or version, undecodable header, key / num_tokens / group
            lengths not as expected, payload shorter or longer than the lengths, checksum mismatch.
    """
    buf = memoryview(value).cast("B")
    if buf.nbytes < _PREFIX or bytes(buf[: len(MAGIC)]) != MAGIC:
        raise CorruptChunk(f"bad magic for {key!r} (value of {buf.nbytes} bytes)")
    (header_len,) = _LEN.unpack_from(buf, len(MAGIC))
    start = _PREFIX + header_len
    if start > buf.nbytes:
        raise CorruptChunk(
            f"truncated header for {key!r}: needs {start} bytes, value has {buf.nbytes}"
        )
    try:
        header = _decoder.decode(buf[_PREFIX:start])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CorruptChunk(f"undecodable header for {key!r}: {e}") from None
    if header.version != VERSION:
        raise CorruptChunk(f"version {header.version} != {VERSION} for {key!r}")
    if header.key != key:
        raise CorruptChunk(f"key {header.key!r} != expected {key!r}")
    if header.num_tokens != num_tokens:
        raise CorruptChunk(f"num_tokens {header.num_tokens} != expected {num_tokens} for {key!r}")
    if header.group_lengths != list(group_lengths):
        raise CorruptChunk(
            f"group_lengths {header.group_lengths} != expected {list(group_lengths)} for {key!r}"
        )
    payload = buf[start:]
    total = sum(header.group_lengths)
    if payload.nbytes != total:
        raise CorruptChunk(f"payload {payload.nbytes} bytes != {total} expected for {key!r}")
    checksum = xxhash.xxh3_64_intdigest(payload)
    if checksum != header.checksum:
        raise CorruptChunk(f"checksum {checksum:#x} != {header.checksum:#x} for {key!r}")
    out: list[memoryview] = []
    offset = 0
    for n in header.group_lengths:
        out.append(payload[offset : offset + n])
        offset += n
    return out
