"""`pdkv up`: start a whole local topology (colocated, or P/D with a proxy) as processes on free
ports, wait until healthy, print the endpoint, stop everything on Ctrl-C or when a child dies.
With `--pool TIER` (colocated) the engine gets a KVPoolConnector and the server the tier needs
(redis-server, or mooncake_master plus its store process) is started first and stopped last.
`--mode colocated --num-instances N` (N > 1) starts N kv_both instances (sharing the pool, if any)
behind a proxy in colocated mode that routes with `--routing`. `--deploy FILE` starts a deployment
file's hosts and roles instead (pdkv.launch.deploy_run; `--netns`, `--print-commands`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pdkv.launch.services import start_pool_server
from pdkv.launch.topology import (
    Child,
    Topology,
    engine_world_size,
    stop_on_signals,
    supervise,
)
from pdkv.ports import free_port
from pdkv.router.policies import DEFAULT_MAX_IMBALANCE, KV_EVENT_POLICIES, POLICY_NAMES
from pdkv.router.pool_topology import (
    DEFAULT_CHUNK_SIZE,
    POOL_TIERS,
    PoolServer,
    pd_kv_transfer_config,
    pool_kv_transfer_config,
    pool_tier_spec,
)


def build_topology(args: argparse.Namespace, kv_transfer_config: str | None = None) -> Topology:
    """Commands for the chosen mode; engine flags after `--` are passed to every engine;
    `kv_transfer_config` (a KV pool's) goes to the engine (colocated) or, under P/D, into a
    MultiConnector on every engine: P = [P2P producer, pool producer], D = [pool consumer, P2P
    consumer]."""
    host = "127.0.0.1"
    py = [sys.executable, "-m", "pdkv.cli"]
    events = ["--kv-events-config", KV_EVENTS_ON] if args.routing in KV_EVENT_POLICIES else []
    engine_flags = ["--model", args.model, *events, *args.engine_args]  # a user's flag wins
    if getattr(args, "disable_log_requests", False):
        engine_flags.append("--disable-log-requests")
    n_engines = (
        args.num_instances if args.mode == "colocated" else args.num_prefill + args.num_decode
    )
    threads = args.threads_per_engine or max(1, (os.cpu_count() or 1) // n_engines)
    env = dict(os.environ, PDKV_NUM_THREADS=str(threads))
    topo = Topology()
    taken: set[int] = set()
    if args.mode == "colocated":
        kv = ["--kv-transfer-config", kv_transfer_config] if kv_transfer_config else []
        if args.num_instances == 1:
            port = args.port or free_port(taken)
            topo.children.append(Child("engine", f"http://{host}:{port}", py + [
                "serve", *engine_flags, "--host", host, "--port", str(port), *kv], env,
                role="colocated engine" + (" (kv_both, pool)" if kv else ""), threads=threads))
            topo.endpoint = f"http://{host}:{port}"
            return topo
        urls = []
        for i in range(args.num_instances):
            port = free_port(taken)
            urls.append(f"http://{host}:{port}")
            topo.children.append(Child(f"engine{i}", urls[-1], py + [
                "serve", *engine_flags, "--host", host, "--port", str(port), *kv], env,
                role="colocated engine" + (" (kv_both, pool)" if kv else ""), threads=threads))
        port = args.port or free_port(taken)
        topo.children.append(Child("proxy", f"http://{host}:{port}", py + [
            "proxy", "--backends", ",".join(urls), "--host", host, "--port", str(port),
            *_routing_flags(args)], dict(os.environ), role=f"proxy (colocated, {args.routing})"))
        topo.endpoint = f"http://{host}:{port}"
        return topo
    prefill_urls: list[str] = []
    decode_urls: list[str] = []
    push = " push" if getattr(args, "transfer_mode", "pull") == "push" else ""
    for role, count, urls in (("kv_producer", args.num_prefill, prefill_urls),
                              ("kv_consumer", args.num_decode, decode_urls)):
        for i in range(count):
            port = free_port(taken)
            extra: dict[str, object] = {"transfer": args.kv_transfer}
            if push:
                extra["transfer_mode"] = "push"
            if role == "kv_producer":  # every listening port is chosen here, none ephemeral
                ranks = engine_world_size(args.engine_args)  # rank r listens on port + r
                extra.update(
                    kv_port=free_port(taken, count=ranks),
                    transfer_port=free_port(taken, count=ranks),
                )
            cfg = pd_kv_transfer_config(role, extra, args.kv_load_failure_policy,
                                        kv_transfer_config)
            name = ("prefill" if role == "kv_producer" else "decode") + str(i)
            what = "prefill (kv_producer)" if role == "kv_producer" else "decode (kv_consumer)"
            topo.children.append(Child(name, f"http://{host}:{port}", py + [
                "serve", *engine_flags, "--host", host, "--port", str(port),
                "--kv-transfer-config", json.dumps(cfg)], env,
                role=what + (", pool" if kv_transfer_config else ""), threads=threads))
            urls.append(f"http://{host}:{port}")
    port = args.port or free_port(taken)
    topo.children.append(
        Child(
            "proxy",
            f"http://{host}:{port}",
            py
            + [
                "proxy",
                "--prefill",
                ",".join(prefill_urls),
                "--decode",
                ",".join(decode_urls),
                "--host",
                host,
                "--port",
                str(port),
                *_routing_flags(args),
                *_skip_flags(args),
            ],
            dict(os.environ),
            role=f"proxy (P/D{push}, {args.routing})",
        )
    )
    topo.endpoint = f"http://{host}:{port}"
    return topo


KV_EVENTS_ON = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": "tcp://127.0.0.1:0",
                           "replay_endpoint": "tcp://127.0.0.1:0"})
"""The engines' --kv-events-config under `--routing kv_aware` (and the oracle): loopback, ports
chosen by the system (the proxy reads them from each engine's GET /kv_events)."""


def _skip_flags(args: argparse.Namespace) -> list[str]:
    """--skip-prefill-on-pool-hit for the P/D proxy."""
    skip = getattr(args, "skip_prefill_on_pool_hit", False)
    return ["--skip-prefill-on-pool-hit"] if skip else []


def _routing_flags(args: argparse.Namespace) -> list[str]:
    """The proxy's routing flags, with the engines' model as its tokenizer (prefix_aware's
    hashes, skip-prefill's record, the chat prompt bound of the length check)."""
    flags = ["--routing", args.routing, "--tokenizer", args.model]
    if args.routing == "prefix_aware":
        flags += ["--prefix-aware-max-imbalance", str(args.prefix_aware_max_imbalance)]
    return flags


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError for a combination `pdkv up` cannot start (naming what can)."""
    for flag in ("netns", "print_commands"):
        if getattr(args, flag, False) and getattr(args, "deploy", None) is None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --deploy FILE")
    if args.num_prefill < 1 or args.num_decode < 1:
        raise ValueError("--num-prefill and --num-decode must be >= 1")
    if args.num_instances < 1:
        raise ValueError("--num-instances must be >= 1")
    if args.num_instances > 1 and args.mode != "colocated":
        raise ValueError(
            "--num-instances is for --mode colocated (P/D: --num-prefill / --num-decode)"
        )
    if getattr(args, "skip_prefill_on_pool_hit", False) and (
        args.mode != "pd" or args.pool is None
    ):
        raise ValueError(
            "--skip-prefill-on-pool-hit needs --mode pd with --pool disk|redis|mooncake"
        )
    if args.pool == "dram" and args.mode == "pd":
        raise ValueError("--pool dram lives inside one process; P and D are separate processes: "
                         "use --pool disk, redis or mooncake with --mode pd")
    if args.pool == "dram" and args.num_instances > 1:
        raise ValueError("a dram pool lives inside one engine process and cannot be shared by "
                         f"{args.num_instances} instances: use --pool disk, redis or mooncake")
    if getattr(args, "transfer_mode", "pull") == "push" and args.mode != "pd":
        raise ValueError("--transfer-mode push is for --mode pd")
    own = any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=")
              for a in getattr(args, "engine_args", []) or [])
    if own and (args.mode == "pd" or args.pool is not None):
        raise ValueError(
            "pdkv up sets the engines' --kv-transfer-config itself with --mode pd or --pool "
            "(P2PConnector over --kv-transfer, pools with --pool): leave it out of the engine "
            "flags after --, or start the engines with pdkv serve"
        )


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="smollm2", help="alias (smollm2) or HF folder")
    parser.add_argument("--mode", choices=["colocated", "pd"], default="pd",
                        help="one engine, or prefill + decode engines behind a proxy")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill engines (pd)")
    parser.add_argument("--num-decode", type=int, default=1, help="decode engines (pd)")
    parser.add_argument(
        "--skip-prefill-on-pool-hit",
        action="store_true",
        help="pd with --pool: the proxy sends a prompt straight to D when (by its record) the "
        "pool holds every loadable chunk of it",
    )
    parser.add_argument(
        "--num-instances",
        type=int,
        default=1,
        help="colocated: kv_both instances; more than 1 puts a proxy in front (--routing) and "
        "shares the --pool among them",
    )
    parser.add_argument(
        "--kv-transfer",
        choices=["tcp", "shm", "mooncake"],
        default="tcp",
        help="transfer engine (mooncake needs the optional package and libibverbs1)",
    )
    parser.add_argument(
        "--transfer-mode",
        choices=["pull", "push"],
        default="pull",
        help="pd: how KV moves from P to D (kv_connector_extra_config.transfer_mode): pull (D "
        "reads P's blocks after P's prefill) or push (D first reserves the blocks; P writes each "
        "layer into them as it computes; tcp, shm or mooncake, tp 1; with --pool a pool hit on "
        "D shrinks what P writes; docs/PUSH.md)",
    )
    parser.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"], default="fail",
                        help="what a decode engine does when a KV pull fails")
    parser.add_argument(
        "--pool",
        choices=POOL_TIERS,
        default=None,
        help="a KV pool with this tier (colocated: KVPoolConnector kv_both; pd: a MultiConnector "
        "on P and D, not dram): dram 1 GiB; disk 4 GiB under $PDKV_CACHE/kvpool, kept "
        "across runs; redis / mooncake (1 GiB) start their server on a free loopback port, "
        "stopped with the rest",
    )
    parser.add_argument("--pool-chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                        help="pool chunk in tokens (a multiple of the block size)")
    parser.add_argument(
        "--routing",
        choices=sorted(POLICY_NAMES),
        default="round_robin",
        help="proxy routing within each pool (prefix_aware: the instance whose prefix the proxy "
        "routed there before, bounded by load; kv_aware: the engines publish KV events on "
        "loopback and the proxy scores each by what it holds against its load; "
        "kv_aware_oracle: the same over what each engine holds, asked before every decision)",
    )
    parser.add_argument(
        "--prefix-aware-max-imbalance",
        type=float,
        default=DEFAULT_MAX_IMBALANCE,
        help="prefix_aware: most in-flight share above the mean an instance takes for its prefix",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="the proxy's (pd, colocated with N > 1) or the server's (colocated); 0 = free",
    )
    parser.add_argument("--threads-per-engine", type=int, default=0, help="0 = cores / engines")
    parser.add_argument("--log-dir", default="pdkv-logs", help="one log file per process")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="engines write no line per finished request")
    parser.add_argument("--health-timeout", type=float, default=300.0)
    parser.add_argument(
        "--demo",
        action="store_true",
        help="send demo chat prompts through the endpoint, print answers and timings, then stop",
    )
    parser.add_argument(
        "--deploy",
        default=None,
        metavar="FILE",
        help="start the deployment described in this TOML file (hosts, roles, links; "
        "docs/ACROSS_HOSTS.md) instead of --mode: every host at 127.0.0.1 on free ports, or "
        "with --netns one network namespace per host",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="--deploy: each host a network namespace with its own address on a bridge, its link "
        "shaped with tc as the file says (root and iproute2 needed); removed on exit",
    )
    parser.add_argument(
        "--print-commands",
        action="store_true",
        help="--deploy: print per host the commands to run on real machines; start nothing",
    )
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help="after --: flags for every engine (e.g. -- --num-kv-blocks 512)")
    return parser


def main(args: argparse.Namespace) -> int:
    if getattr(args, "deploy", None) is not None:
        from pdkv.launch.deploy_run import main as deploy_main

        return deploy_main(args)
    check_args(args)
    args.engine_args = [a for a in args.engine_args if a != "--"]
    stop_on_signals()
    services: list[PoolServer] = []
    topo = Topology(services=services)  # until the real one is built: stops what started so far
    try:
        kv_config = None
        if args.pool is not None:
            os.makedirs(args.log_dir, exist_ok=True)
            try:
                server = start_pool_server(args.pool, args.log_dir)
            except RuntimeError as e:
                print(f"error: pool server for {args.pool}: {e}", file=sys.stderr)
                return 1
            if server is not None:
                services.append(server)
            kv_config = pool_kv_transfer_config(
                pool_tier_spec(args.pool, server), args.pool_chunk_size
            )
            print(
                f"pool: {args.pool}"
                + (f" at {server.address} (pids {server.pids})" if server else "")
                + f", chunk {args.pool_chunk_size} tokens",
                flush=True,
            )
        topo = build_topology(args, kv_config)
        topo.services = services

        def demo(topo: Topology) -> int:
            from pdkv.launch.demo import run_demo

            run_demo(
                topo.endpoint,
                [c.url for c in topo.children if c.name.startswith("decode")],
                args.model,
            )
            return 0

        return supervise(topo, args.log_dir, args.health_timeout, demo if args.demo else None)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    finally:
        topo.stop()
