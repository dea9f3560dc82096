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

    from pdkv.bench.transfer.cli import run_transfer_bench
    result = run_transfer_bench(sizes_mib=(1, 16, 256), repeats=5)

or from the CLI: `pdkv bench transfer --sizes 1,16,256 --repeats 5 --engines tcp,shm`.
"""

# Layout: `transfer_payload` (pattern, checks, ReadOps), `transfer_peers` (producer processes,
# raw socket peer), `transfer_runner` (the benchmark run), `transfer_report` (stats, targets,
# table); this module re-exports their public names and holds the CLI (`add_cli_args` / `main`).

from __future__ import annotations

import argparse

from pdkv.bench.results import write_result_json
from pdkv.bench.transfer.payload import (
    BLOCK_BYTES,
    MIB,
    REGION,
    block_read_ops,
    fill_pattern,
    pattern_bytes,
)
from pdkv.bench.transfer.peers import Producer
from pdkv.bench.transfer.report import (
    GB,
    SHM_TARGET,
    TCP_TARGET,
    TCP_TARGET_MIN_MIB,
    format_table,
)
from pdkv.bench.transfer.runner import (
    DEFAULT_SIZES_MIB,
    ENGINES,
    LARGE_REPEATS,
    LARGE_SIZE_MIB,
    run_transfer_bench,
)

__all__ = [
    "BLOCK_BYTES",
    "DEFAULT_SIZES_MIB",
    "ENGINES",
    "GB",
    "LARGE_REPEATS",
    "LARGE_SIZE_MIB",
    "MIB",
    "REGION",
    "SHM_TARGET",
    "TCP_TARGET",
    "TCP_TARGET_MIN_MIB",
    "Producer",
    "add_cli_args",
    "block_read_ops",
    "fill_pattern",
    "format_table",
    "main",
    "pattern_bytes",
    "run_transfer_bench",
]


def _parse_int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
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
        write_result_json(result, args.result_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(add_cli_args(argparse.ArgumentParser(description=__doc__)).parse_args()))
