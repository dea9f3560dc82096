"""Figure ttft-proxy-after (docs/TTFT.md, "Figures"): the proxy's own time before the prefill
leg, per endpoint and concurrency.

`python -m pdkv.report.recipes.ttft_proxy [--num-prompts 100]` does what the guide's
"Reproduce" script does: `pdkv up --mode pd --port P --threads-per-engine 1
--disable-log-requests` (a free port unless --port; engine flags after `--`), then, once it
prints "ready:", for each concurrency c in 1,16,64 and each endpoint in completions,chat `pdkv
bench serve --base-url URL --endpoint EP --num-prompts 100 --max-concurrency c --input-len 128
--output-len 4`, with the 1-minute load average read before and after each run; then stops the
deployment. It prints the guide's table: per run `p50 / p99` in ms of `ttft_phases.phases.proxy`
and of `ttft_phases.proxy_parts` body, models, route, length, and the load average before ->
after. Exits 1 when a request failed, a run carried no proxy timings or the deployment was not
ready.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdkv.bench.results import parse_ints
from pdkv.ports import free_port
from pdkv.report.recipes import common, procs

NAME = "ttft-proxy"
PARTS = ("body", "models", "route", "length")  # the proxy_parts shown, in the guide's order
COLUMNS = ["endpoint, concurrency", "proxy", *PARTS, "load avg"]


@dataclass(frozen=True)
class Run:
    """One bench serve run: its endpoint, concurrency, result dict and the 1-minute load
    average just before and just after it."""

    endpoint: str
    concurrency: int
    result: dict[str, Any]
    load_before: float
    load_after: float


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The recipe's flags (the workload's as in `pdkv bench serve`)."""
    parser.add_argument("--port", type=int, default=0, help="the proxy's port (0: a free one)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests per run")
    parser.add_argument("--concurrencies", default="1,16,64",
                        help="comma-separated --max-concurrency values, one run each")
    parser.add_argument("--endpoints", default="completions,chat",
                        help="comma-separated endpoints, one run each per concurrency")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=4, help="output tokens per request")
    common.add_common_args(parser, NAME)
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="after --: engine flags of P and D")
    return parser


def bench_args(args: argparse.Namespace, url: str, endpoint: str, concurrency: int) -> list[str]:
    """The `pdkv bench serve` flags of one run against `url`."""
    return ["--base-url", url, "--endpoint", endpoint, "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(concurrency), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len)]


def p50_p99(stats: dict[str, Any] | None) -> str:
    """A phase's "p50 / p99" in ms ("-" when the run has no such phase)."""
    return "-" if stats is None else common.joined(stats["p50_ms"], stats["p99_ms"])


def row(run: Run) -> list[str]:
    """One table row of a run.

    Raises:
        procs.RecipeError: the result has no proxy phase (no `pdkv_timings` from a proxy).
    """
    phases = run.result.get("ttft_phases") or {}
    proxy = (phases.get("phases") or {}).get("proxy")
    if proxy is None:
        raise procs.RecipeError(f"{run.endpoint}, c={run.concurrency}: the result has no "
                                "ttft_phases.phases.proxy (the server sent no proxy timings)")
    parts = phases.get("proxy_parts") or {}
    return [f"{run.endpoint}, c={run.concurrency}", p50_p99(proxy),
            *(p50_p99(parts.get(p)) for p in PARTS),
            f"{run.load_before:.2f} → {run.load_after:.2f}"]


def table(runs: Sequence[Run]) -> tuple[list[str], list[list[str]]]:
    """The guide's table of the runs, in their order: (columns, rows).

    Raises:
        procs.RecipeError: a run has no proxy phase.
    """
    return list(COLUMNS), [row(r) for r in runs]


def run(args: argparse.Namespace) -> int:
    """The deployment, every run, the table; returns the exit status (1: a request failed).

    Raises:
        procs.NotReady, procs.BenchFailed: the deployment or a benchmark run failed.
        procs.RecipeError: a run carried no proxy timings.
    """
    concurrencies = parse_ints(args.concurrencies)
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    if not concurrencies or min(concurrencies) < 1 or not endpoints:
        raise SystemExit("--concurrencies needs integers >= 1 and --endpoints at least one")
    port = args.port or free_port()
    times = common.deadlines(args)
    up = ["--mode", "pd", "--port", str(port), "--threads-per-engine", "1",
          "--disable-log-requests", "--", *common.engine_args(args.engine_args)]
    runs = []
    with procs.up(up, args.log_dir, times) as url:
        for c in concurrencies:
            for ep in endpoints:
                before = os.getloadavg()[0]
                out = os.path.join(args.log_dir, f"proxy-c{c}-{ep}")
                result = procs.bench_serve(bench_args(args, url, ep, c), out + ".json",
                                           out + ".log", times)
                runs.append(Run(ep, c, result, before, os.getloadavg()[0]))
                print(f"{ep}, c={c}: {result['completed']} completed, "
                      f"{procs.failed_requests(result)} failed", file=sys.stderr, flush=True)
    common.print_table(*table(runs))
    return common.EXIT_FAILED if any(procs.failed_requests(r.result) for r in runs) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The recipe's command line; returns its exit status."""
    return common.main("pdkv.report.recipes.ttft_proxy", __doc__, add_cli_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
