"""`pdkv bench transfer` and the transfer engines it measures, against producer processes."""

import argparse
import json
import math
import os
import socket
import time

import numpy as np
import pytest

from pdkv.bench.transfer.cli import (
    BLOCK_BYTES,
    REGION,
    Producer,
    add_cli_args,
    block_read_ops,
    main,
    pattern_bytes,
    run_transfer_bench,
)
from pdkv.bench.transfer.report import (
    SHM_TARGET,
    TCP_TARGET,
    TCP_TARGET_MIN_MIB,
    format_table,
    size_result,
)
from pdkv.kv_transfer.engine.base import ReadOp, TransferError
from pdkv.kv_transfer.engine.shm import ShmTransferEngine
from pdkv.kv_transfer.engine.tcp import TcpTransferEngine

REGION_BYTES = 1_000_003  # not a multiple of 8 or of the block size: exercises the tail


def _consumer(kind):
    return TcpTransferEngine() if kind == "tcp" else ShmTransferEngine()


def test_pattern_is_position_dependent_and_sliceable():
    whole = pattern_bytes(0, 4096)
    assert np.array_equal(pattern_bytes(13, 100), whole[13:113])
    assert np.array_equal(pattern_bytes(4000, 96), whole[4000:])
    # Every 8-byte word differs, so a range read from the wrong offset cannot match.
    words = whole.view("<u8")
    assert len(np.unique(words)) == len(words)


def test_block_read_ops_cover_the_payload_in_kv_blocks():
    dest = memoryview(bytearray(1 << 20))
    ops = block_read_ops(1 << 20, dest)
    assert [(op.offset, op.length) for op in ops] == [
        (0, BLOCK_BYTES),
        (BLOCK_BYTES, (1 << 20) - BLOCK_BYTES),
    ]
    assert all(op.region == REGION and len(op.dest) == op.length for op in ops)


def test_small_run_reports_verified_positive_bandwidths():
    result = run_transfer_bench(sizes_mib=(1,), repeats=2)
    assert result["config"]["engines"] == ["tcp", "shm"]
    (size,) = result["sizes"]
    assert size["size_mib"] == 1 and size["nbytes"] == 1 << 20 and size["num_ops"] == 2
    methods = size["methods"]
    assert set(methods) == {"tcp", "shm", "raw_socket", "memcpy"}
    for name, m in methods.items():
        assert m["verified"] is True, name
        assert len(m["gbps"]) == 2 and all(g > 0 for g in m["gbps"]), name
        assert m["best_gbps"] == max(m["gbps"]) > 0
        assert min(m["gbps"]) <= m["median_gbps"] <= m["best_gbps"]
        for g, s in zip(m["gbps"], m["seconds"]):
            assert math.isclose(g, (1 << 20) / s / 1e9)
    for key, eng, peer in (
        ("tcp/raw_socket", "tcp", "raw_socket"),
        ("shm/memcpy", "shm", "memcpy"),
    ):
        r = size["ratios"][key]
        assert math.isclose(r["best"], methods[eng]["best_gbps"] / methods[peer]["best_gbps"])
        assert math.isclose(r["median"], methods[eng]["median_gbps"] / methods[peer]["median_gbps"])
        assert size["targets"][key]["ratio"] == r["best"]
    # 1 MiB is below the tcp target's range; the shm target applies at every size.
    assert size["targets"]["tcp/raw_socket"]["pass"] is None
    shm = size["targets"]["shm/memcpy"]
    assert shm["applies"] is True and shm["target"] == SHM_TARGET
    assert shm["pass"] is (shm["ratio"] >= SHM_TARGET)


def _method(best: float, median: float) -> dict:
    return {"best_gbps": best, "median_gbps": median, "gbps": [best, median], "seconds": [1.0, 1.0],
            "verified": True}


