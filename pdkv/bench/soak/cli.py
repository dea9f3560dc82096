"""`pdkv bench soak`: mixed load for a set duration on two topologies at once, sampled all along,
judged at the end.

Starts its own processes on free loopback ports: a redis-server (the KV pool), a P/D pair with a
MultiConnector on each engine (P: P2P producer + pool producer; D: pool consumer + P2P consumer,
as `pdkv up --mode pd --pool redis` builds it) behind one proxy, and a colocated engine on the same
pool behind a second proxy (a proxy serves one topology). Then:

1. references: each greedy item once on the idle colocated engine (log-probabilities asked for);
2. load: `--concurrency` clients send a seeded stream of requests to both proxies for
   `--duration` seconds: chat and completions, streamed or not, greedy or sampled, n up to 3 (on
   the colocated proxy), guided_choice and json_schema outputs, short and long prompts (long ones
   share a prefix), and `--cancel-fraction` cancelled by the client;
3. a sampler records every process's RSS, open fds and threads, every engine's free blocks, queue
   depths and pool gauges, and redis' used memory every `--sample-interval` s (samples.jsonl);
4. drain: the clients stop, the engines go idle;
5. checks (pdkv.bench.soak.checks): no 5xx / stream error / missing answer and no 4xx; every greedy
   answer equal to its reference (a divergence at a near tie is counted apart); structured answers
   valid; free blocks back to the start value; open fds at the idle end within a slack of the idle
   start (the idle end waits up to lease + margin for the load's keep-alive connections to close:
   `wait_idle`); RSS slope after the warm-up under the limit (judged when that window is long
   enough).

Prints the summary (and writes summary.json, which describes each request that failed: its kind,
status, error text and when it was sent) and the plot (soak.png) into `--output-dir`; exits 0
when every check passed, 1 when one failed, 2 when the topology did not start. Its clients drop
an idle connection before the proxies would close it (pdkv.keepalive).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import httpx

from pdkv.bench.soak.checks import (
    Limits,
    Reference,
    bad_structured,
    compare_greedy,
    failures,
    rss_slopes,
    scan_log,
)
from pdkv.bench.soak.client import Outcome, Tally, send
from pdkv.bench.soak.plot import plot_samples
from pdkv.bench.soak.sampler import Sampler, engine_metrics
from pdkv.bench.soak.workload import Item, SoakRequest, make_items, next_request, request_body
from pdkv.bench.soak.workload import token_gaps as _token_gaps
from pdkv.keepalive import client_limits
from pdkv.launch.topology import Child, Topology
from pdkv.ports import free_port
from pdkv.router.pool_topology import DEFAULT_CHUNK_SIZE

HOST = "127.0.0.1"
MAX_FAILED_LISTED = 50  # failed requests summary.json describes one by one (the first ones)
ENGINES = ("prefill", "decode", "colocated")
PROXIES = ("proxy_pd", "proxy_colocated")


def build_soak_topology(args: argparse.Namespace, redis_url: str) -> Topology:
    """prefill, decode, colocated, proxy_pd and proxy_colocated, in that order; every port is
    chosen here from one set, so none collides. The engines write their whole KV cache at start
    (--kv-cache-prefault): otherwise its pages enter the RSS as blocks are first written, which
    goes on long after the warm-up (a prefill engine fills only the part of its last block that
    its prompt reaches) and would read as growth the RSS slope check cannot tell from a leak."""
    py = [sys.executable, "-m", "pdkv.cli"]
    engine = ["serve", "--model", args.model, "--num-kv-blocks", str(args.num_kv_blocks),
              "--max-model-len", str(args.max_model_len), "--host", HOST, "--log-level", "warning",
              "--disable-log-requests", "--kv-cache-prefault"]
    env = dict(os.environ, PDKV_NUM_THREADS=str(args.threads_per_engine))
    taken: set[int] = set()
    pool = {"kv_connector": "KVPoolConnector",
            "kv_connector_extra_config": {"chunk_size": DEFAULT_CHUNK_SIZE,
                                          "tiers": [{"name": "redis", "url": redis_url}]}}
    p2p_p = {"kv_connector": "P2PConnector", "kv_role": "kv_producer",
             "kv_connector_extra_config": {"transfer": args.kv_transfer,
                                           "kv_port": free_port(taken),
                                           "transfer_port": free_port(taken),
                                           "kv_lease_duration": args.lease}}
    p2p_d = {"kv_connector": "P2PConnector", "kv_role": "kv_consumer",
             "kv_load_failure_policy": "fail",
             "kv_connector_extra_config": {"transfer": args.kv_transfer}}
    configs = {
        "prefill": {"kv_connector": "MultiConnector", "kv_role": "kv_producer",
                    "kv_connector_extra_config": {
                        "connectors": [p2p_p, dict(pool, kv_role="kv_producer")]}},
        "decode": {"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
                   "kv_connector_extra_config": {
                       "connectors": [dict(pool, kv_role="kv_consumer"), p2p_d]}},
        "colocated": dict(pool, kv_role="kv_both"),
    }
    topo = Topology()
    for name in ENGINES:
        port = free_port(taken)
        topo.children.append(Child(name, f"http://{HOST}:{port}", py + [
            *engine, "--port", str(port), "--kv-transfer-config", json.dumps(configs[name])], env,
            role=name, threads=args.threads_per_engine))
    p, d, c = (ch.url for ch in topo.children)
    for name, backends in (("proxy_pd", ["--prefill", p, "--decode", d]),
                           ("proxy_colocated", ["--backends", c])):
        port = free_port(taken)
        topo.children.append(Child(name, f"http://{HOST}:{port}", py + [
            "proxy", *backends, "--host", HOST, "--port", str(port), "--log-level", "warning"],
            dict(os.environ), role=name))
    topo.endpoint = topo.children[3].url
    return topo


def make_references(url: str, model: str, items: list[Item],
                    timeout: float) -> dict[str, Reference]:
    """Each greedy item's answer from the engine at `url`, one request at a time.

    Raises:
        RuntimeError: a reference request failed.
    """
    refs = {}
    with httpx.Client(timeout=timeout) as client:
        for item in items:
            req = SoakRequest(item, "colocated", stream=False, greedy=True)
            path = "/v1/chat/completions" if item.api == "chat" else "/v1/completions"
            r = client.post(url + path, json=request_body(req, model, reference=True))
            if r.status_code != 200:
                raise RuntimeError(f"reference of {item.key}: {r.status_code} {r.text[:300]}")
            data = r.json()
            choice = data["choices"][0]
            text = (choice["message"]["content"] or "") if item.api == "chat" else choice["text"]
            refs[item.key] = Reference(text, _token_gaps(item.api, data))
    return refs


async def run_load(args: argparse.Namespace, items: list[Item], urls: dict[str, str],
                   tally: Tally) -> list[Outcome]:
    """`args.concurrency` clients sending the seeded request stream to both proxies until
    `args.duration` seconds have passed; each finishes its request in progress."""
    rng = random.Random(args.seed + 1)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + args.duration
    limits = client_limits(args.concurrency + 8)  # drops idle connections before the server
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=10.0),
                                 limits=limits) as client:

        async def worker() -> None:
            while time.monotonic() < deadline:
                req = next_request(rng, items, args.cancel_fraction, args.sampled_fraction,
                                   args.max_cancel_s)
                tally.inflight += 1
                try:
                    o = await send(client, urls[req.target], args.model, req,
                                   args.request_timeout)
                finally:
                    tally.inflight -= 1
                tally.add(o)
                outcomes.append(o)

        async def progress() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(min(args.progress_interval, max(0.0, deadline
                                                                    - time.monotonic())))
                left = max(0.0, deadline - time.monotonic())
                print(f"load: {args.duration - left:.0f} s, {tally.finished} finished, "
                      f"{tally.inflight} in flight, {dict(tally.by_status)}", flush=True)

        await asyncio.gather(progress(), *(worker() for _ in range(args.concurrency)))
    return outcomes


# Counters the summary reports per engine: /metrics sample name -> key (summed over labels).
COUNTERS = {f"pdkv:{name}_total": name for name in (
    "prefix_cache_hits", "kv_pool_hit_tokens", "kv_pool_chunks_written", "kv_pool_save_skips",
    "kv_pool_failures", "kv_transfer_bytes_received", "kv_transfer_bytes_sent",
    "num_preemptions", "kv_lease_expirations")}


def wait_idle(sampler: Sampler, engines: dict[str, str], num_blocks: int, timeout: float,
              fds_limit: dict[str, float] | None = None) -> dict[str, float]:
    """Sample until every engine has all its blocks free, no request queued or running and no pool
    save queued, and (with `fds_limit`, process name -> open fds) no process holds more open fds
    than its limit, or `timeout` seconds; returns the last sample.

    The fds wait is for the connections of the last requests: a server keeps an idle one for its
    keep-alive (pdkv.keepalive.SERVER_KEEPALIVE_S), and the proxy closes its expired ones to its
    engines at its next request or health probe (every 10 s), so for seconds after the load the
    colocated engine and its proxy each hold one fd per connection the load left open (about 30
    at concurrency 64). A leak keeps its fds, so it still shows at `timeout`."""
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while True:
            row = sampler.sample(client)
            idle = all(row.get(f"{e}.free_blocks") == num_blocks
                       and not row.get(f"{e}.waiting") and not row.get(f"{e}.running")
                       and not row.get(f"{e}.pool_save_queue") for e in engines)
            settled = all(row.get(f"{n}.fds", limit + 1) <= limit
                          for n, limit in (fds_limit or {}).items())
            if (idle and settled) or time.monotonic() > deadline:
                return row
            time.sleep(0.5)


def machine() -> dict[str, str]:
    """CPU model and flags, load average and commit, printed beside every figure."""
    flags = model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    have = line.split(":", 1)[1].split()
                    flags = " ".join(sorted(
                        x for x in have
                        if x.startswith(("avx512", "amx")) or x in ("avx2", "fma")))
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"cpu": model or platform.processor(), "flags": flags, "cores": str(os.cpu_count()),
            "commit": commit or "unknown"}


def run(args: argparse.Namespace, topo: Topology, redis_url: str, redis_pid: int) -> int:
    """The soak on a started, healthy topology; returns the exit status."""
    os.makedirs(args.output_dir, exist_ok=True)
    limits = Limits(args.tie_margin, args.fd_slack, args.max_rss_slope, args.warmup,
                    args.min_slope_window)
    items = make_items(args.seed, args.num_items, args.long_fraction, args.long_words,
                       args.max_tokens)
    by_name = {c.name: c for c in topo.children}
    engines = {n: by_name[n].url for n in ENGINES}
    urls = {"pd": by_name["proxy_pd"].url, "colocated": by_name["proxy_colocated"].url}
    load_before = os.getloadavg()
    host = machine()  # now: the commit the processes run, not HEAD when the report is written
    t0 = time.monotonic()
    print("references: every greedy shape on the idle colocated engine ...", flush=True)
    refs = make_references(engines["colocated"], args.model, items, args.request_timeout)
    print(f"references: {len(refs)} greedy items in {time.monotonic() - t0:.1f} s", flush=True)
    # One request through each proxy, so every engine has run steps before the idle start.
    warm = SoakRequest(items[0], "pd", stream=False, greedy=True)
    with httpx.Client(timeout=args.request_timeout) as client:
        for target in ("pd", "colocated"):
            path = "/v1/chat/completions" if items[0].api == "chat" else "/v1/completions"
            r = client.post(urls[target] + path, json=request_body(warm, args.model))
            if r.status_code != 200:
                print(f"error: warm-up through {target}: {r.status_code} {r.text[:300]}",
                      file=sys.stderr)
                return 1
    pids = {"redis": redis_pid}
    pids.update({c.name: c.proc.pid for c in topo.children if c.proc is not None})
    tally = Tally()
    samples_path = os.path.join(args.output_dir, "samples.jsonl")
    with open(samples_path, "w") as out:
        sampler = Sampler(pids, engines, redis_url, args.sample_interval, out,
                          lambda: {"client.inflight": float(tally.inflight),
                                   "client.finished": float(tally.finished)})
        idle_start = wait_idle(sampler, engines, args.num_kv_blocks, args.lease + args.margin)
        sampler.samples.clear()
        sampler.start()
        t_load = time.monotonic()
        try:
            outcomes = asyncio.run(run_load(args, items, urls, tally))
        finally:
            sampler.stop()
        load_s = time.monotonic() - t_load
        # Idle, and the load's keep-alive connections closed (a leaked fd stays: the check).
        fds_limit = {n: idle_start[f"{n}.fds"] + limits.fd_slack for n in pids
                     if f"{n}.fds" in idle_start}
        idle_end = wait_idle(sampler, engines, args.num_kv_blocks, args.lease + args.margin,
                             fds_limit)
    samples = sampler.samples
    names = list(pids)
    greedy = compare_greedy(outcomes, refs, limits.tie_margin)
    structured = bad_structured(outcomes)
    slopes, window = rss_slopes(samples[:-1], names, limits)
    blocks_start = {e: float(args.num_kv_blocks) for e in ENGINES}
    blocks_end = {e: idle_end.get(f"{e}.free_blocks") for e in ENGINES}
    up = all(c.proc is not None and c.proc.poll() is None for c in topo.children)
    # Every request without a good answer, in the order sent: what it was and what it got.
    bad = [o.describe(t_load) for o in sorted(outcomes, key=lambda o: o.start)
           if o.server_error or 400 <= o.status < 500]
    first = (f"{bad[0]['kind']} {bad[0]['status']} {bad[0]['sent_at_s']:.1f} s into the load "
             f"after {bad[0]['elapsed_s']:.1f} s: {bad[0]['error'] or '(no error text)'}"
             if bad else "")
    failed = failures(dict(tally.by_status), greedy, structured, blocks_start, blocks_end,
                      idle_start, idle_end, names, slopes, window, limits, first)
    if not up:
        failed.append("a process of the topology is down at the end")
    with httpx.Client() as client:
        counters = {e: engine_metrics(client, url, COUNTERS) for e, url in engines.items()}
    logs = {c.name: scan_log(c.log_path) for c in topo.children}
    for name, found in logs.items():
        if found.tracebacks:
            failed.append(f"{name}: {found.tracebacks} tracebacks in {by_name[name].log_path}")
    report = {
        **host,
        "load_average_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_average_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "duration_s": round(load_s, 1),
        "concurrency": args.concurrency,
        "requests": tally.finished,
        "requests_per_s": round(tally.finished / max(load_s, 1e-9), 2),
        "by_status": dict(tally.by_status),
        "by_kind": dict(sorted(tally.by_kind.items())),
        "greedy": {"compared": greedy.compared, "equal": greedy.equal,
                   "near_ties": greedy.near_ties, "wrong": greedy.wrong_count},
        "structured_invalid": len(structured),
        "failed_requests": bad[:MAX_FAILED_LISTED],
        "free_blocks_start": blocks_start,
        "free_blocks_end": blocks_end,
        "rss_mb": {n: _pair(idle_start, idle_end, f"{n}.rss_bytes", 1e6) for n in names},
        "rss_mb_load_max": {n: round(max((s.get(f"{n}.rss_bytes", 0.0) for s in samples),
                                         default=0.0) / 1e6, 1) for n in names},
        "rss_slope_pct_per_h": {n: round(v, 2) for n, v in slopes.items()},
        "rss_slope_window_s": round(window, 1),
        "rss_slope_judged": window >= limits.min_slope_window_s,
        "fds_idle": {n: _pair(idle_start, idle_end, f"{n}.fds") for n in names},
        "threads_idle": {n: _pair(idle_start, idle_end, f"{n}.threads") for n in names},
        "redis_used_memory_mb": _pair(idle_start, idle_end, "redis.used_memory", 1e6),
        "engine_counters": counters,
        "log_lines": {n: {"warnings": f.warnings, "errors": f.errors,
                          "tracebacks": f.tracebacks} for n, f in logs.items()},
        "log_messages": {n: f.messages for n, f in logs.items() if f.messages},
        "samples": len(samples),
        "limits": asdict(limits),
    }
    for line in greedy.wrong:
        print(f"wrong greedy answer: {line}", flush=True)
    for one in bad[:MAX_FAILED_LISTED]:
        print(f"failed request: {json.dumps(one)}", flush=True)
    for key, value in report.items():
        print(f"{key}: {value}", flush=True)
    with open(os.path.join(args.output_dir, "summary.json"), "w") as summary:
        json.dump({**report, "failures": failed}, summary, indent=1)
    png = os.path.join(args.output_dir, "soak.png")
    title = (f"pdkv bench soak: {load_s / 60:.0f} min, concurrency {args.concurrency}, "
             f"{tally.finished} requests; {report['cpu']} ({report['cores']} cores; "
             f"{report['flags']}); load {report['load_average_before']} -> "
             f"{report['load_average_after']}; commit {report['commit']}")
    note = plot_samples(samples, names, list(ENGINES), limits.warmup_s, title, png)
    print(f"plot: {note or png}", flush=True)
    print(f"samples: {samples_path}", flush=True)
    print(f"summary: {os.path.join(args.output_dir, 'summary.json')}", flush=True)
    slope = ("judged" if window >= limits.min_slope_window_s else
             f"not judged: {window:.0f} s after the warm-up < {limits.min_slope_window_s:.0f} s")
    print("checks: no 5xx/4xx/stream errors, greedy answers = reference, structured answers "
          "valid, free blocks back, fds back, no process down, no traceback in a log, RSS slope "
          f"< {limits.max_rss_slope_pct_per_h:g} %/h ({slope})", flush=True)
    for line in failed:
        print(f"FAILED: {line}", flush=True)
    print("soak: " + ("FAILED" if failed else "passed"), flush=True)
    return 1 if failed else 0


def _pair(a: dict[str, float], b: dict[str, float], key: str,
          scale: float = 1.0) -> list[float | None]:
    """[idle start, idle end] of one sample key (None where not read), scaled."""
    return [None if key not in s else round(s[key] / scale, 1) for s in (a, b)]


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`pdkv bench soak` flags (defaults: the hour-long run of docs/RELIABILITY.md)."""
    parser.add_argument("--model", default="smollm2", help="model name or folder")
    parser.add_argument("--duration", type=float, default=3600.0,
                        help="seconds of load (the drain and the checks come after)")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="clients at once, both proxies")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the items and the request stream")
    parser.add_argument("--num-items", type=int, default=32,
                        help="distinct request shapes (each greedy one has a reference)")
    parser.add_argument("--long-fraction", type=float, default=0.25,
                        help="share of items with a long prompt")
    parser.add_argument("--long-words", type=int, default=700,
                        help="words of a long prompt (3/4 of them a prefix shared by all)")
    parser.add_argument("--max-tokens", type=int, default=32, help="outputs of 4..this many tokens")
    parser.add_argument("--cancel-fraction", type=float, default=0.1,
                        help="requests the client cancels")
    parser.add_argument("--max-cancel-s", type=float, default=3.0,
                        help="a cancel lands uniformly in 0.05..this many seconds after sending")
    parser.add_argument("--sampled-fraction", type=float, default=0.4,
                        help="requests sampled at temperature 0.8 (the rest are greedy)")
    parser.add_argument("--sample-interval", type=float, default=5.0,
                        help="seconds between samples")
    parser.add_argument("--progress-interval", type=float, default=60.0,
                        help="seconds between progress lines during the load")
    parser.add_argument("--warmup", type=float, default=600.0,
                        help="seconds of load left out of the RSS slope")
    parser.add_argument("--min-slope-window", type=float, default=600.0,
                        help="the RSS slope is judged only over at least this many seconds")
    parser.add_argument("--max-rss-slope", type=float, default=5.0,
                        help="RSS growth allowed after the warm-up (%% of its mean per hour)")
    parser.add_argument("--fd-slack", type=int, default=16,
                        help="open fds a process may hold at the idle end above the idle start")
    parser.add_argument("--tie-margin", type=float, default=0.01,
                        help="a greedy divergence where the reference's two best log-"
                             "probabilities are closer than this (nats) is a near tie")
    parser.add_argument("--num-kv-blocks", type=int, default=1024, help="KV blocks per engine")
    parser.add_argument("--max-model-len", type=int, default=2048, help="per engine")
    parser.add_argument("--threads-per-engine", type=int, default=1,
                        help="torch threads per engine")
    parser.add_argument("--kv-transfer", choices=["tcp", "shm"], default="tcp",
                        help="P2P transfer engine")
    parser.add_argument("--lease", type=float, default=30.0, help="P's kv_lease_duration (s)")
    parser.add_argument("--margin", type=float, default=30.0,
                        help="the engines must be idle by lease + this (s) after the load")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="per request (s)")
    parser.add_argument("--health-timeout", type=float, default=300.0,
                        help="start-up deadline (s)")
    parser.add_argument("--output-dir", default="pdkv-logs/soak",
                        help="logs, samples.jsonl, summary.json and soak.png")
    return parser


def main(args: argparse.Namespace) -> int:
    """Start redis and the topology, run, stop every process; 0 passed, 1 a check failed,
    2 no start, 130 SIGINT, 143 SIGTERM (both stop every process first, and write no report)."""
    from pdkv.launch.services import start_redis

    # Unwind on SIGTERM and on SIGINT (a shell starts background jobs with SIGINT ignored):
    # the finally blocks stop every process this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logs = os.path.join(args.output_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    print(f"soak: {args.duration:.0f} s at concurrency {args.concurrency}, seed {args.seed}; "
          f"output in {args.output_dir}/", flush=True)
    try:
        redis = start_redis(log_dir=logs)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        topo = build_soak_topology(args, redis.address)
        print(f"starting {len(topo.children)} processes ({', '.join(ENGINES)}, "
              f"{', '.join(PROXIES)}) and waiting for their health (logs in {logs}/)",
              flush=True)
        try:
            if not topo.start_healthy(logs, args.health_timeout):
                return 2
            return run(args, topo, redis.address, redis.pids[0])
        finally:
            topo.stop()
    except KeyboardInterrupt:
        print("soak: interrupted; no report", file=sys.stderr)
        return 130
    finally:
        redis.stop()
