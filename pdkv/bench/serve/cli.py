"""`pdkv bench serve` flags and entry point (`add_cli_args` / `main`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping

from pdkv.bench.results import write_result_json
from pdkv.bench.serve.client import parse_endpoint
from pdkv.bench.serve.config import DATASETS, BenchConfig
from pdkv.bench.serve.metrics import parse_goodput, parse_percentiles
from pdkv.bench.serve.report import format_errors, format_result_table
from pdkv.bench.serve.runner import run_serve_bench


def _endpoint(value: str) -> str:
    try:
        return parse_endpoint(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _percentiles(value: str) -> list[float]:
    try:
        return parse_percentiles(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv bench serve` flags to `parser` (lengths in tokens, SLOs in ms)."""
    d = BenchConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=d.base_url, help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", type=_endpoint, default=d.endpoint,
                   help="completions (/v1/completions) or chat (/v1/chat/completions)")
    g.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default=None,
        help="vLLM's name for the endpoint: openai / vllm = completions, openai-chat = chat "
        "(overrides --endpoint)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="when the server has no /tokenize: count tokens with this model's tokenizer "
        "(alias, HF id in the local cache, or folder; default: the model)",
    )
    g.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds per request")
    g.add_argument(
        "--ignore-eos",
        dest="ignore_eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send vLLM's ignore_eos=true so every request generates exactly its output length "
        "(pdkv's default; `vllm bench serve` defaults to off: --no-ignore-eos)",
    )
    g.add_argument(
        "--metrics-url",
        default=None,
        help="Prometheus text endpoint(s), comma-separated, scraped before and after "
        "(default: BASE_URL/metrics, plus every engine's when BASE_URL is a pdkv proxy)",
    )
    g.add_argument("--no-metrics", dest="scrape_metrics", action="store_false",
                   help="do not scrape server metrics")

    g = parser.add_argument_group("dataset")
    g.add_argument(
        "--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default=d.dataset
    )
    g.add_argument(
        "--dataset-path",
        default=None,
        help='jsonl: lines {"prompt": str, "output_len": int?}; sharegpt: ShareGPT\'s JSON list of '
        '{"conversations": [{"from", "value"}, ...]} (a local file)',
    )
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: max_tokens of every request (default: the second turn's length)")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="requests; multi-turn: conversations (requests = conversations x turns)")
    g.add_argument(
        "--num-turns",
        type=int,
        default=d.num_turns,
        help="multi-turn: turns per conversation; turn t's prompt = turns before it + a new "
        "question of --input-len tokens (earlier answers: --output-len tokens)",
    )
    g.add_argument(
        "--system-prompt-len",
        type=int,
        default=d.system_prompt_len,
        help="multi-turn: every conversation opens with a system message of this many tokens "
        "(0: none)",
    )
    g.add_argument(
        "--num-system-prompts",
        type=int,
        default=d.num_system_prompts,
        help="multi-turn: distinct system prompts; conversation c gets prompt c %% N (groups of "
        "users sharing a prefix)",
    )
    g.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=int,
        default=d.input_len,
        help="prompt tokens (random), suffix tokens (prefix-repetition) or new question "
        "tokens per turn (multi-turn)",
    )
    g.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=d.output_len,
        help="max_tokens per request",
    )
    g.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=d.range_ratio,
        help="lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1",
    )
    g.add_argument("--prefix-len", type=int, default=d.prefix_len,
                   help="shared prefix tokens (prefix-repetition)")
    g.add_argument("--num-prefixes", type=int, default=d.num_prefixes,
                   help="distinct shared prefixes (prefix-repetition)")
    g.add_argument("--vocab-size", type=int, default=d.vocab_size,
                   help="random token ids are drawn from [100, vocab-size)")
    g.add_argument("--seed", type=int, default=d.seed)

    g = parser.add_argument_group("load and report")
    g.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="mean arrivals per second (Poisson); inf sends all at once")
    g.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="Gamma shape of the arrival gaps; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs, any of ttft:MS tpot:MS e2el:MS; good = meets all")
    g.add_argument(
        "--percentiles",
        "--metric-percentiles",
        dest="percentiles",
        type=_percentiles,
        default=list(d.percentiles),
        help="comma-separated percentiles to report, e.g. 50,90,99 (vLLM: --metric-percentiles)",
    )
    g.add_argument("--result-json", default=None, help="write the result dict to this file")
    g.add_argument("--save-result", action="store_true",
                   help="vLLM's: write the result dict to --result-dir/--result-filename")
    g.add_argument("--result-dir", default=".", help="--save-result: folder")
    g.add_argument(
        "--result-filename",
        default=None,
        help="--save-result: file name (unset: pdkv-<endpoint>-<rate>qps-<model>-<time>.json)",
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return parser


# vLLM's --backend values -> our endpoint.
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A `BenchConfig` from parsed `add_cli_args` flags (raises ValueError when invalid)."""
    endpoint = BACKENDS[args.backend] if getattr(args, "backend", None) else args.endpoint
    return BenchConfig(
        base_url=args.base_url,
        endpoint=endpoint,
        model=args.model,
        dataset=args.dataset,
        dataset_path=args.dataset_path,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        vocab_size=args.vocab_size,
        num_turns=args.num_turns,
        system_prompt_len=args.system_prompt_len,
        num_system_prompts=args.num_system_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        goodput=parse_goodput(args.goodput),
        percentiles=list(args.percentiles),
        api_key=args.api_key,
        metrics_url=args.metrics_url,
        scrape_metrics=args.scrape_metrics,
        disable_tqdm=args.disable_tqdm,
        ignore_eos=args.ignore_eos,
        request_timeout=args.request_timeout,
        tokenizer=getattr(args, "tokenizer", None),
        sharegpt_output_len=getattr(args, "sharegpt_output_len", None),
    )


def result_path(args: argparse.Namespace, result: Mapping[str, object]) -> str | None:
    """Where to write the result: --result-json, else with --save-result
    --result-dir/--result-filename (default name as vLLM's, with pdkv's endpoint), else None."""
    if args.result_json:
        return str(args.result_json)
    if not getattr(args, "save_result", False):
        return None
    name = args.result_filename
    if not name:
        config = result.get("config")
        conf = config if isinstance(config, dict) else {}
        model = str(conf.get("model") or "model").replace("/", "_")
        rate = result.get("request_rate")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"pdkv-{conf.get('endpoint', 'completions')}-{rate}qps-{model}-{stamp}.json"
    return os.path.join(args.result_dir, name)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print vLLM's result table, write --result-json if given.

    Returns:
        Process exit code: 0, or 1 when no request succeeded or the server gave no model.
    """
    cfg = config_from_args(args)
    try:
        result = run_serve_bench(cfg)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    errors = format_errors(result)
    if errors:
        print(errors)
    print(format_result_table(result))
    path = result_path(args, result)
    if path:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        write_result_json(result, path)
        print(f"result written to {path}")
    return 0 if result["completed"] > 0 else 1
