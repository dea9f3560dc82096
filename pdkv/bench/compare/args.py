"""`pdkv compare`'s flags, their defaults (`--quick` changes some), the workload of one run, the
report's paths and its reading notes."""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import dataclass

from pdkv.bench.compare.topologies import (
    DEFAULT_TOPOLOGIES,
    OFFLOAD_NUM_KV_BLOCKS,
    QUICK_TOPOLOGIES,
)
from pdkv.bench.serve.config import BenchConfig
from pdkv.launch.netns import rate_bytes_per_s
from pdkv.router.pool_topology import POOL_TIERS

DEFAULT_ENGINE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "2048")
QUICK_ENGINE_ARGS = ("--num-kv-blocks", "128", "--max-model-len", "512")
DEFAULT_INPUT_LENS = "128,512"
QUICK_INPUT_LENS = "16,64"
DEFAULT_CONCURRENCY = "1,2"
QUICK_CONCURRENCY = "2"


@dataclass(frozen=True)
class RunPoint:
    """One point of the sweep: prompt tokens, max concurrency (0 = unbounded) and the seed of
    its random prompts (a different seed per point, so every point's cold run sees new prompts);
    `caches` the runs made at this point, in order."""

    input_len: int
    max_concurrency: int
    seed: int
    caches: tuple[str, ...] = ("cold", "hot")


def parse_int_list(text: str, name: str, minimum: int) -> list[int]:
    """"128,1024" -> [128, 1024] (order kept, duplicates dropped).

    Raises:
        ValueError: empty, not integers, or a value below `minimum`.
    """
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < minimum:
        raise ValueError(f"{name} needs integers >= {minimum}, got {text!r}")
    return list(dict.fromkeys(vals))


def sweep(input_lens: list[int], concurrencies: list[int], seed: int,
          hot_longest_only: bool = False) -> list[RunPoint]:
    """Every (prompt length, concurrency) pair, lengths outer, seeds seed, seed+1, ...; cold then
    hot at each, or (`hot_longest_only`, --quick) hot only at the longest prompt."""
    pairs = [(n, c) for n in input_lens for c in concurrencies]
    longest = max(input_lens)
    return [
        RunPoint(
            n, c, seed + i, ("cold", "hot") if n == longest or not hot_longest_only else ("cold",)
        )
        for i, (n, c) in enumerate(pairs)
    ]


def bench_config(args: argparse.Namespace, point: RunPoint) -> BenchConfig:
    """The workload of one sweep point (random prompts; the servers' progress bar is off, the
    run has its own)."""
    return BenchConfig(dataset="random", num_prompts=args.num_prompts, input_len=point.input_len,
                       output_len=args.output_len, request_rate=args.request_rate,
                       max_concurrency=point.max_concurrency or None, seed=point.seed,
                       scrape_metrics=False, disable_tqdm=True)


def report_paths(out: str) -> tuple[str, str, str]:
    """(Markdown file, folder of plots and compare.json) for `--out`: a `.md` file (the folder is
    named after it, e.g. docs/COMPARE.md -> docs/compare/) or a folder (COMPARE.md inside it)."""
    if out.endswith(".md"):
        base = os.path.basename(os.path.splitext(out)[0]).lower()
        folder = os.path.join(os.path.dirname(out), base)
        return out, folder, os.path.join(folder, "compare.json")
    return os.path.join(out, "COMPARE.md"), out, os.path.join(out, "compare.json")


