"""Figure serving-bench-serve (docs/SERVING.md, "Server: `pdkv serve` and `pdkv bench serve`").

`python -m pdkv.report.recipes.serving [--num-prompts 32] -- --num-kv-blocks 2048
--max-model-len 2048` starts `pdkv serve smollm2 --host 127.0.0.1 --port P ENGINE_ARGS` (a free
port unless --port), waits for its /health, runs `pdkv bench serve --base-url URL --model
smollm2 --endpoint chat --dataset prefix-repetition --prefix-len 256 --num-prefixes 2 --input-len
64 --output-len 32 --num-prompts 32 --request-rate 1 --max-concurrency 8 --seed 0 --goodput
ttft:1000 tpot:250`, stops the server and prints the guide's "metric | value" table (requests,
throughputs, TTFT / TPOT / ITL / E2EL in ms, the server counters' prefix-cache hit rate). Exits
1 when a request failed or the server was not ready.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from pdkv.ports import free_port
from pdkv.report.recipes import common, procs

NAME = "serving"
GOODPUT = ("ttft:1000", "tpot:250")  # the guide's SLOs, ms


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The recipe's flags (the workload's as in `pdkv bench serve`)."""
    common.add_workload_args(parser, num_prompts=32, input_len=64, output_len=32,
                             request_rate=1.0, max_concurrency=8,
                             input_help="suffix tokens per prompt")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared prefix tokens")
    parser.add_argument("--num-prefixes", type=int, default=2, help="distinct shared prefixes")
    common.add_common_args(parser, NAME)
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="after --: `pdkv serve` flags (e.g. --num-kv-blocks 2048)")
    return parser


def bench_args(args: argparse.Namespace, url: str) -> list[str]:
    """The `pdkv bench serve` flags of the run against `url`."""
    return ["--base-url", url, "--endpoint", "chat", "--dataset", "prefix-repetition",
            "--prefix-len", str(args.prefix_len), "--num-prefixes", str(args.num_prefixes),
            *common.workload_bench_args(args),
            "--goodput", *GOODPUT]


def hit_rate(server: dict[str, Any] | None) -> str:
    """The prefix-cache hit rate of the server counters' deltas: "75.14 % (8416 of 11200 prompt
    tokens)", or "-" without counters (or without queries)."""
    if not server or server.get("prefix_cache_hit_rate") is None:
        return "-"
    return (f"{100.0 * float(server['prefix_cache_hit_rate']):.2f} % "
            f"({float(server['prefix_cache_hits']):.0f} of "
            f"{float(server['prefix_cache_queries']):.0f} prompt tokens)")


def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The guide's "metric | value" table of one bench serve result: (columns, rows), times in
    ms, throughputs per s.

    Raises:
        KeyError: the result lacks one of the metric keys of `pdkv bench serve`.
    """
    r = result
    goodput = ("-" if r.get("request_goodput") is None
               else f"{common.num(r['request_goodput'])} ({r['good_requests']} good)")
    rows = [
        ["successful / failed requests", f"{r['completed']} / {r['failed']}"],
        ["request throughput, goodput (req/s)", f"{common.num(r['request_throughput'])}, "
                                                f"{goodput}"],
        ["output / total token throughput (tok/s)",
         common.joined(r["output_throughput"], r["total_token_throughput"])],
        ["TTFT mean / P50 / P99 (ms)",
         common.joined(r["mean_ttft_ms"], r["median_ttft_ms"], r["p99_ttft_ms"])],
        ["TPOT mean / P99 (ms)", common.joined(r["mean_tpot_ms"], r["p99_tpot_ms"])],
        ["ITL mean / P99 (ms)", common.joined(r["mean_itl_ms"], r["p99_itl_ms"])],
        ["E2EL mean / P99 (ms)", common.joined(r["mean_e2el_ms"], r["p99_e2el_ms"])],
        ["prefix-cache hit rate (server counters)", hit_rate(r.get("server_metrics"))],
    ]
    return ["metric", "value"], rows


def run(args: argparse.Namespace) -> int:
    """The server, the run, the table; returns the exit status (1: a request failed).

    Raises:
        procs.NotReady, procs.BenchFailed: the server or the benchmark run failed.
    """
    port = args.port or free_port()
    times = common.deadlines(args)
    serve = [args.model, *common.engine_args(args.engine_args)]
    with procs.serve(serve, port, args.log_dir, times) as url:
        result = procs.bench_serve(bench_args(args, url),
                                   os.path.join(args.log_dir, "bench.json"),
                                   os.path.join(args.log_dir, "bench.log"), times)
    common.print_table(*table(result))
    return common.EXIT_FAILED if procs.failed_requests(result) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The recipe's command line; returns its exit status."""
    return common.main("pdkv.report.recipes.serving", __doc__, add_cli_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
