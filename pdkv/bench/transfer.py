"""Transfer microbenchmark: effective bandwidth of each KV transfer engine vs its ceiling.

For each payload size (MiB) the consumer (this process) pulls the payload from a producer running
in a separate process (a `python -c` subprocess with its own multiprocessing resource
tracker, like a separately launched prefill server), as in real P/D disaggregation:

* ``tcp``: the producer registers a buffer with `TcpTransferEngine` and serves it; the consumer
  reads it with one `read()` of ReadOps shaped like KV blocks (737,280 bytes = one SmolLM2 fp32
  block of 16 tokens; the last op may be shorter) into a preallocated destination buffer.
* ``shm``: the producer allocates the region with `ShmTransferEngine.allocate`; the consumer maps
  the segment and copies the same ReadOps out of it.

and compares them with two peers measured in the same run, interleaved with the engines:

* ``raw socket``: a producer process `sendall`s a memoryview of N bytes over a plain loopback TCP
  socket (one 8-byte request per transfer, like the engine's request) and the consumer
  `recv_into`s it into a preallocated buffer: the best a Python socket can do;
* ``memcpy``: `numpy.copyto` of N bytes between two preallocated buffers in this process.

Every method runs one untimed warm-up per size whose destination is poisoned first and then fully
compared with the deterministic pattern; each timed repeat also checks the first and last 8 bytes
of every block (poisoned before the read). Bandwidth is GB/s with GB = 1e9 bytes, from the
wall-clock time of one `read()` (or recv loop / copy). Ratios are given for the best and the
median of the repeats; the targets are judged on the best.

Usage::

    from pdkv.bench.transfer import run_transfer_bench
    result = run_transfer_bench(sizes_mib=(1, 16, 256), repeats=5)

or from the CLI: `pdkv bench transfer --sizes 1,16,256 --repeats 5 --engines tcp,shm`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdkv.kv_transfer.engine.base import ReadOp, TransferEngine, TransferError

MIB = 1 << 20
GB = 1e9
BLOCK_BYTES = 737_280  # one SmolLM2 fp32 KV block: 16 tokens * 30 layers * 2 (K,V) * 3 heads * 64 * 4 B
REGION = "kv"
ENGINES = ("tcp", "shm")
DEFAULT_SIZES_MIB = (1, 16, 256)
LARGE_SIZE_MIB = 256  # at or above this size, at most LARGE_REPEATS timed repeats
LARGE_REPEATS = 3
TCP_TARGET = 0.80  # tcp >= 80% of raw socket at >= TCP_TARGET_MIN_MIB
TCP_TARGET_MIN_MIB = 16
SHM_TARGET = 0.50  # shm >= 50% of memcpy
_PATTERN_MUL = np.uint64(0x9E3779B97F4A7C15)
_PATTERN_ADD = np.uint64(0x0123456789ABCDEF)
_CHUNK = 16 * MIB
_POISON = 0xA5
_REQ = struct.Struct("!Q")
_START_TIMEOUT_S = 60.0
_READ_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------- pattern
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
    """Fill `buf` (any writable buffer, bytes) with `pattern_bytes(0, len(buf))`, in 16 MiB chunks."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    try:
        for off in range(0, len(arr), _CHUNK):
            n = min(_CHUNK, len(arr) - off)
            arr[off : off + n] = pattern_bytes(off, n)
    finally:
        del arr


def _matches_pattern(arr: np.ndarray, nbytes: int) -> bool:
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


class _Sample:
    """Cheap per-repeat check: poison 8 bytes at each sample offset, verify them after the read."""

    def __init__(self, nbytes: int, block_bytes: int) -> None:
        offs = _sample_offsets(nbytes, block_bytes)
        self.index = (offs[:, None] + np.arange(8)[None, :]).ravel()
        self.expected = np.concatenate([pattern_bytes(int(o), 8) for o in offs]) if len(offs) else (
            np.zeros(0, dtype=np.uint8)
        )

    def poison(self, arr: np.ndarray) -> None:
        arr[self.index] = _POISON

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


