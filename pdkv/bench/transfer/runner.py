"""The `pdkv bench transfer` run: each engine and the raw-socket and memcpy peers, interleaved,
for every payload size, with the payload verified."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np

from pdkv.bench.transfer.payload import (
    BLOCK_BYTES,
    MIB,
    POISON,
    Sample,
    block_read_ops,
    fill_pattern,
    matches_pattern,
)
from pdkv.bench.transfer.peers import READ_TIMEOUT_S, Producer, RawClient
from pdkv.bench.transfer.report import (
    GB,
    MethodStats,
    SizeResult,
    TransferResult,
    format_table,
    size_result,
    stats,
)
from pdkv.jsontypes import JSONObject
from pdkv.kv_transfer.engine.base import ReadOp, TransferEngine, TransferError

ENGINES = ("tcp", "shm")
DEFAULT_SIZES_MIB = (1, 16, 256)
LARGE_SIZE_MIB = 256  # at or above this size, at most LARGE_REPEATS timed repeats
LARGE_REPEATS = 3


def _engine_read(eng: TransferEngine, peer: JSONObject, ops: list[ReadOp], nbytes: int) -> None:
    got = eng.read(peer, ops, time.monotonic() + READ_TIMEOUT_S)
    if got != nbytes:
        raise TransferError(f"{eng.name} read {got} of {nbytes} bytes")


def run_transfer_bench(
    sizes_mib: Sequence[int] = DEFAULT_SIZES_MIB,
    repeats: int = 5,
    engines: Sequence[str] = ENGINES,
    verify: bool = True,
    block_bytes: int = BLOCK_BYTES,
    print_table: bool = True,
) -> TransferResult:
    """Measure cross-process transfer bandwidth of each engine and of the raw-socket and memcpy
    peers for each payload size.

    Args:
        sizes_mib: payload sizes in MiB (1 MiB = 2**20 bytes).
        repeats: timed repeats per method and size (sizes >= 256 MiB use at most 3).
        engines: transfer engines to measure, from ("tcp", "shm").
        verify: compare the payload with the pattern (full compare on a warm-up read, sampled
            first/last 8 bytes of every block on each timed read).
        block_bytes: bytes per ReadOp (a KV block; default 737,280 = SmolLM2 fp32, 16 tokens).
        print_table: print the table and targets to stdout.

    Returns:
        {"config": {...}, "sizes": [per size: {"size_mib", "nbytes", "num_ops", "repeats",
        "methods": {name: {"best_gbps", "median_gbps", "gbps", "seconds", "verified"}},
        "ratios": {"tcp/raw_socket": {"best", "median"}, "shm/memcpy": {...}},
        "targets": {name: {"target", "ratio" (best), "applies", "pass" (None if the
        size is below the target's range)}}}]}, bandwidths in GB/s (1e9 bytes/s),
        seconds per transfer; methods are the engines plus "raw_socket" and "memcpy".

    Raises:
        ValueError: bad sizes, repeats or engine names.
        TransferError / RuntimeError: a transfer failed or the payload did not verify.
    """
    sizes = [int(s) for s in sizes_mib]
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"sizes must be positive MiB counts, got {list(sizes_mib)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    engines = list(dict.fromkeys(engines))
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engines {unknown}; known: {ENGINES}")
    max_bytes = max(sizes) * MIB

    producers: dict[str, Producer] = {}
    consumers: dict[str, TransferEngine] = {}
    raw: RawClient | None = None
    results: list[SizeResult] = []
    try:
        # Start every producer first so the spawns overlap, then wait for them.
        for kind in ["raw", *engines]:
            producers[kind] = Producer(kind, max_bytes)
        dest_buf = np.empty(max_bytes, dtype=np.uint8)
        src_buf = np.empty(max_bytes, dtype=np.uint8)
        fill_pattern(memoryview(src_buf))
        dest_buf.fill(0)  # touch the pages before timing
        for p in producers.values():
            p.wait_ready()
        dest = memoryview(dest_buf)
        raw = RawClient(producers["raw"].peer)
        for kind in engines:
            if kind == "tcp":
                from pdkv.kv_transfer.engine.tcp import TcpTransferEngine

                consumers[kind] = TcpTransferEngine()
            else:
                from pdkv.kv_transfer.engine.shm import ShmTransferEngine

                consumers[kind] = ShmTransferEngine()

        for size in sizes:
            nbytes = size * MIB
            reps = min(repeats, LARGE_REPEATS) if size >= LARGE_SIZE_MIB else repeats
            ops = block_read_ops(nbytes, dest, block_bytes)
            transfers: dict[str, Callable[[], None]] = {}
            for kind in engines:
                eng, peer = consumers[kind], producers[kind].peer

                transfers[kind] = functools.partial(_engine_read, eng, peer, ops, nbytes)
            assert raw is not None
            transfers["raw_socket"] = functools.partial(raw.read, dest[:nbytes])
            transfers["memcpy"] = functools.partial(np.copyto, dest_buf[:nbytes], src_buf[:nbytes])

            sample = Sample(nbytes, block_bytes) if verify else None
            seconds: dict[str, list[float]] = {m: [] for m in transfers}
            verified: dict[str, bool] = {m: False for m in transfers}
            # Warm-up (connection, page mapping, caches), verified with a full compare.
            for name, fn in transfers.items():
                if verify:
                    dest_buf[:nbytes].fill(POISON)
                fn()
                if verify:
                    if not matches_pattern(dest_buf, nbytes):
                        raise RuntimeError(
                            f"{name}: payload of {size} MiB does not match the pattern"
                        )
                    verified[name] = True
            # Timed repeats, methods interleaved so they see the same machine state.
            for _ in range(reps):
                for name, fn in transfers.items():
                    if sample is not None:
                        sample.poison(dest_buf)
                    t0 = time.perf_counter()
                    fn()
                    seconds[name].append(time.perf_counter() - t0)
                    if sample is not None and not sample.ok(dest_buf):
                        raise RuntimeError(f"{name}: sampled bytes of {size} MiB do not match")
            methods: dict[str, MethodStats] = {}
            for name, secs in seconds.items():
                methods[name] = stats(secs, nbytes)
                methods[name]["verified"] = verified[name]
            results.append(size_result(size, nbytes, len(ops), reps, methods))
    finally:
        if raw is not None:
            raw.close()
        for eng in consumers.values():
            with contextlib.suppress(Exception):
                eng.close()
        for p in producers.values():
            with contextlib.suppress(Exception):
                p.stop()

    result: TransferResult = {
        "config": {
            "sizes_mib": sizes, "repeats": repeats, "engines": engines, "verify": verify,
            "block_bytes": block_bytes, "gb": GB, "large_size_mib": LARGE_SIZE_MIB,
            "large_repeats": LARGE_REPEATS,
        },
        "sizes": results,
    }
    if print_table:
        print(format_table(result))
    return result
