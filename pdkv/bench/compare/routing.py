"""PD-colocated routing comparison (issue 9, acceptance 3): the same multi-turn chat workload
through `pdkv up --mode colocated --num-instances N --pool TIER`, once per routing policy, with
the instances' prefix-cache and pool hits read from their /metrics.

    python -m pdkv.bench.compare.routing --routing round_robin prefix_aware

Each policy gets a fresh topology (its own pool server, empty caches). Hit rate = (prefix-cache
hit tokens + pool hit tokens) / prompt tokens, summed over the instances
(`pdkv:prefix_cache_hits`, `pdkv:kv_pool_hit_tokens{tier="all"}` (tokens beyond the local prefix
hit), `pdkv:prompt_tokens`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import TypedDict

import httpx

from pdkv.bench.serve.config import BenchConfig
from pdkv.bench.serve.runner import run_serve_bench
from pdkv.procgroup import stop_process_group


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value of every sample at url/metrics (Prometheus text)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    got = 0.0
    for key, value in samples.items():
        named = key == name or key.startswith(name + "{")
        if named and all(f'{k}="{v}"' in key for k, v in labels.items()):
            got += value
    return got


class PolicyResult(TypedDict):
    """One routing policy's run: completed requests, per-instance token counters (prompt,
    prefix hits, pool hits), the proxy's decisions by reason and the overall hit rate."""

    routing: str
    completed: int
    instances: dict[str, dict[str, float]]
    decisions: dict[str, float]
    hit_rate: float


def run_policy(routing: str, args: argparse.Namespace, log_dir: str) -> PolicyResult:
    """One topology with `routing`, the workload, the instances' counters. Raises RuntimeError
    when the topology does not come up within --health-timeout seconds."""
    cmd = [
        sys.executable,
        "-m",
        "pdkv.cli",
        "up",
        "--mode",
        "colocated",
        "--num-instances",
        str(args.num_instances),
        "--pool",
        args.pool,
        "--pool-chunk-size",
        str(args.pool_chunk_size),
        "--routing",
        routing,
        "--model",
        args.model,
        "--log-dir",
        os.path.join(log_dir, routing),
        "--threads-per-engine",
        str(args.threads_per_engine),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        urls: dict[str, str] = {}
        endpoint = ""
        deadline = time.monotonic() + args.health_timeout
        assert proc.stdout is not None
        while not endpoint:
            line = proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError(
                    f"pdkv up ({routing}) did not become ready; logs in {log_dir}/{routing}"
                )
            m = re.match(r"\s+(engine\d+|proxy): (http://\S+)", line)
            if m:
                urls[m.group(1)] = m.group(2)
            if line.startswith("ready: "):
                endpoint = line.split()[1]
        engines = {n: u for n, u in urls.items() if n.startswith("engine")}
        cfg = BenchConfig(
            base_url=endpoint,
            endpoint="chat",
            dataset="multi-turn",
            num_prompts=args.conversations,
            num_turns=args.turns,
            input_len=args.input_len,
            output_len=args.output_len,
            max_concurrency=1,
            seed=args.seed,
            scrape_metrics=False,
            disable_tqdm=True,
        )
        bench = run_serve_bench(cfg, log=lambda s: None)
        per: dict[str, dict[str, float]] = {}
        for name, url in sorted(engines.items()):
            samples = scrape(url)
            per[name] = {"prompt_tokens": total(samples, "pdkv:prompt_tokens_total"),
                         "prefix_hits": total(samples, "pdkv:prefix_cache_hits_total"),
                         "pool_hits": total(samples, "pdkv:kv_pool_hit_tokens_total", tier="all")}
        pm = scrape(urls["proxy"])
        decisions = {k.split('reason="')[1].split('"')[0]: v for k, v in pm.items()
                     if k.startswith("pdkv:proxy_routing_decisions_total")}
        queried = sum(p["prompt_tokens"] for p in per.values())
        hits = sum(p["prefix_hits"] + p["pool_hits"] for p in per.values())
        return {
            "routing": routing,
            "completed": bench["completed"],
            "instances": per,
            "decisions": decisions,
            "hit_rate": hits / queried if queried else 0.0,
        }
    finally:
        stop_process_group(proc, 60, 10)


def format_report(results: list[PolicyResult]) -> str:
    """A plain-text table: per policy and instance, prompt / prefix-hit / pool-hit tokens."""
    lines = [
        f"{'routing':<14}{'instance':<10}{'prompt tok':>11}{'prefix hit':>11}{'pool hit':>10}"
        f"{'hit rate':>10}"
    ]
    for r in results:
        for name, p in r["instances"].items():
            rate = (
                (p["prefix_hits"] + p["pool_hits"]) / p["prompt_tokens"]
                if p["prompt_tokens"]
                else 0.0
            )
            lines.append(f"{r['routing']:<14}{name:<10}{p['prompt_tokens']:>11.0f}{p['prefix_hits']:>11.0f}"
                         f"{p['pool_hits']:>10.0f}{rate:>10.1%}")
        decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["decisions"].items()))
        lines.append(
            f"{r['routing']:<14}{'all':<10}{'':>11}{'':>11}{'':>10}{r['hit_rate']:>10.1%}   "
            f"({decisions})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--routing", nargs="+", default=["round_robin", "prefix_aware"])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-instances", type=int, default=2)
    ap.add_argument("--pool", default="redis")
    ap.add_argument("--pool-chunk-size", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=40, help="new question tokens per turn")
    ap.add_argument(
        "--output-len", type=int, default=8, help="answer tokens (generated and in later prompts)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads-per-engine", type=int, default=1)
    ap.add_argument("--health-timeout", type=float, default=300.0)
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdkv-routing-") as log_dir:
        results = [run_policy(r, args, log_dir) for r in args.routing]
    print(format_report(results))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
