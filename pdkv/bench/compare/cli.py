"""`pdkv compare`: one workload against several local topologies, cold then hot; one report.

For each topology (`colocated`, `pd`, `pd+pool`, `pd+pool+skip` (the proxy's
`--skip-prefill-on-pool-hit`), `colocated+pool`, `colocatedN+pool` / `colocatedN` for N >= 2
instances behind the routing proxy, when the launcher has `--num-instances`) it builds
the processes with `pdkv.launch.launcher.build_topology` (the same as `pdkv up`), starts them
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
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import httpx

from pdkv.bench.compare.args import RunPoint, bench_config, report_paths, resolve_args, sweep
from pdkv.bench.compare.args import add_cli_args as add_cli_args
from pdkv.bench.compare.netns import (
    NETNS_PREFIX,
    cap_topology,
    capped_name,
    run_inside,
    strip_inner,
)
from pdkv.bench.compare.output import rerender, write_report
from pdkv.bench.compare.phases import latency_samples, phase_groups, raw_phase_means
from pdkv.bench.compare.report import counter_deltas, engine_counters, summarize_run
from pdkv.bench.compare.topologies import (
    OFFLOAD_CPU_BYTES,
    OFFLOAD_NUM_KV_BLOCKS,
    TopologySpec,
    launcher_args,
    launcher_has,
    parse_topologies,
    unsupported_reason,
    with_flag,
)
from pdkv.bench.netns import NetnsPair
from pdkv.bench.serve.runner import run_serve_bench
from pdkv.launch import launcher
from pdkv.launch.netns import unavailable_reason
from pdkv.launch.services import start_pool_server
from pdkv.router.pool_topology import PoolServer, pool_kv_transfer_config, pool_tier_spec

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
            client.post(
                engines[name] + "/v1/completions",
                json={"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0},
            )


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


def run_topology(
    spec: TopologySpec,
    args: argparse.Namespace,
    points: Sequence[RunPoint],
    log: Callable[[str], Any],
    step: Callable[[str], Any] = lambda s: None,
) -> list[dict[str, Any]]:
    """Start `spec`, run every sweep point cold then hot, stop it; returns the summary rows
    (`summarize_run`'s keys plus input_len, max_concurrency, link_rate, phase_groups, raw_phases,
    tpots_ms, itls_ms). `step(label)` is called before each run (the progress bar).
    Raises RuntimeError when it does not start or a step fails (everything started is stopped)."""
    log_dir = os.path.join(args.log_dir, spec.name.replace("+", "_").replace("@", "_"))
    os.makedirs(log_dir, exist_ok=True)
    services: list[PoolServer] = []
    topo = launcher.Topology(services=services)
    try:
        kv_config = _pool_config(args, log_dir, services) if spec.pool else None
        up_args = launcher_args(spec, args, log_dir)
        if spec.offload:  # a KV cache smaller than the working set; evicted blocks go to the host
            kv_config = json.dumps(
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": OFFLOAD_CPU_BYTES},
                }
            )
            up_args.engine_args = with_flag(
                up_args.engine_args, "--num-kv-blocks", str(OFFLOAD_NUM_KV_BLOCKS)
            )
        topo = launcher.build_topology(up_args, kv_config)
        topo.services = services
        if spec.link_rate:
            cap_topology(
                topo, NetnsPair(prefix=args.netns_inner or NETNS_PREFIX, rate=spec.link_rate)
            )
        log(f"[{spec.name}] starting {[c.name for c in topo.children]} (logs in {log_dir}/)")
        if not topo.start_healthy(log_dir, args.health_timeout):
            raise RuntimeError(f"{spec.name} did not start; see {log_dir}/")
        engines = engine_urls(topo)
        rows = []
        with httpx.Client(timeout=120.0) as client:
            model = client.get(topo.endpoint + "/v1/models").json()["data"][0]["id"]
            warm_up(client, topo.endpoint, model, args.pool_chunk_size)
            for point in points:
                bench = bench_config(args, point)
                for cache in point.caches:
                    step(
                        f"{spec.name} {point.input_len} tok c{point.max_concurrency or 'inf'} "
                        f"{cache}"
                    )
                    if cache == "hot":
                        reset_prefix_caches(client, engines)
                    before = drain_pool_saves(client, engines, model)
                    result = run_serve_bench(replace(bench, base_url=topo.endpoint, model=model),
                                             log=lambda s: None)
                    after = drain_pool_saves(client, engines, model)
                    row = summarize_run(spec.name, cache, result, counter_deltas(before, after))
                    row.update(
                        input_len=point.input_len,
                        max_concurrency=point.max_concurrency,
                        link_rate=spec.link_rate,
                        phase_groups=phase_groups(result.get("ttft_phases")),
                        raw_phases=raw_phase_means(result.get("ttft_phases")),
                        **latency_samples(result),
                    )
                    errors = [e for e in result["errors"] if e]
                    if errors:
                        row["errors"] = errors[:3]
                        log(f"[{spec.name}] {point.input_len} tokens {cache}: {len(errors)} failed "
                            f"requests, e.g. {errors[0]}")
                    rows.append(row)
        return rows
    except httpx.HTTPError as e:
        raise RuntimeError(f"{spec.name}: {e}") from e
    finally:
        topo.stop()
        shutil.rmtree(
            os.path.join(log_dir, "kvpool"), ignore_errors=True
        )  # a disk pool: ~KV of the run


class _Progress:
    """One tqdm bar over every run of the comparison; the label names topology / prompt tokens /
    concurrency / cache of the run in progress."""

    def __init__(self, total: int, disable: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, disable=disable, unit="run", dynamic_ncols=True)
        self.started = False

    def __call__(self, label: str) -> None:
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_description(label)
        self.bar.refresh()

    def write(self, text: str) -> None:
        self.bar.write(text) if not self.bar.disable else print(text, flush=True)

    def close(self) -> None:
        if self.started:
            self.bar.update(1)
        self.bar.close()


def _argv_after_compare() -> list[str]:
    argv = sys.argv[1:]
    return argv[argv.index("compare") + 1:] if "compare" in argv else argv


def main(args: argparse.Namespace) -> int:
    """Run every topology over the sweep, write and print the report.

    Returns:
        0, or 1 when a topology failed to run or a request failed (the report is still written);
        with `--link-rate` (outside the namespaces) the exit code of the run inside them.
    """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop children, namespaces
    args = resolve_args(args)
    after = _argv_after_compare()
    if args.from_json:
        text = rerender(args, args.from_json, ("pdkv compare " + shlex.join(after)).strip())
        print(text)
        return 0
    specs = parse_topologies(args.topologies)
    skipped: dict[str, str] = {}
    if args.link_rate:
        reason = unavailable_reason()
        if reason is None and not args.netns_inner:
            return run_inside(sys.executable, after, args.link_rate)
        if reason is None:
            specs.append(
                TopologySpec(capped_name(args.link_rate), "pd", False, link_rate=args.link_rate)
            )
        else:
            print(
                f"pdkv compare --link-rate {args.link_rate}: skipped the capped link: {reason}",
                flush=True,
            )
            skipped[capped_name(args.link_rate)] = f"skipped: {reason}"
    command = ("pdkv compare " + shlex.join(strip_inner(after))).strip()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    points = sweep(args.input_lens, args.max_concurrency, args.seed, hot_longest_only=args.quick)
    instances_ok = launcher_has("num_instances")
    skip_ok = launcher_has("skip_prefill_on_pool_hit")
    runnable = []
    for spec in specs:
        reason = unsupported_reason(spec, args.pool_tier, instances_ok, skip_ok)
        if reason is not None:
            print(f"skip {spec.name}: {reason}", flush=True)
            skipped[spec.name] = reason
        else:
            runnable.append(spec)
    rows: list[dict[str, Any]] = []
    failed = False
    t0 = time.monotonic()
    progress = _Progress(sum(len(p.caches) for p in points) * len(runnable), args.disable_tqdm)
    try:
        for i, spec in enumerate(runnable, 1):
            progress.write(
                f"[{i}/{len(runnable)}] {spec.name} ({time.monotonic() - t0:.0f} s so far)"
            )
            try:
                new = run_topology(spec, args, points, progress.write, progress)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                skipped[spec.name] = f"failed: {e}"
                failed = True
                continue
            failed = failed or any(r["failed"] for r in new)
            rows.extend(new)
    finally:
        progress.close()
    text = write_report(rows, args, command=command, date=date, skipped=skipped,
                        total_s=time.monotonic() - t0)
    print(text)
    print(f"report written to {report_paths(args.out)[0]}")
    return 1 if failed or not rows else 0