# ---------------------------------------------------------------------------- producer processes
def _producer_main(kind: str, nbytes: int, send: Callable[[dict[str, Any]], None],
                   wait_stop: Callable[[], None]) -> None:
    """Producer body: build the region of `nbytes` bytes, fill the pattern, serve it, `send`
    {"ok": True, "peer": peer_info} (or {"ok": False, "error": ...}), serve until `wait_stop`
    returns, then close the engine (unlinking shared memory) and send {"closed": True}."""
    engine: TransferEngine | None = None
    raw_srv: socket.socket | None = None
    try:
        if kind == "tcp":
            from pdkv.kv_transfer.engine.tcp import TcpTransferEngine

            buf = bytearray(nbytes)
            fill_pattern(memoryview(buf))
            engine = TcpTransferEngine()
            engine.register_region(REGION, memoryview(buf))
            engine.start("127.0.0.1")
            peer = engine.peer_info()
        elif kind == "shm":
            from pdkv.kv_transfer.engine.shm import ShmTransferEngine

            engine = ShmTransferEngine()
            view = engine.allocate(REGION, nbytes)
            fill_pattern(view)
            engine.register_region(REGION, view)
            del view
            peer = engine.peer_info()
        elif kind == "raw":
            buf = bytearray(nbytes)
            fill_pattern(memoryview(buf))
            raw_srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            raw_srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            raw_srv.bind(("127.0.0.1", 0))
            raw_srv.listen(8)
            threading.Thread(target=_raw_serve, args=(raw_srv, memoryview(buf)), daemon=True).start()
            peer = {"host": "127.0.0.1", "port": raw_srv.getsockname()[1]}
        else:
            raise ValueError(f"unknown producer kind {kind!r}")
    except Exception as e:  # report to the parent instead of dying silently
        _close_quietly(engine, raw_srv)
        send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    try:
        send({"ok": True, "peer": peer})
        wait_stop()
    finally:
        _close_quietly(engine, raw_srv)
    send({"closed": True})