def test_targets_and_ratios_from_known_numbers():
    methods = {"tcp": _method(8.0, 6.0), "raw_socket": _method(10.0, 10.0),
               "shm": _method(4.0, 3.0), "memcpy": _method(10.0, 4.0)}
    big = size_result(16, 16 << 20, 4, 3, methods)
    assert big["ratios"]["tcp/raw_socket"] == {"best": 0.8, "median": 0.6}
    assert big["ratios"]["shm/memcpy"] == {"best": 0.4, "median": 0.75}
    assert big["targets"]["tcp/raw_socket"] == {
        "target": TCP_TARGET,
        "ratio": 0.8,
        "applies": True,
        "pass": True,
    }
    assert big["targets"]["shm/memcpy"] == {
        "target": SHM_TARGET,
        "ratio": 0.4,
        "applies": True,
        "pass": False,
    }
    # Below TCP_TARGET_MIN_MIB the tcp target does not apply; the shm one always does.
    small = size_result(TCP_TARGET_MIN_MIB - 1, 1 << 20, 1, 3, methods)
    assert small["targets"]["tcp/raw_socket"]["applies"] is False
    assert small["targets"]["tcp/raw_socket"]["pass"] is None
    methods["tcp"] = _method(7.9, 7.9)  # just under 80% of raw
    assert size_result(16, 16 << 20, 4, 3, methods)["targets"]["tcp/raw_socket"]["pass"] is False
    methods["raw_socket"] = _method(0.0, 0.0)  # a peer that measured nothing: no ratio
    assert math.isnan(size_result(16, 16 << 20, 4, 3, methods)["ratios"]["tcp/raw_socket"]["best"])
    text = format_table({"sizes": [big], "config": {"block_bytes": 4096}})
    assert "tcp >= 80% of raw socket at >= 16 MiB" in text and "80% -> PASS" in text
    assert "shm >= 50% of memcpy" in text and "40% -> FAIL" in text


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_engine_reads_scattered_ranges_from_a_producer_process(kind):
    # Non-contiguous, out-of-order, unaligned ranges (one ends at the region's last byte),
    # each written to a scattered, out-of-order place in the destination.
    ranges = [(900_000, 100_003), (5, 1), (BLOCK_BYTES, 4096), (0, 8), (123_457, 65_536),
              (500_000, 1), (300_000, 77_777)]
    dest_places = [0, 200_000, 300_000, 400_000, 500_000, 700_000, 800_000]
    with Producer(kind, REGION_BYTES) as prod:
        peer = prod.wait_ready()
        eng = _consumer(kind)
        try:
            dest = np.full(1_000_000, 0xA5, dtype=np.uint8)
            dv = memoryview(dest)
            ops = [
                ReadOp(REGION, off, n, dv[at : at + n]) for (off, n), at in zip(ranges, dest_places)
            ]
            assert eng.read(peer, ops, time.monotonic() + 10) == sum(n for _, n in ranges)
            for (off, n), at in zip(ranges, dest_places):
                assert np.array_equal(dest[at : at + n], pattern_bytes(off, n)), (off, n)
            # Bytes between the destination places are untouched.
            assert dest[200_001] == 0xA5 and dest[999_999] == 0xA5

            # Reads outside the region (or of an unknown region) fail with TransferError ...
            bad_reads = [
                ReadOp(REGION, REGION_BYTES - 10, 11, memoryview(bytearray(11))),
                ReadOp(REGION, REGION_BYTES, 1, memoryview(bytearray(1))),
                ReadOp(REGION, -1, 4, memoryview(bytearray(4))),
                ReadOp("no-such-region", 0, 4, memoryview(bytearray(4))),
            ]
            for bad in bad_reads:
                with pytest.raises(TransferError):
                    eng.read(peer, [bad], time.monotonic() + 5)
            # ... and the engine keeps working afterwards.
            out = bytearray(4096)
            assert (
                eng.read(peer, [ReadOp(REGION, 777, 4096, memoryview(out))], time.monotonic() + 5)
                == 4096
            )
            assert bytes(out) == pattern_bytes(777, 4096).tobytes()
        finally:
            eng.close()
    if kind == "shm" and os.path.isdir("/dev/shm"):
        # The producer's close() unlinked its segment.
        seg = peer["segments"][REGION].lstrip("/")
        assert not os.path.exists(os.path.join("/dev/shm", seg))


def test_tcp_read_from_a_dead_producer_fails_fast():
    prod = Producer("tcp", REGION_BYTES)
    try:
        peer = prod.wait_ready()
        pooled = TcpTransferEngine()
        out = bytearray(64)
        assert (
            pooled.read(peer, [ReadOp(REGION, 0, 64, memoryview(out))], time.monotonic() + 5) == 64
        )
    finally:
        prod.kill()
    fresh = TcpTransferEngine()
    try:
        for eng in (pooled, fresh):  # a stale pooled connection, and a refused connect
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                eng.read(peer, [ReadOp(REGION, 0, 64, memoryview(out))], t0 + 1.0)
            assert time.monotonic() - t0 < 2.0
    finally:
        pooled.close()
        fresh.close()


def test_tcp_read_from_an_unresponsive_peer_fails_at_the_deadline():
    # A listener that never accepts: connect and send succeed (backlog), no reply ever comes.
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    eng = TcpTransferEngine()
    try:
        peer = {"host": "127.0.0.1", "port": silent.getsockname()[1]}
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            eng.read(peer, [ReadOp(REGION, 0, 64, memoryview(bytearray(64)))], t0 + 1.0)
        elapsed = time.monotonic() - t0
        assert 0.8 <= elapsed < 10.0  # at the 1 s deadline, not a default timeout (30 s+)
    finally:
        eng.close()
        silent.close()


def test_cli_args_and_main_write_result_json(tmp_path, capsys):
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--sizes", "1,16", "--repeats", "3", "--engines", "tcp"])
    assert args.sizes == [1, 16] and args.repeats == 3 and args.engines == ["tcp"]
    assert args.verify is True and args.result_json is None
    defaults = parser.parse_args([])
    assert (
        defaults.sizes == [1, 16, 256]
        and defaults.repeats == 5
        and defaults.engines == ["tcp", "shm"]
    )
    for bad in (["--sizes", "0"], ["--sizes", "a"], ["--engines", "rdma"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)

    out = tmp_path / "transfer.json"
    args = parser.parse_args(["--sizes", "1", "--repeats", "1", "--engines", "shm",
                              "--result-json", str(out)])
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert set(data["sizes"][0]["methods"]) == {"shm", "raw_socket", "memcpy"}
    printed = capsys.readouterr().out
    assert "shm >= 50% of memcpy" in printed and "GB/s" in printed
