"""`pdkv bench prefill-cap`: the colocated inter-token latency tail against the prefill cap of
mixed steps (`--max-mixed-prefill-tokens`), one server per cap, the same workload each time.

For every cap in `--caps` (0 = no cap, today's behaviour, the peer every other row is compared
with) it starts one colocated engine (`pdkv up --mode colocated`, engine flags after `--`),
warms it up, runs the `pdkv bench serve` workload (random prompts of `--input-len` tokens,
`--output-len` tokens each, Poisson arrivals at `--request-rate`, at most `--max-concurrency`
in flight: long prefills land while other requests decode) and stops it. The table gives per
cap TTFT mean / p99, TPOT mean, ITL p99 (ms, vLLM's definitions in pdkv/bench/serve/metrics.py),
ITL p99 / TPOT mean (issue 14's goal: <= 2) and TTFT mean against the uncapped row (goal: no
more than 20 % worse). Runs are sequential on a shared box: each row's ratio is measured within
its run; the TTFT comparison across rows is as good as the box is quiet (load average printed).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import TypedDict

import httpx

from pdkv.bench.results import parse_ints
from pdkv.bench.serve.config import BenchConfig
from pdkv.bench.serve.runner import run_serve_bench


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of `pdkv bench prefill-cap` (workload flags as in `pdkv bench serve`)."""
    parser.add_argument(
        "--caps",
        default="0,32,64,128,256",
        help="comma-separated --max-mixed-prefill-tokens values (0 = no cap, the peer)",
    )
    parser.add_argument("--model", default="smollm2", help="alias or HF folder")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    parser.add_argument("--num-prompts", type=int, default=24, help="requests per cap")
    parser.add_argument("--request-rate", type=float, default=0.5, help="Poisson arrivals, req/s")
    parser.add_argument("--max-concurrency", type=int, default=4, help="requests in flight at most")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random prompts and arrivals"
    )
    parser.add_argument(
        "--log-dir", default="pdkv-logs/prefill-cap", help="server logs, one folder per cap"
    )
    parser.add_argument(
        "--health-timeout", type=float, default=300.0, help="s to wait for a server"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="after --: engine flags for every run (e.g. --num-kv-blocks 1024)")
    return parser


class CapRow(TypedDict):
    """One cap's run: failed requests and the latency keys of its bench result (ms)."""

    cap: int
    failed: int
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    p99_itl_ms: float
    mean_itl_ms: float


def run_cap(cap: int, args: argparse.Namespace) -> CapRow:
    """Start a colocated engine with `cap`, run the workload, stop it; the bench result's
    latency keys (ms) plus cap and failed count.

    Raises:
        RuntimeError: the server did not become healthy (its log folder is named)."""
    from pdkv.launch import launcher

    log_dir = os.path.join(args.log_dir, f"cap{cap}")
    os.makedirs(log_dir, exist_ok=True)
    engine_args = [a for a in args.engine_args if a != "--"]
    up = launcher.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--mode", "colocated", "--model", args.model, "--log-dir", log_dir])
    up.engine_args = engine_args + ["--max-mixed-prefill-tokens", str(cap)]
    topo = launcher.build_topology(up)
    try:
        if not topo.start_healthy(log_dir, args.health_timeout):
            raise RuntimeError(f"cap {cap}: the server did not start; see {log_dir}/")
        with httpx.Client(timeout=120.0) as client:
            model = client.get(topo.endpoint + "/v1/models").json()["data"][0]["id"]
            client.post(
                topo.endpoint + "/v1/completions",  # warm-up: first-call costs out of the run
                json={"model": model, "prompt": "warm up", "max_tokens": 2},
            )
        cfg = BenchConfig(base_url=topo.endpoint, model=model, dataset="random",
                          num_prompts=args.num_prompts, input_len=args.input_len,
                          output_len=args.output_len, request_rate=args.request_rate,
                          max_concurrency=args.max_concurrency, seed=args.seed,
                          scrape_metrics=False, disable_tqdm=True)
        result = run_serve_bench(cfg, log=lambda s: None)
    finally:
        topo.stop()
    return {"cap": cap, "failed": result.get("failed", 0),
            "mean_ttft_ms": float(result["mean_ttft_ms"]),
            "p99_ttft_ms": float(result["p99_ttft_ms"]),
            "mean_tpot_ms": float(result["mean_tpot_ms"]),
            "p99_itl_ms": float(result["p99_itl_ms"]),
            "mean_itl_ms": float(result["mean_itl_ms"])}


def render(rows: list[CapRow]) -> str:
    """Markdown table of the rows; ratios against the row with cap 0 (when present)."""
    base = next((r for r in rows if r["cap"] == 0), None)
    lines = [
        "| cap (tokens) | TTFT mean / p99 (ms) | TPOT mean (ms) | ITL p99 (ms) | ITL p99 / TPOT "
        "mean | TTFT mean vs no cap | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = (
            f"{r['mean_ttft_ms'] / base['mean_ttft_ms']:.2f}x"
            if base and base["mean_ttft_ms"]
            else "-"
        )
        lines.append(
            f"| {r['cap'] or 'none'} | {r['mean_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
            f"{r['mean_tpot_ms']:.0f} "
            f"| {r['p99_itl_ms']:.0f} | {r['p99_itl_ms'] / r['mean_tpot_ms']:.2f} | {vs} | "
            f"{r['failed']} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run every cap in order and print the table (exit 1 when a run had failed requests)."""
    caps = parse_ints(args.caps)
    if not caps or min(caps) < 0:
        raise SystemExit(f"--caps needs integers >= 0, got {args.caps!r}")
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    rows = [run_cap(c, args) for c in caps]
    print(
        f"pdkv bench prefill-cap: {args.model}, {args.num_prompts} prompts x {args.input_len} "
        "tokens -> "
        f"{args.output_len}, {args.request_rate} req/s, concurrency {args.max_concurrency}; "
        f"load average {load:.1f} at start, {time.monotonic() - t0:.0f} s"
    )
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["failed"] for r in rows) else 0
