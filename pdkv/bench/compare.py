"""`pdkv compare`: one workload against several local topologies, cold then hot; one report.

For each topology (`colocated`, `pd`, `pd+pool`, `pd+pool+skip` (the proxy's
`--skip-prefill-on-pool-hit`), `colocated+pool`, `colocatedN+pool` / `colocatedN` for N >= 2
instances behind the routing proxy, when the launcher has `--num-instances`) it builds
the processes with `pdkv.router.launcher.build_topology` (the same as `pdkv up`), starts them
with `Topology.start_healthy`, runs `pdkv bench serve`'s `run_serve_bench` twice on the same
random prompts, and stops everything:

* cold: fresh engines and a fresh, empty pool (a disk tier gets its own folder under the log
  directory, deleted when the topology stops; a redis / mooncake tier its own server), so
  nothing is cached anywhere;
* hot: the same prompts again after `POST /reset_prefix_cache` on **every** engine (P included),
  so only the pool can serve them. Without a pool, hot is cold again by construction (a control
  row for the noise); in P/D + pool D loads the pool's whole chunks and pulls the rest from P.

Around each run every engine's `/metrics` is scraped and the deltas give KV bytes per path
(P2P received by D, pool read/written), pool hit tokens and each engine's prefix cache hit rate
(see `compare_report`). Pool saves are asynchronous and engine metrics are refreshed per engine
step, so before the closing scrape an engine whose `pdkv:kv_pool_save_queue_depth` is not 0 gets
a probe (a 1-token completion of a prompt shorter than one pool chunk) until it reads 0 (60 s
deadline); probes fall outside the measured window only in time, their few prompt tokens count
in the prefix cache lookups.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx

from pdkv.bench.compare_report import (
    counter_deltas,
    engine_counters,
    render_report,
    summarize_run,
    write_plots,
)
from pdkv.bench.compare_topologies import (
    DEFAULT_TOPOLOGIES,
    OFFLOAD_CPU_BYTES,
    OFFLOAD_NUM_KV_BLOCKS,
    QUICK_TOPOLOGIES,
    TopologySpec,
    launcher_args,
    launcher_has,
    parse_topologies,
    unsupported_reason,
    with_flag,
)
from pdkv.bench.serve.runner import BenchConfig, run_serve_bench
from pdkv.router import launcher
from pdkv.router.pool_topology import (
    POOL_TIERS,
    PoolServer,
    pool_kv_transfer_config,
    pool_tier_spec,
    start_pool_server,
)

DEFAULT_ENGINE_ARGS = ("--num-kv-blocks", "512", "--max-model-len", "2048")
QUICK_ENGINE_ARGS = ("--num-kv-blocks", "128", "--max-model-len", "512")
DRAIN_TIMEOUT_S = 60.0
RESET_TIMEOUT_S = 60.0
PROBE_PROMPT = "Hi"




def _get_counters(client: httpx.Client, url: str) -> dict[str, float]:
    r = client.get(url + "/metrics")
    r.raise_for_status()
    return engine_counters(r.text)


def scrape_engines(client: httpx.Client, engines: dict[str, str]) -> dict[str, dict[str, float]]:
    """`engine_counters` of every engine ({name: url}). Raises httpx.HTTPError when one fails."""
    return {name: _get_counters(client, url) for name, url in engines.items()}


def drain_pool_saves(client: httpx.Client, engines: dict[str, str], model: str,
                     timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, dict[str, float]]:
    """Scrape until no engine reports queued pool saves, probing those that do (see module doc).

    Returns:
        The last scrape. Raises RuntimeError when saves are still queued at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        counters = scrape_engines(client, engines)
        busy = [n for n, c in counters.items() if c.get("save_queue_depth", 0.0) > 0]
        if not busy:
            return counters
        if time.monotonic() > deadline:
            raise RuntimeError(f"pool saves still queued after {timeout_s:.0f} s on {busy}")
        time.sleep(0.2)
        for name in busy:
            client.post(engines[name] + "/v1/completions",
                        json={"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0})


def warm_up(client: httpx.Client, endpoint: str, model: str, chunk_tokens: int) -> None:
    """One unmeasured request through `endpoint` (a prompt of about chunk_tokens / 2 words, so
    shorter than one pool chunk: nothing reaches the pool) so the cold run does not pay first-use
    costs (connections, allocations). Raises RuntimeError when it fails."""
    prompt = " ".join(["warm"] * max(1, chunk_tokens // 2 - 1))
    r = client.post(endpoint + "/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    if r.status_code != 200:
        raise RuntimeError(f"warm-up request: {r.status_code} {r.text[:200]}")


def reset_prefix_caches(client: httpx.Client, engines: dict[str, str],
                        timeout_s: float = RESET_TIMEOUT_S) -> None:
    """`POST /reset_prefix_cache` on every engine, retrying 409 (blocks still in use) until the
    deadline. Raises RuntimeError when an engine refuses past it or answers another error."""
    deadline = time.monotonic() + timeout_s
    for name, url in engines.items():
        while True:
            r = client.post(url + "/reset_prefix_cache")
            if r.status_code == 200:
                break
            if r.status_code != 409 or time.monotonic() > deadline:
                raise RuntimeError(f"reset_prefix_cache on {name}: {r.status_code} {r.text[:200]}")
            time.sleep(0.5)


def engine_urls(topo: launcher.Topology) -> dict[str, str]:
    """{name: url} of every engine of a started topology (every child but the proxy)."""
    return {c.name: c.url for c in topo.children if c.name != "proxy"}


def _pool_config(args: argparse.Namespace, log_dir: str,
                 services: list[PoolServer]) -> str:
    """A fresh, empty pool for one topology; a started server is appended to `services`."""
    server = start_pool_server(args.pool_tier, log_dir)
    if server is not None:
        services.append(server)
    spec = pool_tier_spec(args.pool_tier, server)
    if args.pool_tier == "disk":
        folder = os.path.join(log_dir, "kvpool")
        shutil.rmtree(folder, ignore_errors=True)
        spec = dict(spec, path=folder)
    return pool_kv_transfer_config(spec, args.pool_chunk_size)


def run_topology(spec: TopologySpec, args: argparse.Namespace, bench: BenchConfig,
                 log: Callable[[str], Any]) -> list[dict[str, Any]]:
    """Start `spec`, run the workload cold then hot, stop it; returns the two summary rows.
    Raises RuntimeError when it does not start or a step fails (everything started is stopped)."""
    log_dir = os.path.join(args.log_dir, spec.name.replace("+", "_"))
    os.makedirs(log_dir, exist_ok=True)
    services: list[PoolServer] = []
    topo = launcher.Topology(services=services)
    try:
        kv_config = _pool_config(args, log_dir, services) if spec.pool else None
        up_args = launcher_args(spec, args, log_dir)
        if spec.offload:  # a KV cache smaller than the working set; evicted blocks go to the host
            kv_config = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"cpu_bytes_to_use": OFFLOAD_CPU_BYTES}})
            up_args.engine_args = with_flag(up_args.engine_args, "--num-kv-blocks", str(OFFLOAD_NUM_KV_BLOCKS))
        topo = launcher.build_topology(up_args, kv_config)
        topo.services = services
        log(f"[{spec.name}] starting {[c.name for c in topo.children]} (logs in {log_dir}/)")
        if not topo.start_healthy(log_dir, args.health_timeout):
            raise RuntimeError(f"{spec.name} did not start; see {log_dir}/")
        engines = engine_urls(topo)
        rows = []
        with httpx.Client(timeout=120.0) as client:
            model = client.get(topo.endpoint + "/v1/models").json()["data"][0]["id"]
            warm_up(client, topo.endpoint, model, args.pool_chunk_size)
            for cache in ("cold", "hot"):
                if cache == "hot":
                    reset_prefix_caches(client, engines)
                before = drain_pool_saves(client, engines, model)
                log(f"[{spec.name}] {cache} run: {bench.num_prompts} prompts of {bench.input_len} tokens")
                result = run_serve_bench(replace(bench, base_url=topo.endpoint, model=model),
                                         log=lambda s: None)
                after = drain_pool_saves(client, engines, model)
                row = summarize_run(spec.name, cache, result, counter_deltas(before, after))
                errors = [e for e in result["errors"] if e]
                if errors:
                    row["errors"] = errors[:3]
                    log(f"[{spec.name}] {cache}: {len(errors)} failed requests, e.g. {errors[0]}")
                rows.append(row)
        return rows
    except httpx.HTTPError as e:
        raise RuntimeError(f"{spec.name}: {e}") from e
    finally:
        topo.stop()
        shutil.rmtree(os.path.join(log_dir, "kvpool"), ignore_errors=True)  # a disk pool: ~KV of the run


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The workload every run uses (random prompts, the same seed everywhere)."""
    return BenchConfig(dataset="random", num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len, request_rate=args.request_rate,
                       max_concurrency=args.max_concurrency or None, seed=args.seed,
                       scrape_metrics=False, disable_tqdm=args.disable_tqdm)


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
    """The reading notes printed under the table."""
    c = args.pool_chunk_size
    n = args.input_len
    return [
        "cold: fresh engines and an empty pool; hot: the same prompts after `POST "
        "/reset_prefix_cache` on every engine (P included), so only the pool can serve them. "
        "Without a pool, hot repeats cold (a control for noise).",
        f"The pool holds whole chunks of {c} tokens and the last prompt token is always computed: "
        f"a {n}-token prompt can hit at most (({n}-1)//{c})*{c} = {(n - 1) // c * c} tokens.",
        "P2P bytes: KV that decode engines pulled from prefill engines; pool bytes: read from / "
        "written to the pool tier (`" + args.pool_tier + "`); each the delta of the engines' "
        "Prometheus counters over the run.",
        "prefix cache hit rate: per engine, prompt tokens found in its own prefix cache / looked "
        "up; tokens loaded from the pool or pulled from P are not prefix cache hits (see pool hit "
        "tokens and the bytes columns).",
        f"threads per engine: {args.threads_per_engine or 'CPUs / engines of the topology'}; "
        f"engine flags: `{' '.join(args.engine_args)}`; before the cold run one unmeasured "
        "warm-up request (a prompt shorter than one pool chunk) goes through the endpoint.",
        f"colocated+offload: the engine's KV cache is cut to {OFFLOAD_NUM_KV_BLOCKS} blocks (the "
        "prompts do not fit) with an OffloadingConnector host store; offload wait share = the "
        "copies' exposed wait / the run's duration.",
    ]


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv compare` flags (lengths in tokens, rates in req/s)."""
    parser.add_argument("--topologies", default=None,
                        help=f"comma-separated (default {DEFAULT_TOPOLOGIES}; --quick: {QUICK_TOPOLOGIES}; "
                             "also colocated+offload)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes for CI: input 256, 2 prompts, 4 output tokens, colocated,pd")
    parser.add_argument("--model", default="smollm2", help="alias (smollm2) or HF folder")
    parser.add_argument("--pool-tier", choices=POOL_TIERS, default="disk",
                        help="tier of the +pool topologies (P and D are separate processes: not dram)")
    parser.add_argument("--pool-chunk-size", type=int, default=128, help="pool chunk in tokens")
    parser.add_argument("--kv-transfer", choices=["tcp", "shm", "mooncake"], default="tcp",
                        help="P/D transfer engine")
    parser.add_argument("--routing", default="round_robin",
                        help="proxy routing of the colocatedN topologies (as `pdkv up --routing`)")
    parser.add_argument("--threads-per-engine", type=int, default=0, help="0 = cores / engines")
    parser.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 1024)")
    parser.add_argument("--output-len", type=int, default=None, help="max_tokens (default 16)")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per run (default 6)")
    parser.add_argument("--max-concurrency", type=int, default=2, help="0 = unbounded")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="mean arrivals per second (Poisson); inf sends all at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--out", default="docs/COMPARE.md",
                        help="report: a .md file (plots beside it in a folder) or a folder")
    parser.add_argument("--log-dir", default="pdkv-logs/compare", help="one folder of logs per topology")
    parser.add_argument("--health-timeout", type=float, default=300.0, help="s per topology start")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    parser.add_argument("engine_args", nargs=argparse.REMAINDER,
                        help=f"after --: flags for every engine (default {' '.join(DEFAULT_ENGINE_ARGS)})")
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that `--quick` changes; raises ValueError on bad sizes."""
    quick = args.quick
    args.topologies = args.topologies or (QUICK_TOPOLOGIES if quick else DEFAULT_TOPOLOGIES)
    args.input_len = args.input_len or (256 if quick else 1024)
    args.output_len = args.output_len or (4 if quick else 16)
    args.num_prompts = args.num_prompts or (2 if quick else 6)
    args.engine_args = [a for a in args.engine_args if a != "--"] or list(
        QUICK_ENGINE_ARGS if quick else DEFAULT_ENGINE_ARGS)
    if min(args.input_len, args.output_len, args.num_prompts, args.pool_chunk_size) < 1:
        raise ValueError("--input-len, --output-len, --num-prompts and --pool-chunk-size must be >= 1")
    return args


def main(args: argparse.Namespace) -> int:
    """Run every topology, write and print the report.

    Returns:
        0, or 1 when a topology failed to run or a request failed (the report is still written).
    """
    args = resolve_args(args)
    specs = parse_topologies(args.topologies)
    command = "pdkv " + shlex.join(sys.argv[1:])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = machine_text()
    bench = bench_config(args)
    instances_ok = launcher_has("num_instances")
    skip_ok = launcher_has("skip_prefill_on_pool_hit")
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    failed = False
    t0 = time.monotonic()
    for i, spec in enumerate(specs, 1):
        reason = unsupported_reason(spec, args.pool_tier, instances_ok, skip_ok)
        if reason is not None:
            print(f"[{i}/{len(specs)}] skip {spec.name}: {reason}", flush=True)
            skipped[spec.name] = reason
            continue
        print(f"[{i}/{len(specs)}] {spec.name} ({time.monotonic() - t0:.0f} s so far)", flush=True)
        try:
            new = run_topology(spec, args, bench, lambda s: print(s, flush=True))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            skipped[spec.name] = f"failed: {e}"
            failed = True
            continue
        failed = failed or any(r["failed"] for r in new)
        rows.extend(new)
    md_path, plot_dir, json_path = report_paths(args.out)
    plots: list[str] = []
    plot_note = None
    if args.no_plots:
        plot_note = "Plots: off (--no-plots)."
    elif rows:
        prefix = os.path.relpath(plot_dir, os.path.dirname(md_path) or ".")
        try:
            names = write_plots(rows, plot_dir, "compare_")
            plots = [os.path.normpath(os.path.join(prefix, n)) for n in names]
        except ImportError:
            plot_note = "Plots: skipped (matplotlib is not installed; `pip install matplotlib`)."
    workload = (f"random prompts of {args.input_len} tokens, {args.output_len} output tokens, "
                f"{args.num_prompts} prompts per run, max concurrency {args.max_concurrency or 'unbounded'}, "
                f"request rate {args.request_rate}, seed {args.seed}; model {args.model}; "
                f"pool tier {args.pool_tier}, chunk {args.pool_chunk_size} tokens; transfer {args.kv_transfer}; "
                f"total {time.monotonic() - t0:.0f} s")
    text = render_report(rows, command=command, date=date, machine=machine, workload=workload,
                         notes=report_notes(args), skipped=skipped, plots=plots, plot_note=plot_note)
    os.makedirs(os.path.dirname(md_path) or ".", exist_ok=True)
    os.makedirs(plot_dir, exist_ok=True)
    with open(md_path, "w") as f:
        f.write(text)
    with open(json_path, "w") as f:
        json.dump({"command": command, "date": date, "machine": machine, "rows": rows,
                   "skipped": skipped}, f, indent=1, default=str)
    print(text)
    print(f"report written to {md_path}")
    return 1 if failed or not rows else 0
