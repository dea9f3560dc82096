"""`pdkv proxy` flags and entry point (`add_cli_args` / `main`); the app is
`pdkv.router.proxy.build_proxy_app`."""

from __future__ import annotations

import argparse

from pdkv.keepalive import SERVER_KEEPALIVE_S
from pdkv.malloc_tuning import DEFAULT_PROXY_THRESHOLD, pin_mmap_threshold
from pdkv.router.backend_health import DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S, HealthCheckConfig
from pdkv.router.kv_aware import DEFAULT_OVERLAP_WEIGHT, KVAwareConfig
from pdkv.router.kv_index import (
    DEFAULT_MAX_BLOCKS_PER_INSTANCE,
    DEFAULT_MEDIUM_WEIGHTS,
    KVIndexConfig,
)
from pdkv.router.policies import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_MAX_IMBALANCE,
    POLICY_NAMES,
    PrefixAwareConfig,
)
from pdkv.router.pool_record import DEFAULT_MAX_ENTRIES as POOL_RECORD_ENTRIES


def medium_weights(text: str) -> dict[str, float]:
    """`--kv-medium-weights`: "MEDIUM=W,..." -> {MEDIUM: W} (the defaults for media not named).

    Raises:
        argparse.ArgumentTypeError: an item that is not MEDIUM=number.
    """
    weights = dict(DEFAULT_MEDIUM_WEIGHTS)
    for item in (i.strip() for i in text.split(",")):
        name, sep, value = item.partition("=")
        name = name.strip().upper()
        try:
            if not sep or not name:
                raise ValueError
            weight = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not MEDIUM=WEIGHT (e.g. DRAM=0.8)") from None
        if name not in DEFAULT_MEDIUM_WEIGHTS:
            raise argparse.ArgumentTypeError(
                f"unknown medium {name!r}: engines publish "
                + ", ".join(sorted(DEFAULT_MEDIUM_WEIGHTS)))
        weights[name] = weight
    return weights


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv proxy` flags to `parser`."""
    parser.add_argument("--prefill", default="", help="P/D: prefill engine URL(s), comma-separated")
    parser.add_argument("--decode", default="", help="P/D: decode engine URL(s), comma-separated")
    parser.add_argument(
        "--backends",
        default="",
        help="colocated: kv_both instance URL(s), comma-separated; each request goes whole to one",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=8000, help="bind port")
    parser.add_argument("--routing", default="round_robin", choices=sorted(POLICY_NAMES),
                        help="policy within each pool (kv_aware: by the engines' KV events, "
                        "which they publish with --kv-events-config; kv_aware_oracle: the same "
                        "cost over what each engine holds, asked before every decision)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the engines' model folder or alias: prefix_aware computes chunk hashes with its "
        "tokenizer and chat template (without it only token-id prompts have them), and the "
        "length check bounds a chat prompt by its rendered size instead of asking D to count it",
    )
    parser.add_argument(
        "--prefix-aware-max-imbalance",
        type=float,
        default=DEFAULT_MAX_IMBALANCE,
        help="prefix_aware: an instance takes a request for its prefix only while its in-flight "
        "count stays within (1 + this) x the mean (or is 1)",
    )
    parser.add_argument(
        "--prefix-aware-max-entries",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="prefix_aware: most (instance, chunk hash) pairs remembered (LRU; ~200 B each)",
    )
    parser.add_argument(
        "--kv-overlap-score-weight",
        type=float,
        default=DEFAULT_OVERLAP_WEIGHT,
        help="kv_aware: blocks of load one cached prompt block is worth (Dynamo's flag; 0 = "
        "least loaded by blocks)",
    )
    parser.add_argument(
        "--kv-medium-weights",
        type=medium_weights,
        default=None,
        help="kv_aware: worth of a block held in each medium, 0..1, e.g. DRAM=0.9,DISK=0.3; each "
        "medium named overrides its default, the others keep theirs (defaults: "
        + ",".join(f"{k}={v}" for k, v in DEFAULT_MEDIUM_WEIGHTS.items()) + ")",
    )
    parser.add_argument(
        "--kv-index-max-blocks",
        type=int,
        default=DEFAULT_MAX_BLOCKS_PER_INSTANCE,
        help="kv_aware: most block hashes the index keeps per engine and medium (oldest first out)",
    )
    parser.add_argument(
        "--skip-prefill-on-pool-hit",
        action="store_true",
        help="P/D with a shared KV pool: send a request straight to D when the proxy's record "
        "says the pool holds every loadable chunk of its prompt (needs --tokenizer for "
        "text prompts); a wrong belief only costs D a local prefill",
    )
    parser.add_argument(
        "--pool-record-entries",
        type=int,
        default=POOL_RECORD_ENTRIES,
        help="chunk hashes the proxy remembers for --skip-prefill-on-pool-hit (LRU)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="per-leg timeout (s)")
    parser.add_argument(
        "--health-check-interval-secs",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between two probes of every engine's GET /health; an engine that fails "
        "one (or refuses a leg, or times out) gets no requests until a probe succeeds",
    )
    parser.add_argument(
        "--health-check-timeout-secs",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds one health probe may take",
    )
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=DEFAULT_PROXY_THRESHOLD,
        help="bytes: pin glibc's mmap threshold (its dynamic raise after large temporary buffers "
        "makes a long-running proxy's heap keep free space it never returns); 0 leaves glibc's "
        f"default; MALLOC_MMAP_THRESHOLD_ in the environment wins (default: "
        f"{DEFAULT_PROXY_THRESHOLD}, glibc's own starting value)",
    )
    parser.add_argument(
        "--log-level", default="info",
        help="log level of uvicorn (info logs each request) and of the proxy's own log",
    )
    return parser


def main(args: argparse.Namespace) -> int:
    """Run the proxy until interrupted."""
    import logging

    import uvicorn

    from pdkv.router.proxy import build_proxy_app

    # The proxy's own log (502s, backend health) with time and level, as `pdkv serve` logs.
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    malloc = pin_mmap_threshold(args.malloc_mmap_threshold)

    def urls(value: str) -> list[str]:
        return [u for u in value.split(",") if u]

    app = build_proxy_app(
        urls(args.prefill),
        urls(args.decode),
        args.routing,
        args.timeout,
        backend_urls=urls(args.backends),
        tokenizer=args.tokenizer,
        prefix_aware=PrefixAwareConfig(
            args.prefix_aware_max_imbalance, args.prefix_aware_max_entries
        ),
        kv_aware=KVAwareConfig(args.kv_overlap_score_weight),
        kv_index=KVIndexConfig(
            args.kv_medium_weights or dict(DEFAULT_MEDIUM_WEIGHTS),
            max_blocks_per_instance=args.kv_index_max_blocks,
        ),
        skip_prefill_on_pool_hit=args.skip_prefill_on_pool_hit,
        pool_record_entries=args.pool_record_entries,
        health_check=HealthCheckConfig(
            args.health_check_interval_secs, args.health_check_timeout_secs
        ),
    )
    where = (
        f"backends {args.backends}"
        if args.backends
        else f"prefill {args.prefill} decode {args.decode}"
    )
    print(f"pdkv proxy on http://{args.host}:{args.port}: {where} ({args.routing}); "
          f"glibc mmap threshold {malloc}", flush=True)
    # Idle client connections close after SERVER_KEEPALIVE_S, which pdkv's clients undercut.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_keep_alive=int(SERVER_KEEPALIVE_S))
    return 0