def machine_text() -> str:
    """CPU count, architecture and load average of this machine, for the report."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} CPUs ({platform.machine()}, {platform.system()}), "
            f"load average {load:.1f} at start, Python {platform.python_version()}")


def report_notes(args: argparse.Namespace) -> list[str]:
    """The reading notes printed under the table (the pool and offload ones only when such a
    topology is in the run)."""
    topologies = str(args.topologies)
    pool, offload = "pool" in topologies, "offload" in topologies
    c = args.pool_chunk_size
    hits = ", ".join(f"{n}-token prompts at most {(n - 1) // c * c}" for n in args.input_lens)
    notes = [
        "Each (prompt length, concurrency) point uses its own random prompts (seed, seed+1, ... "
        "in table order), so its cold run finds nothing cached; hot: the same prompts again after "
        "`POST /reset_prefix_cache` on every engine (P included), so only a pool can serve them. "
        "Without a pool, hot repeats cold (a control for noise). Engines start once per topology.",
    ]
    if pool:
        notes.append(
            f"The pool holds whole chunks of {c} tokens and the last prompt token is always "
            f"computed: {hits} tokens can hit."
        )
    notes += [
        "P2P bytes: KV that decode engines pulled from prefill engines"
        + (
            "; pool bytes: read from / written to the pool tier (`" + args.pool_tier + "`)"
            if pool
            else ""
        )
        + "; each the delta of the engines' Prometheus counters over the run.",
        "prefix cache hit rate: per engine, prompt tokens found in its own prefix cache / looked "
        "up; tokens pulled from P"
        + (" or loaded from the pool" if pool else "")
        + " are not prefix cache hits (see the bytes columns).",
        "TTFT phases: the servers' `pdkv_timings` per request, folded into queue, prefill, hold "
        "(P answered → D asked), transfer (KV pull / pool or offload load), D queue, D first step "
        "and residual (HTTP, streaming, client); see pdkv/bench/compare/phases.py.",
        f"threads per engine: {args.threads_per_engine or 'CPUs / engines of the topology'}; "
        f"engine flags: `{' '.join(args.engine_args)}`; before the first run of a topology one "
        "unmeasured warm-up request (a short prompt) goes through the endpoint.",
    ]
    if offload:
        notes.append(
            f"colocated+offload: the engine's KV cache is cut to {OFFLOAD_NUM_KV_BLOCKS} blocks "
            "(the prompts do not fit) with an OffloadingConnector host store; offload wait share = "
            "the copies' exposed wait / the run's duration."
        )
    return notes


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv compare` flags (lengths in tokens, rates in req/s)."""
    parser.add_argument(
        "--topologies",
        default=None,
        help=f"comma-separated (default {DEFAULT_TOPOLOGIES}; --quick: {QUICK_TOPOLOGIES}; "
        "also colocated+offload, colocated2+pool)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny sizes for CI: prompts of {QUICK_INPUT_LENS} tokens (hot only for the "
        f"longest), concurrency {QUICK_CONCURRENCY}, 2 prompts, 4 output tokens, "
        f"{QUICK_TOPOLOGIES}, engines with {' '.join(QUICK_ENGINE_ARGS)}",
    )
    parser.add_argument("--model", default="smollm2", help="alias (smollm2) or HF folder")
    parser.add_argument(
        "--pool-tier",
        choices=POOL_TIERS,
        default="disk",
        help="tier of the +pool topologies (P and D are separate processes: not dram)",
    )
    parser.add_argument("--pool-chunk-size", type=int, default=128, help="pool chunk in tokens")
    parser.add_argument("--kv-transfer", choices=["tcp", "shm", "mooncake"], default="tcp",
                        help="P/D transfer engine")
    parser.add_argument("--routing", default="round_robin",
                        help="proxy routing of the colocatedN topologies (as `pdkv up --routing`)")
    parser.add_argument("--threads-per-engine", type=int, default=0, help="0 = cores / engines")
    parser.add_argument(
        "--input-lens",
        "--input-len",
        dest="input_lens",
        default=None,
        help=f"comma-separated prompt lengths in tokens (default {DEFAULT_INPUT_LENS}: "
        "short and long)",
    )
    parser.add_argument("--output-len", type=int, default=None, help="max_tokens (default 16)")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="requests per run (default 2)"
    )
    parser.add_argument(
        "--max-concurrency",
        default=None,
        help=f"comma-separated concurrency sweep (default {DEFAULT_CONCURRENCY}; 0 = unbounded)",
    )
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="mean arrivals per second (Poisson); inf sends all at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--link-rate",
        default=None,
        help="also run pd with P behind a link capped at this rate (tc syntax, e.g. "
        "1gbit): network namespaces + tbf, root and iproute2 needed (skipped "
        "with a message otherwise)",
    )
    parser.add_argument("--netns-inner", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--from-json", default=None,
                        help="run nothing: rewrite the report (--out) from this compare.json, e.g. "
                             "after a change to the report code; give the measured run's flags")
    parser.add_argument("--out", default="docs/COMPARE.md",
                        help="report: a .md file (plots beside it in a folder) or a folder")
    parser.add_argument(
        "--log-dir", default="pdkv-logs/compare", help="one folder of logs per topology"
    )
    parser.add_argument("--health-timeout", type=float, default=300.0, help="s per topology start")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument(
        "engine_args",
        nargs=argparse.REMAINDER,
        help=f"after --: flags for every engine (default {' '.join(DEFAULT_ENGINE_ARGS)})",
    )
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that `--quick` changes and parse the lists; raises ValueError on bad
    sizes, a bad rate, or a rate with the shm transfer engine."""
    quick = args.quick
    args.topologies = args.topologies or (QUICK_TOPOLOGIES if quick else DEFAULT_TOPOLOGIES)
    args.input_lens = parse_int_list(
        args.input_lens or (QUICK_INPUT_LENS if quick else DEFAULT_INPUT_LENS), "--input-lens", 1
    )
    args.max_concurrency = parse_int_list(
        str(args.max_concurrency) if args.max_concurrency is not None else
        (QUICK_CONCURRENCY if quick else DEFAULT_CONCURRENCY), "--max-concurrency", 0)
    args.output_len = args.output_len or (4 if quick else 16)
    args.num_prompts = args.num_prompts or 2
    args.engine_args = [a for a in args.engine_args if a != "--"] or list(
        QUICK_ENGINE_ARGS if quick else DEFAULT_ENGINE_ARGS)
    if min(args.output_len, args.num_prompts, args.pool_chunk_size) < 1:
        raise ValueError("--output-len, --num-prompts and --pool-chunk-size must be >= 1")
    args.link_rate_bps = rate_bytes_per_s(args.link_rate) if args.link_rate else None
    if args.link_rate and args.kv_transfer == "shm":
        raise ValueError("--link-rate puts P behind a link in its own network namespace (another "
                         "host), where the shm transfer engine refuses it (KV through shared "
                         "memory never crosses the link): use --kv-transfer tcp or mooncake")
    return args
