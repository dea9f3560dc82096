"""Figure pd-colocated-vs-1p1d (docs/PD.md, "Colocated vs 1P1D on the same workload").

`python -m pdkv.report.recipes.colocated_vs_pd [--num-prompts 24] -- --num-kv-blocks 1024
--max-model-len 2048` runs, one after the other on the same port (a free one unless --port):
`pdkv up --mode colocated --port P -- ENGINE_ARGS`, then `pdkv up --mode pd --port P --
ENGINE_ARGS`, each loaded once it prints "ready:" with `pdkv bench serve --base-url URL --model
smollm2 --endpoint completions --dataset random --num-prompts 24 --input-len 512 --output-len 32
--request-rate 0.5 --max-concurrency 4 --seed 0` and stopped before the next starts. It prints
the guide's table (columns colocated | 1P1D (tcp); duration, throughputs, TTFT / TPOT / ITL /
E2EL in ms) and exits 1 when a request failed or a server was not ready.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from pdkv.ports import free_port
from pdkv.report.recipes import common, procs

NAME = "colocated-vs-pd"
MODES = (("colocated", "colocated"), ("pd", "1P1D (tcp)"))  # (pdkv up --mode, column)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The recipe's flags (the workload's as in `pdkv bench serve`)."""
    common.add_workload_args(parser, num_prompts=24, input_len=512, output_len=32,
                             request_rate=0.5, max_concurrency=4)
    common.add_common_args(parser, NAME)
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="after --: engine flags of both runs (e.g. --num-kv-blocks 1024)")
    return parser


def bench_args(args: argparse.Namespace, url: str) -> list[str]:
    """The `pdkv bench serve` flags of one run against `url`."""
    return ["--base-url", url, "--endpoint", "completions", "--dataset", "random",
            *common.workload_bench_args(args)]


def table(results: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The guide's table from the bench serve results of the colocated and the 1P1D run, in
    MODES order: (columns, rows), times in s and ms, throughputs per s.

    Raises:
        ValueError: not one result per mode.
        KeyError: a result lacks one of the metric keys of `pdkv bench serve`.
    """
    if len(results) != len(MODES):
        raise ValueError(f"{len(MODES)} results needed (one per mode), got {len(results)}")

    def row(label: str, *keys: str) -> list[str]:
        return [label, *(common.joined(*(r[k] for k in keys)) for r in results)]

    rows = [
        row("duration (s)", "duration"),
        row("request throughput (req/s)", "request_throughput"),
        row("output token throughput (tok/s)", "output_throughput"),
        row("TTFT mean / median / P99 (ms)", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms"),
        row("TPOT mean / P99 (ms)", "mean_tpot_ms", "p99_tpot_ms"),
        row("ITL mean / P99 (ms)", "mean_itl_ms", "p99_itl_ms"),
        row("E2EL mean / P99 (ms)", "mean_e2el_ms", "p99_e2el_ms"),
    ]
    return ["", *(column for _, column in MODES)], rows


def run(args: argparse.Namespace) -> int:
    """Both runs in turn, then the table; returns the exit status (1: a request failed).

    Raises:
        procs.NotReady, procs.BenchFailed: a server or a benchmark run failed.
    """
    port = args.port or free_port()
    engine = common.engine_args(args.engine_args)
    times = common.deadlines(args)
    results = []
    for mode, _ in MODES:
        log_dir = os.path.join(args.log_dir, mode)
        up = ["--mode", mode, "--model", args.model, "--port", str(port), "--", *engine]
        with procs.up(up, log_dir, times) as url:
            results.append(procs.bench_serve(bench_args(args, url),
                                             os.path.join(log_dir, "bench.json"),
                                             os.path.join(log_dir, "bench.log"), times))
        print(f"{mode}: {results[-1]['completed']} completed, "
              f"{procs.failed_requests(results[-1])} failed", file=sys.stderr, flush=True)
    common.print_table(*table(results))
    return common.EXIT_FAILED if any(procs.failed_requests(r) for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The recipe's command line; returns its exit status."""
    return common.main("pdkv.report.recipes.colocated_vs_pd", __doc__, add_cli_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
