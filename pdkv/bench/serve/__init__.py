"""`pdkv bench serve`: an online serving benchmark for any OpenAI-compatible server.

It behaves like `vllm bench serve`: it sends streamed completions or chat requests (random,
prefix-repetition or jsonl prompts) at a Poisson request rate, optionally capped in
concurrency, and reports TTFT, TPOT, ITL and E2EL (mean/median/std/percentiles in ms),
request / token throughput and goodput, plus the server's prefix cache hit rate and KV
transfer bytes from its Prometheus `/metrics` when present.

Modules: `datasets` (prompts and token counts), `client` (one timed SSE request), `metrics`
(pure aggregate arithmetic), `server_metrics` (Prometheus deltas), `runner` (the benchmark
loop), `report` (table and JSON), `config` (`BenchConfig`), `cli` (flags).

Usage::

    pdkv bench serve --base-url http://127.0.0.1:8000 --endpoint completions \\
        --dataset random --num-prompts 200 --input-len 512 --output-len 64 \\
        --request-rate 4 --max-concurrency 16 --goodput ttft:500 tpot:50 \\
        --result-json serve.json

Register it with `add_cli_args(parser)` and `parser.set_defaults(func=main)`.
"""

from pdkv.bench.serve.cli import add_cli_args, config_from_args, main
from pdkv.bench.serve.config import BenchConfig
from pdkv.bench.serve.metrics import compute_metrics
from pdkv.bench.serve.runner import run_benchmark, run_serve_bench

__all__ = [
    "BenchConfig",
    "add_cli_args",
    "compute_metrics",
    "config_from_args",
    "main",
    "run_benchmark",
    "run_serve_bench",
]
