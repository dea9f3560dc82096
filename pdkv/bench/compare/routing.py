"""Cache-aware routing benchmark (issue 34, acceptance 3; first written for issue 9): the same
shared-prefix multi-turn chat workload through `pdkv up --mode colocated --num-instances N
--routing R`, once per routing policy, with the instances' prefix-cache hits read from their
/metrics and the proxy's decisions and KV index predictions from its /metrics.

    python -m pdkv.bench.compare.routing --result-json routing.json

Workload (defaults): 4 system prompts of 512 tokens x 16 users each (64 conversations), 3 turns
each, turn t = the conversation so far + a new 32-token question (answers: 16 tokens, generated
with ignore_eos), sent turn-major (every user's turn 0, then every user's turn 1, ...) at most 2
at a time (`--max-concurrency`; `--request-rate` for an open loop): on 2 cores with one thread
per engine at most two engines compute at once, so the box is never oversubscribed.

Topology (defaults): 3 colocated SmolLM2 instances, no KV pool, each with a KV cache of 112
blocks of 16 tokens (1,792 tokens, `--num-kv-blocks`): two groups' system prompts (2 x 32 blocks)
and the turns in flight fit one instance, all four system prompts (128 blocks) plus the turns
between two uses of one do not. So an instance that serves every group (round_robin) keeps
evicting the system prompts, and one that serves one or two groups keeps them; the whole working
set (4 x 32 + 64 users x ~8 blocks of history) fits nowhere, so evictions happen under every
policy. (A 3-policy LRU model of this workload: round_robin keeps 3 % of the prompt tokens at
112 blocks, 22 % at 128 and 78 % from 160 on, where all four system prompts stay; the group-
sticky ideal keeps 82 %.)

Per policy: a fresh topology (empty caches), counters read before and after the workload
(deltas), then stopped. Measured:

- engine prefix-cache hit rate = sum over the instances of delta `pdkv:prefix_cache_hits_total`
  / delta `pdkv:prompt_tokens_total` (pdkv/serve/metrics.py: prompt tokens found in the prefix
  cache at scheduling / prompt tokens of requests that produced a first token); with `--pool`
  the pool's hit tokens beyond the local prefix (`pdkv:kv_pool_hit_tokens_total{tier="all"}`)
  are reported beside it, not added;
- TTFT mean / p50 / p99 and completed / failed requests from `pdkv bench serve`'s runner;
- the proxy's decisions by reason (`pdkv:proxy_routing_decisions_total{policy,reason,leg}`);
- the KV index's predictions (`pdkv:proxy_kv_predictions_total{backend,outcome}`, outcome
  exact / over / under; wrong = over + under; policies that keep no index have none);
- preemptions per instance (`pdkv:num_preemptions_total`). Block evictions: the engine exports
  no eviction counter (`BlockPool.num_evictions` is not on /metrics), so none is reported.

The verdict (pdkv.bench.compare.routing_report) checks the issue's required ratios, and the
result JSON (--result-json) keeps every figure with the machine facts (CPU, AVX-512 / AMX
flags, load average before and after, commit) and the estimated vs the actual time.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import httpx

from pdkv.bench.compare.routing_report import (
    BENCHMARK_POLICIES,
    PolicyResult,
    Targets,
    TimingModel,
    estimate_seconds,
    format_report,
    format_verdict,
    policy_hit_rate,
    verdict,
    workload_prompt_tokens,
)
from pdkv.bench.results import jsonable, write_result_json
from pdkv.bench.serve.config import BenchConfig
from pdkv.bench.serve.runner import run_serve_bench
from pdkv.bench.soak.cli import machine
from pdkv.procgroup import stop_process_group
from pdkv.router.policies import POLICY_NAMES

DEFAULT_NUM_KV_BLOCKS = 112
_LISTING = re.compile(r"^\s+(engine\d*|proxy): .*?(http://[^\s,]+)")


@dataclass(frozen=True)
class RoutingBenchConfig:
    """One benchmark run's settings (lengths in tokens, times in seconds, rate in requests/s).

    Attributes:
        policies: routing policies, one topology each, in this order.
        model: the engines' model (alias or folder).
        num_instances: colocated instances behind the proxy.
        num_kv_blocks: KV cache blocks per instance (None: the engine's default budget).
        max_model_len: the engines' --max-model-len (None: the model's); the engine refuses a
            KV cache smaller than one request of this length, and the longest prompt (the last
            turn: ~709 tokens with the defaults) plus its answer must fit it.
        pool: a KV pool tier shared by the instances (None: no pool).
        pool_chunk_size: the pool's chunk in tokens (with a pool).
        engine_args: further flags for every engine (after `--` on `pdkv up`).
        threads_per_engine: torch threads per engine.
        system_prompts: distinct system prompts (groups of users).
        system_prompt_len: tokens per system prompt.
        users_per_prompt: users (conversations) per system prompt.
        turns: turns per conversation.
        input_len: tokens of each turn's new question.
        output_len: tokens of each answer (generated with ignore_eos; the synthetic answers in
            later turns' prompts have the same length).
        max_concurrency: requests in flight at most (None: unbounded).
        request_rate: arrivals per second (inf: all at once, bounded by max_concurrency).
        seed: the dataset's seed (the same prompts for every policy).
        health_timeout: seconds `pdkv up` may take to report ready.
        request_timeout: seconds one request may take.

    Raises:
        ValueError: no policy, or a count below 1.
    """

    policies: tuple[str, ...] = BENCHMARK_POLICIES
    model: str = "smollm2"
    num_instances: int = 3
    num_kv_blocks: int | None = DEFAULT_NUM_KV_BLOCKS
    max_model_len: int | None = 1024
    pool: str | None = None
    pool_chunk_size: int = 64
    engine_args: tuple[str, ...] = ()
    threads_per_engine: int = 1
    system_prompts: int = 4
    system_prompt_len: int = 512
    users_per_prompt: int = 16
    turns: int = 3
    input_len: int = 32
    output_len: int = 16
    max_concurrency: int | None = 2
    request_rate: float = math.inf
    seed: int = 0
    health_timeout: float = 300.0
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("at least one routing policy is needed")
        counts = {"--num-instances": self.num_instances, "--system-prompts": self.system_prompts,
                  "--users-per-prompt": self.users_per_prompt, "--turns": self.turns,
                  "--output-len": self.output_len}
        for flag, n in counts.items():
            if n < 1:
                raise ValueError(f"{flag} must be >= 1, got {n}")

    @property
    def conversations(self) -> int:
        """Conversations (users) in all: system_prompts x users_per_prompt."""
        return self.system_prompts * self.users_per_prompt

    @property
    def requests(self) -> int:
        """Requests per policy: conversations x turns."""
        return self.conversations * self.turns

    def up_command(self, routing: str, log_dir: str) -> list[str]:
        """The `pdkv up` command line of one policy's topology."""
        cmd = [sys.executable, "-m", "pdkv.cli", "up", "--mode", "colocated",
               "--num-instances", str(self.num_instances), "--routing", routing,
               "--model", self.model, "--log-dir", log_dir,
               "--threads-per-engine", str(self.threads_per_engine), "--disable-log-requests"]
        if self.pool:
            cmd += ["--pool", self.pool, "--pool-chunk-size", str(self.pool_chunk_size)]
        engine = list(self.engine_args)
        if self.num_kv_blocks is not None:
            engine += ["--num-kv-blocks", str(self.num_kv_blocks)]
        if self.max_model_len is not None:
            engine += ["--max-model-len", str(self.max_model_len)]
        return cmd + (["--", *engine] if engine else [])

    def bench_config(self, endpoint: str) -> BenchConfig:
        """`pdkv bench serve`'s settings for the workload against the proxy at `endpoint`."""
        return BenchConfig(
            base_url=endpoint, endpoint="chat", dataset="multi-turn",
            num_prompts=self.conversations, num_turns=self.turns,
            system_prompt_len=self.system_prompt_len, num_system_prompts=self.system_prompts,
            input_len=self.input_len, output_len=self.output_len,
            max_concurrency=self.max_concurrency, request_rate=self.request_rate,
            seed=self.seed, scrape_metrics=False, disable_tqdm=True,
            request_timeout=self.request_timeout,
        )


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value of every sample at url/metrics (Prometheus text).

    Raises:
        httpx.HTTPError: url does not answer within 10 s.
    """
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


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before per sample (a sample absent before counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def by_label(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    """`name`'s samples summed by the value of `label`: {"exact": 10.0, "over": 1.0, ...}."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith(name + "{"):
            m = re.search(label + r'="([^"]*)"', key)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def instance_counters(d: dict[str, float]) -> dict[str, float]:
    """One engine's counters over the workload (deltas): prompt tokens, prefix hits (tokens),
    pool hits beyond the local prefix (tokens), finished requests and preemptions."""
    return {"prompt_tokens": total(d, "pdkv:prompt_tokens_total"),
            "prefix_hits": total(d, "pdkv:prefix_cache_hits_total"),
            "pool_hits": total(d, "pdkv:kv_pool_hit_tokens_total", tier="all"),
            "requests": total(d, "pdkv:request_success_total"),
            "preemptions": total(d, "pdkv:num_preemptions_total")}


class UpProcess:
    """A `pdkv up` topology: started in its own process group; its stdout drained by a thread
    (so the launcher never blocks on a full pipe) into a queue the ready wait reads."""

    def __init__(self, cmd: Sequence[str]) -> None:
        self.proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_ready(self, timeout: float) -> tuple[str, dict[str, str]]:
        """The proxy endpoint and {engine name or "proxy": URL} from `pdkv up`'s listing.

        Raises:
            RuntimeError: `pdkv up` exited or printed no "ready:" line within `timeout` s (the
                message has its last lines).
        """
        deadline = time.monotonic() + timeout
        urls: dict[str, str] = {}
        while True:
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise RuntimeError(f"pdkv up did not become ready within {timeout:.0f} s:\n"
                                   + "".join(self.lines[-15:])) from None
            if line is None:  # its stdout closed: it exited (or is exiting)
                try:
                    rc: int | str = self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    rc = "?"
                raise RuntimeError(f"pdkv up exited with {rc}:\n" + "".join(self.lines[-15:]))
            self.lines.append(line)
            m = _LISTING.match(line)
            if m:
                urls[m.group(1)] = m.group(2)
            if line.startswith("ready: "):
                return line.split()[1], urls

    def stop(self) -> None:
        """SIGTERM the group (60 s), then SIGKILL it."""
        stop_process_group(self.proc, 60, 10)
        self._reader.join(timeout=10)


WARM_UP_PROMPT = "Warm-up request, not part of the workload."


def warm_up(url: str) -> None:
    """One short completion sent straight to the engine at `url` (not through the proxy, so
    no policy sees it) before the counters are first read: an engine's first request pays its
    lazy set-up, which would otherwise count as load on whichever engine got it first.

    Raises:
        httpx.HTTPError: the engine did not answer 200 within 120 s.
    """
    r = httpx.post(url + "/v1/completions", json={"prompt": WARM_UP_PROMPT, "max_tokens": 2,
                                                  "temperature": 0}, timeout=120)
    r.raise_for_status()


def run_policy(routing: str, cfg: RoutingBenchConfig, log_dir: str,
               log: Callable[[str], object] = print) -> PolicyResult:
    """One topology with `routing`, the workload, the instances' and the proxy's counters.

    Raises:
        RuntimeError: the topology did not come up within cfg.health_timeout seconds, or it
            listed no engine or no proxy.
        httpx.HTTPError: an engine's or the proxy's /metrics did not answer.
    """
    t0 = time.monotonic()
    up = UpProcess(cfg.up_command(routing, os.path.join(log_dir, routing)))
    try:
        endpoint, urls = up.wait_ready(cfg.health_timeout)
        engines = {n: u for n, u in sorted(urls.items()) if n.startswith("engine")}
        if not engines or "proxy" not in urls:
            raise RuntimeError(f"pdkv up listed no engine or proxy: {''.join(up.lines)}")
        log(f"{routing}: up in {time.monotonic() - t0:.0f} s; sending {cfg.requests} requests")
        for url in engines.values():  # each engine's first request is slow (lazy set-up)
            warm_up(url)
        before = {n: scrape(u) for n, u in [*engines.items(), ("proxy", urls["proxy"])]}
        bench = run_serve_bench(cfg.bench_config(endpoint), log=lambda s: None)
        after = {n: scrape(u) for n, u in [*engines.items(), ("proxy", urls["proxy"])]}
    finally:
        up.stop()
    per = {n: instance_counters(delta(before[n], after[n])) for n in engines}
    pd = delta(before["proxy"], after["proxy"])
    predictions = by_label(pd, "pdkv:proxy_kv_predictions_total", "outcome")
    prompt = sum(p["prompt_tokens"] for p in per.values())
    hits = sum(p["prefix_hits"] for p in per.values())
    pool = sum(p["pool_hits"] for p in per.values())
    wrong = predictions.get("over", 0.0) + predictions.get("under", 0.0)
    counted = sum(predictions.values())
    return {
        "routing": routing,
        "error": None,
        "requests": cfg.requests,
        "completed": int(bench["completed"]),
        "failed": int(bench["failed"]),
        "ttft_mean_ms": bench["mean_ttft_ms"],
        "ttft_p50_ms": bench["median_ttft_ms"],
        "ttft_p99_ms": bench["p99_ttft_ms"],
        "duration_s": bench["duration"],
        "wall_s": time.monotonic() - t0,
        "prompt_tokens": prompt,
        "prefix_hits": hits,
        "pool_hits": pool,
        "hit_rate": policy_hit_rate(hits, prompt),
        "pool_hit_rate": policy_hit_rate(pool, prompt) if cfg.pool else None,
        "preemptions": sum(p["preemptions"] for p in per.values()),
        "instances": per,
        "decisions": by_label(pd, "pdkv:proxy_routing_decisions_total", "reason"),
        "predictions": predictions or None,
        "wrong_prediction_rate": wrong / counted if counted else None,
        "errors": sorted({str(e) for e in bench["errors"] if e})[:5],
    }


def failed_policy(routing: str, cfg: RoutingBenchConfig, error: str) -> PolicyResult:
    """The result of a policy whose topology or workload failed (no figures)."""
    return {"routing": routing, "error": error, "requests": cfg.requests, "completed": 0,
            "failed": cfg.requests, "ttft_mean_ms": None, "ttft_p50_ms": None,
            "ttft_p99_ms": None, "duration_s": None, "wall_s": None, "prompt_tokens": 0.0,
            "prefix_hits": 0.0, "pool_hits": 0.0, "hit_rate": None, "pool_hit_rate": None,
            "preemptions": 0.0, "instances": {}, "decisions": {}, "predictions": None,
            "wrong_prediction_rate": None, "errors": [error]}


def run_benchmark(cfg: RoutingBenchConfig, targets: Targets, timing: TimingModel,
                  log_dir: str, log: Callable[[str], object] = print) -> dict[str, object]:
    """Every policy of `cfg` in turn, the verdict and the machine facts: the result JSON's
    content. A policy that fails is recorded with its error and the run goes on."""
    load_before = os.getloadavg()
    host = machine()
    estimate = estimate_seconds(cfg, timing, os.cpu_count() or 1)
    log(f"{len(cfg.policies)} policies x {cfg.requests} requests ({cfg.system_prompts} system "
        f"prompts x {cfg.users_per_prompt} users x {cfg.turns} turns) on {cfg.num_instances} "
        f"{cfg.model} instances; estimated at most {estimate / 60:.1f} min")
    t0 = time.monotonic()
    results: list[PolicyResult] = []
    for routing in cfg.policies:
        try:
            results.append(run_policy(routing, cfg, log_dir, log))
        except (RuntimeError, httpx.HTTPError, OSError) as e:
            log(f"{routing}: failed: {e}")
            results.append(failed_policy(routing, cfg, str(e)))
    elapsed = time.monotonic() - t0
    return {
        "benchmark": "routing (issue 34, acceptance 3)",
        "settings": jsonable(asdict(cfg)),
        "targets": asdict(targets),
        "workload": {"conversations": cfg.conversations, "requests": cfg.requests,
                     "prompt_tokens_estimate": workload_prompt_tokens(cfg)},
        "machine": {**host,
                    "load_average_before": " ".join(f"{x:.2f}" for x in load_before),
                    "load_average_after": " ".join(f"{x:.2f}" for x in os.getloadavg())},
        "timing_model": asdict(timing),
        "estimated_s": estimate,
        "elapsed_s": elapsed,
        "policies": results,
        "verdict": [asdict(c) for c in verdict(results, targets)],
        "notes": ["evictions: the engine exports no block eviction counter "
                  "(BlockPool.num_evictions is not on /metrics); preemptions are reported"],
    }


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module doc as written, and every flag's default."""


def add_cli_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's flags (defaults: RoutingBenchConfig's, Targets', TimingModel's)."""
    d, t, m = RoutingBenchConfig(), Targets(), TimingModel()
    ap.add_argument("--routing", nargs="+", default=list(d.policies), choices=POLICY_NAMES,
                    metavar="POLICY", help="policies, one topology each: "
                    + ", ".join(POLICY_NAMES))
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--num-instances", type=int, default=d.num_instances)
    ap.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                    help="KV cache blocks (16 tokens) per instance; 0 = the engine's default")
    ap.add_argument("--max-model-len", type=int, default=d.max_model_len)
    ap.add_argument("--pool", default=None, help="a KV pool tier shared by the instances "
                    "(disk, redis, mooncake; default none)")
    ap.add_argument("--pool-chunk-size", type=int, default=d.pool_chunk_size)
    ap.add_argument("--engine-arg", action="append", default=[], dest="engine_args",
                    help="one more flag for every engine (repeat; e.g. --engine-arg=--dtype "
                    "--engine-arg=bfloat16)")
    ap.add_argument("--threads-per-engine", type=int, default=d.threads_per_engine)
    ap.add_argument("--system-prompts", type=int, default=d.system_prompts,
                    help="distinct system prompts (groups of users)")
    ap.add_argument("--system-prompt-len", type=int, default=d.system_prompt_len,
                    help="tokens per system prompt")
    ap.add_argument("--users-per-prompt", type=int, default=d.users_per_prompt,
                    help="users (conversations) per system prompt")
    ap.add_argument("--turns", type=int, default=d.turns, help="turns per conversation")
    ap.add_argument("--input-len", type=int, default=d.input_len,
                    help="new question tokens per turn")
    ap.add_argument("--output-len", type=int, default=d.output_len,
                    help="answer tokens (generated, and the synthetic answers in later prompts)")
    ap.add_argument("--max-concurrency", type=int, default=d.max_concurrency,
                    help="requests in flight at most (0 = unbounded)")
    ap.add_argument("--request-rate", type=float, default=d.request_rate,
                    help="arrivals per second, Poisson (default inf: closed loop at "
                    "--max-concurrency)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--health-timeout", type=float, default=d.health_timeout)
    ap.add_argument("--request-timeout", type=float, default=d.request_timeout)
    ap.add_argument("--min-oracle-share", type=float, default=t.min_oracle_share)
    ap.add_argument("--min-round-robin-factor", type=float, default=t.min_round_robin_factor)
    ap.add_argument("--max-wrong-prediction-rate", type=float,
                    default=t.max_wrong_prediction_rate)
    ap.add_argument("--prefill-tok-s", type=float, default=m.prefill_tok_s,
                    help="for the time estimate: prefill tokens/s of the whole box")
    ap.add_argument("--decode-step-s", type=float, default=m.decode_step_s,
                    help="for the time estimate: seconds per decode step of one engine")
    ap.add_argument("--startup-s", type=float, default=m.startup_s,
                    help="for the time estimate: seconds per topology start, prompt building "
                    "and stop")
    ap.add_argument("--log-dir", default=None, help="the topologies' logs (default: a "
                    "temporary folder, removed at the end)")
    ap.add_argument("--result-json", default=None)
    return ap


def config_from_args(args: argparse.Namespace) -> tuple[RoutingBenchConfig, Targets, TimingModel]:
    """The run's settings from `add_cli_args`' flags.

    Raises:
        ValueError: an invalid value (see the dataclasses).
    """
    cfg = RoutingBenchConfig(
        policies=tuple(args.routing), model=args.model, num_instances=args.num_instances,
        num_kv_blocks=args.num_kv_blocks or None, max_model_len=args.max_model_len or None,
        pool=args.pool, pool_chunk_size=args.pool_chunk_size,
        engine_args=tuple(args.engine_args), threads_per_engine=args.threads_per_engine,
        system_prompts=args.system_prompts, system_prompt_len=args.system_prompt_len,
        users_per_prompt=args.users_per_prompt, turns=args.turns, input_len=args.input_len,
        output_len=args.output_len, max_concurrency=args.max_concurrency or None,
        request_rate=args.request_rate, seed=args.seed, health_timeout=args.health_timeout,
        request_timeout=args.request_timeout)
    targets = Targets(args.min_oracle_share, args.min_round_robin_factor,
                      args.max_wrong_prediction_rate)
    timing = TimingModel(args.prefill_tok_s, args.decode_step_s, args.startup_s)
    return cfg, targets, timing


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 1 when a policy failed or a verdict line was missed, else 0 (a line
    whose policies were not run is "n/a", not a failure)."""
    ap = add_cli_args(argparse.ArgumentParser(description=__doc__, formatter_class=_Help))
    args = ap.parse_args(argv)
    try:
        cfg, targets, timing = config_from_args(args)
    except ValueError as e:
        ap.error(str(e))
    if args.result_json:  # fail now, not after the run, when the file cannot be written
        os.makedirs(os.path.dirname(os.path.abspath(args.result_json)), exist_ok=True)
    if args.log_dir:
        result = run_benchmark(cfg, targets, timing, args.log_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="pdkv-routing-") as log_dir:
            result = run_benchmark(cfg, targets, timing, log_dir)
    print(format_report(result))
    print(format_verdict(result))
    if args.result_json:
        write_result_json(result, args.result_json)
        print(f"result: {args.result_json}")
    failed = any(p["error"] for p in result["policies"])  # type: ignore[attr-defined]
    missed = any(c["status"] == "missed" for c in result["verdict"])  # type: ignore[attr-defined]
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
