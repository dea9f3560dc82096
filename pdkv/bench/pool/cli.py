"""KV pool benchmark: TTFT of a long prompt cold vs hot, one pool tier at a time.

For each tier (dram, disk, redis, mooncake) an in-process engine with a KVPoolConnector
(kv_both) whose pool has that single tier runs `repeats` distinct random-token prompts: each
once cold (never seen), then, after the pool's save queue is flushed and the engine's own prefix
cache reset, once hot (its full chunks come from the pool). The engine without a pool runs the
same prompts in the same run as the peer. Reported per tier: median cold and hot TTFT, hot/cold,
hit tokens (a full hit is ((n-1)//C)*C: the last prompt token is never loaded), load bandwidth
(bytes read / summed pool get seconds, from the scheduler's `pool:<tier>:bytes_read` counter and
`pool:<tier>:load_seconds` samples) and issue 8's targets (dram hot <= 10 % of cold, disk <= 25 %).
Greedy outputs must be token-identical cold, hot and without a pool.

Usage::

    from pdkv.bench.pool.cli import run_pool_bench
    result = run_pool_bench(tiers=("dram", "disk"), chunk_size=256, prompt_len=2049, repeats=3)

or from the CLI: `pdkv bench pool --tiers dram,disk,redis,mooncake`. `pdkv bench pool
--disk-fsync` measures instead what the disk tier's fsync costs per chunk written
(`pdkv.bench.pool.fsync`, no engine).
"""

# Layout: `pool_runner` (engines, tiers and their servers, the run), `pool_report` (summary,
# targets, table); this module holds the CLI (`add_cli_args` / `main`).

from __future__ import annotations

import argparse
import json

from pdkv.bench.pool.fsync import SMOLLM2_BYTES_PER_TOKEN, format_fsync, measure_disk_fsync
from pdkv.bench.pool.report import TARGETS, format_table, max_loadable_tokens, summarize_tier
from pdkv.bench.pool.runner import TIERS, run_pool_bench
from pdkv.bench.results import jsonable, write_result_json

__all__ = ["TARGETS", "TIERS", "add_cli_args", "format_table", "main", "max_loadable_tokens",
           "run_pool_bench", "summarize_tier"]


def _parse_tiers(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in TIERS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"tiers must be from {','.join(TIERS)}, got {text!r}")
    return vals


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv bench pool` flags to `parser`."""
    parser.add_argument(
        "--tiers",
        type=_parse_tiers,
        default="dram,disk",
        help="comma-separated tiers, each measured alone, from dram,disk,redis,mooncake "
        "(redis/mooncake start their server; skipped when it is not installed)",
    )
    parser.add_argument("--chunk-size", type=int, default=256, help="pool chunk (tokens)")
    parser.add_argument("--prompt-len", type=int, default=2049,
                        help="prompt tokens; a full hit is ((n-1)//chunk)*chunk tokens")
    parser.add_argument(
        "--repeats", type=int, default=3, help="distinct prompts per tier (medians)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="greedy output tokens per request"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random-token prompts")
    parser.add_argument("--model", default="smollm2", help="alias (smollm2) or HF folder")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--work-dir", default=None,
                        help="where the disk tier writes (unset: a temporary directory, removed)")
    parser.add_argument(
        "--disk-fsync", action="store_true",
        help="only measure the disk tier's put time with fsync on vs off (no engine): "
        "--fsync-writes puts of one chunk value each, into --work-dir",
    )
    parser.add_argument("--fsync-writes", type=int, default=20,
                        help="puts per fsync setting (--disk-fsync)")
    parser.add_argument(
        "--fsync-value-bytes", type=int, default=None,
        help="bytes per put (--disk-fsync; default: a SmolLM2 fp32 chunk, chunk-size x "
        f"{SMOLLM2_BYTES_PER_TOKEN} B)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the result as JSON instead of the table"
    )
    parser.add_argument(
        "--result-json", default=None, help="also write the result dict to this file"
    )
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed `add_cli_args` flags.

    Returns:
        Process exit code: 0, or 1 when a measured tier did not hit fully or its outputs were
        not token-identical (the TTFT targets are only reported). `--disk-fsync`: 0.
    """
    if args.disk_fsync:
        value_bytes = args.fsync_value_bytes or args.chunk_size * SMOLLM2_BYTES_PER_TOKEN
        fsync_result = measure_disk_fsync(args.work_dir, value_bytes, args.fsync_writes)
        print(json.dumps(fsync_result, indent=2) if args.json else format_fsync(fsync_result))
        if args.result_json:
            write_result_json(fsync_result, args.result_json)
        return 0
    result = run_pool_bench(
        tiers=tuple(args.tiers), chunk_size=args.chunk_size, prompt_len=args.prompt_len,
        repeats=args.repeats, max_tokens=args.max_tokens, seed=args.seed, model=args.model,
        block_size=args.block_size, work_dir=args.work_dir, verbose=not args.json,
    )
    if args.json:
        print(json.dumps(jsonable(result), indent=2))
    if args.result_json:
        write_result_json(result, args.result_json)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(add_cli_args(argparse.ArgumentParser(description=__doc__)).parse_args()))