def _producer_stdio() -> None:
    """Entry point of a producer subprocess: `python -c ... KIND NBYTES`; JSON lines on stdout,
    "stop" (or EOF) on stdin ends it."""
    kind, nbytes = sys.argv[1], int(sys.argv[2])

    def send(msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    def wait_stop() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                return

    _producer_main(kind, nbytes, send, wait_stop)


def _close_quietly(engine: TransferEngine | None, srv: socket.socket | None) -> None:
    if engine is not None:
        with contextlib.suppress(Exception):
            engine.close()
    if srv is not None:
        with contextlib.suppress(OSError):
            srv.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            srv.close()


def _raw_serve(srv: socket.socket, region: memoryview) -> None:
    """Raw loopback peer: for every 8-byte request N, sendall(region[:N])."""
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            head = bytearray(_REQ.size)
            try:
                while True:
                    if not _recv_exact(conn, memoryview(head)):
                        break
                    (n,) = _REQ.unpack(head)
                    conn.sendall(region[: min(n, len(region))])
            except OSError:
                pass


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock` with recv_into; False if the peer closed first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return False
        got += k
    return True


class Producer:
    """A producer subprocess of kind "tcp", "shm" or "raw" serving `nbytes` bytes of the pattern.

    A separate interpreter (not a multiprocessing child), like a separately launched prefill
    server: it has its own multiprocessing resource tracker. Use as a context manager or call
    `stop()`; `peer` is the producer's peer_info (a plain dict) after `wait_ready()`.
    """

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind = kind
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from pdkv.bench.transfer import _producer_stdio; _producer_stdio()",
             kind, str(nbytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
        )
        self.peer: dict[str, Any] = {}

    def _recv(self, timeout: float) -> dict[str, Any] | None:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._proc.stdout.readline()
        return json.loads(line) if line else None

    def wait_ready(self, timeout: float = _START_TIMEOUT_S) -> dict[str, Any]:
        """Block until the producer serves (timeout in seconds); returns its peer_info.

        Raises:
            RuntimeError: the producer failed or did not start in time (it is stopped).
        """
        msg = self._recv(timeout)
        if msg is None or not msg.get("ok"):
            self.stop()
            why = msg.get("error") if msg else f"no answer within {timeout:.0f} s or it exited"
            raise RuntimeError(f"{self.kind} producer failed: {why}")
        self.peer = msg["peer"]
        return self.peer

    @property
    def pid(self) -> int:
        """The producer's process id."""
        return self._proc.pid

    def kill(self) -> None:
        """Kill the producer abruptly (SIGKILL) and reap it (for failure tests)."""
        self._proc.kill()
        self._proc.wait(5)
        self._close_pipes()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the producer to close its engine (unlinking shared memory) and exit; kill it if it
        has not exited within `timeout` seconds."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            with contextlib.suppress(OSError, ValueError):
                self._proc.stdin.write("stop\n")
                self._proc.stdin.flush()
            with contextlib.suppress(OSError, ValueError):
                self._recv(timeout)  # {"closed": true}
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self._proc.stdin, self._proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError, ValueError):
                    f.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------- measurements
class _RawClient:
    """Consumer side of the raw loopback peer: one persistent connection."""

    def __init__(self, peer: dict[str, Any]) -> None:
        self.sock = socket.create_connection((peer["host"], int(peer["port"])), timeout=_READ_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read(self, dest: memoryview) -> None:
        self.sock.sendall(_REQ.pack(len(dest)))
        if not _recv_exact(self.sock, dest):
            raise ConnectionError("raw producer closed the connection")

    def close(self) -> None:
        self.sock.close()


def _engine_read(eng: TransferEngine, peer: dict[str, Any], ops: list[ReadOp], nbytes: int) -> None:
    got = eng.read(peer, ops, time.monotonic() + _READ_TIMEOUT_S)
    if got != nbytes:
        raise TransferError(f"{eng.name} read {got} of {nbytes} bytes")


def _stats(seconds: list[float], nbytes: int) -> dict[str, Any]:
    gbps = [nbytes / s / GB for s in seconds]
    return {
        "best_gbps": max(gbps),
        "median_gbps": statistics.median(gbps),
        "gbps": gbps,
        "seconds": seconds,
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def run_transfer_bench(
    sizes_mib: Sequence[int] = DEFAULT_SIZES_MIB,
    repeats: int = 5,
    engines: Sequence[str] = ENGINES,
    verify: bool = True,
    block_bytes: int = BLOCK_BYTES,
    print_table: bool = True,
) -> dict[str, Any]:
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
    raw: _RawClient | None = None
    results: list[dict[str, Any]] = []
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
        raw = _RawClient(producers["raw"].peer)
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

            sample = _Sample(nbytes, block_bytes) if verify else None
            seconds: dict[str, list[float]] = {m: [] for m in transfers}
            verified: dict[str, bool] = {m: False for m in transfers}
            # Warm-up (connection, page mapping, caches), verified with a full compare.
            for name, fn in transfers.items():
                if verify:
                    dest_buf[:nbytes].fill(_POISON)
                fn()
                if verify:
                    if not _matches_pattern(dest_buf, nbytes):
                        raise RuntimeError(f"{name}: payload of {size} MiB does not match the pattern")
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
            methods = {}
            for name, secs in seconds.items():
                methods[name] = _stats(secs, nbytes)
                methods[name]["verified"] = verified[name]
            results.append(_size_result(size, nbytes, len(ops), reps, methods))
    finally:
        if raw is not None:
            raw.close()
        for eng in consumers.values():
            with contextlib.suppress(Exception):
                eng.close()
        for p in producers.values():
            with contextlib.suppress(Exception):
                p.stop()

    result = {
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


def _size_result(size: int, nbytes: int, num_ops: int, reps: int,
                 methods: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ratios: dict[str, dict[str, float]] = {}
    targets: dict[str, dict[str, Any]] = {}
    for eng, peer, target, min_mib in (("tcp", "raw_socket", TCP_TARGET, TCP_TARGET_MIN_MIB),
                                       ("shm", "memcpy", SHM_TARGET, 0)):
        if eng not in methods:
            continue
        key = f"{eng}/{peer}"
        ratios[key] = {
            "best": _ratio(methods[eng]["best_gbps"], methods[peer]["best_gbps"]),
            "median": _ratio(methods[eng]["median_gbps"], methods[peer]["median_gbps"]),
        }
        applies = size >= min_mib
        targets[key] = {
            "target": target,
            "ratio": ratios[key]["best"],
            "applies": applies,
            "pass": (ratios[key]["best"] >= target) if applies else None,
        }
    return {"size_mib": size, "nbytes": nbytes, "num_ops": num_ops, "repeats": reps,
            "methods": methods, "ratios": ratios, "targets": targets}


def format_table(result: dict[str, Any]) -> str:
    """The bandwidth table (GB/s, GB = 1e9 bytes) and the target lines of a `run_transfer_bench`
    result, as text."""
    lines = [
        f"{'size':>8} {'method':>11} {'best GB/s':>10} {'median GB/s':>12} {'ratio(best)':>12} "
        f"{'ratio(med)':>11} {'verified':>9}",
    ]
    for s in result["sizes"]:
        for name, m in s["methods"].items():
            r = s["ratios"].get(f"{name}/raw_socket") or s["ratios"].get(f"{name}/memcpy")
            peer = "raw" if f"{name}/raw_socket" in s["ratios"] else "memcpy"
            rb = f"{r['best']:.2f} /{peer}" if r else ""
            rm = f"{r['median']:.2f}" if r else ""
            lines.append(
                f"{str(s['size_mib']) + ' MiB':>8} {name:>11} {m['best_gbps']:>10.2f} "
                f"{m['median_gbps']:>12.2f} {rb:>12} {rm:>11} {'yes' if m['verified'] else 'no':>9}"
            )
    reps = ", ".join(f"{s['size_mib']} MiB x{s['repeats']}" for s in result["sizes"])
    lines.append(f"(timed repeats: {reps}; ReadOps of {result['config']['block_bytes']} B; "
                 "ratios = engine GB/s / peer GB/s)")
    lines.append("targets:")
    for s in result["sizes"]:
        for key, t in s["targets"].items():
            if key.startswith("tcp"):
                label = f"tcp >= {TCP_TARGET:.0%} of raw socket at >= {TCP_TARGET_MIN_MIB} MiB"
            else:
                label = f"shm >= {SHM_TARGET:.0%} of memcpy"
            verdict = "n/a (size below target range)" if t["pass"] is None else (
                "PASS" if t["pass"] else "FAIL")
            lines.append(f"  {label:<42} {str(s['size_mib']) + ' MiB':>8}: "
                         f"{t['ratio']:.0%} -> {verdict}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- CLI
def _parse_int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _parse_engines(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in ENGINES]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"engines must be from {ENGINES}, got {text!r}")
    return vals


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv bench transfer` flags to `parser` (sizes in MiB)."""
    parser.add_argument("--sizes", type=_parse_int_list, default=list(DEFAULT_SIZES_MIB),
                        help="comma-separated payload sizes in MiB, e.g. 1,16,256")
    parser.add_argument("--repeats", type=int, default=5,
                        help=f"timed repeats per size (sizes >= {LARGE_SIZE_MIB} MiB: at most "
                             f"{LARGE_REPEATS})")
    parser.add_argument("--engines", type=_parse_engines, default=list(ENGINES),
                        help="comma-separated transfer engines, from tcp,shm")
    parser.add_argument("--block-bytes", type=int, default=BLOCK_BYTES,
                        help="bytes per ReadOp (one KV block)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the payload checks")
    parser.add_argument("--result-json", default=None, help="write the result dict to this file")
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed `add_cli_args` flags, print the table, write --result-json.

    Returns:
        Process exit code (0; targets are only reported).
    """
    result = run_transfer_bench(
        sizes_mib=tuple(args.sizes),
        repeats=args.repeats,
        engines=tuple(args.engines),
        verify=args.verify,
        block_bytes=args.block_bytes,
    )
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(add_cli_args(argparse.ArgumentParser(description=__doc__)).parse_args()))
