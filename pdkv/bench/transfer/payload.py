"""The deterministic payload of `pdkv bench transfer`: its byte pattern, the checks of a
received copy, and the block-shaped ReadOps that read it."""

from __future__ import annotations

import numpy as np

from pdkv.kv_transfer.engine.base import ReadOp

MIB = 1 << 20
BLOCK_BYTES = (
    737_280  # one SmolLM2 fp32 KV block: 16 tokens * 30 layers * 2 (K,V) * 3 heads * 64 * 4 B
)
REGION = "kv"
_PATTERN_MUL = np.uint64(0x9E3779B97F4A7C15)
_PATTERN_ADD = np.uint64(0x0123456789ABCDEF)
_CHUNK = 16 * MIB
POISON = 0xA5


def pattern_bytes(offset: int, nbytes: int) -> np.ndarray:
    """The deterministic payload bytes at [offset, offset + nbytes) of a region (uint8 array).

    Byte b belongs to the 64-bit word w = b // 8 whose value is w * K1 + K2 (mod 2**64, little
    endian), so every 8-byte position is distinct and a misplaced range is detected.
    """
    first = offset // 8
    last = (offset + nbytes + 7) // 8
    words = np.arange(first, last, dtype=np.uint64)
    words *= _PATTERN_MUL
    words += _PATTERN_ADD
    raw = words.astype("<u8", copy=False).view(np.uint8)
    start = offset - first * 8
    return raw[start : start + nbytes]


def fill_pattern(buf: memoryview) -> None:
    """Fill `buf` (any writable buffer, bytes) with `pattern_bytes(0, len(buf))`, in 16 MiB
    chunks."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    try:
        for off in range(0, len(arr), _CHUNK):
            n = min(_CHUNK, len(arr) - off)
            arr[off : off + n] = pattern_bytes(off, n)
    finally:
        del arr


def matches_pattern(arr: np.ndarray, nbytes: int) -> bool:
    """Whether arr[:nbytes] equals the pattern (full compare, 16 MiB chunks)."""
    for off in range(0, nbytes, _CHUNK):
        n = min(_CHUNK, nbytes - off)
        if not np.array_equal(arr[off : off + n], pattern_bytes(off, n)):
            return False
    return True


def _sample_offsets(nbytes: int, block_bytes: int) -> np.ndarray:
    """Offsets (bytes) of the first and last 8 bytes of every block of a payload of `nbytes`."""
    starts = np.arange(0, nbytes, block_bytes, dtype=np.int64)
    ends = np.minimum(starts + block_bytes, nbytes) - 8
    idx = np.concatenate([starts, np.maximum(ends, 0)])
    return np.unique(idx[idx + 8 <= nbytes])


class Sample:
    """Cheap per-repeat check: poison 8 bytes at each sample offset, verify them after the read."""

    def __init__(self, nbytes: int, block_bytes: int) -> None:
        offs = _sample_offsets(nbytes, block_bytes)
        self.index = (offs[:, None] + np.arange(8)[None, :]).ravel()
        self.expected = np.concatenate([pattern_bytes(int(o), 8) for o in offs]) if len(offs) else (
            np.zeros(0, dtype=np.uint8)
        )

    def poison(self, arr: np.ndarray) -> None:
        arr[self.index] = POISON

    def ok(self, arr: np.ndarray) -> bool:
        return bool(np.array_equal(arr[self.index], self.expected))


def block_read_ops(nbytes: int, dest: memoryview, block_bytes: int = BLOCK_BYTES,
                   region: str = REGION) -> list[ReadOp]:
    """ReadOps covering bytes [0, nbytes) of `region` in blocks of `block_bytes` (the last one may
    be shorter), each into the matching slice of `dest` (which must hold >= nbytes bytes)."""
    ops = []
    for off in range(0, nbytes, block_bytes):
        n = min(block_bytes, nbytes - off)
        ops.append(ReadOp(region, off, n, dest[off : off + n]))
    return ops
