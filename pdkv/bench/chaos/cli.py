"""`pdkv bench chaos`: P/D through the proxy under client cancels and one prefill restart.

Starts its own P, D and proxy processes on free loopback ports (P with a fixed engine_id, kv_port
and transfer_port, so that the restarted P is the same peer for D), or with `--deploy FILE` the
processes of a deployment file (pdkv.launch.deploy_run, as `pdkv up --deploy`; `--netns`: each
host a network namespace), sends a seeded plan of completions (some cancelled by the client at
0-50 ms around the prefill's completion), SIGKILLs P (the first prefill engine) halfway and
restarts it with the same command (same ports; in a deployment in its host's namespace, bound to
and advertising its host's address, with a fixed engine_id), then checks:

- every engine is up at the end (and every process of the run alive);
- no 5xx (nor stream error / missing answer) outside the restart window (from the kill until P's
  /health is 200 again) and no 4xx at all;
- the first request after the restart succeeds;
- a few prompts of the plan get the same greedy text through the proxy as sent straight to P
  (colocated: no KV transfer);
- every engine's free KV blocks return to their start values within the lease + a margin.

Prints the counts; exits 1 when a check fails (2 when the run cannot start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from pdkv.bench.chaos.load import LoadResult, Planned, make_plan, run_load
from pdkv.launch.deploy import Deployment, DeploymentError, load_deployment
from pdkv.launch.topology import Child, Topology
from pdkv.ports import free_port

HOST = "127.0.0.1"
DEFAULT_LEASE_S = 30.0
"""P's kv_lease_duration when the deployment file sets none (the P2PConnector's default)."""
COLOCATED_CHECKS = 4
"""Prompts of the plan whose answer through the proxy is compared with P's own."""


@dataclass(frozen=True)
class Targets:
    """What a chaos run acts on and checks, in a started topology.

    Attributes:
        endpoint: the proxy's URL.
        restarted: the prefill engine the run kills and starts again (its log is appended to).
        engines: every engine with an HTTP server (the free-block and health checks).
        processes: every process of the run (each must still run at the end).
        model: the model name requests carry.
        lease: P's kv_lease_duration (s): the free blocks must be back by lease + margin.
    """

    endpoint: str
    restarted: Child
    engines: tuple[Child, ...]
    processes: tuple[Child, ...]
    model: str
    lease: float

    @classmethod
    def of(cls, topo: Topology, model: str, lease: float) -> Targets:
        """From a topology whose engines are named prefill* / decode* (the first prefill
        engine is restarted); a headless node (no URL) counts as a process, not an engine."""
        engines = tuple(c for c in topo.children
                        if c.name.startswith(("prefill", "decode")) and c.url)
        prefill = [c for c in engines if c.name.startswith("prefill")]
        return cls(topo.endpoint, prefill[0], engines, tuple(topo.children), model, lease)


def build_chaos_topology(args: argparse.Namespace) -> Topology:
    """P ("prefill"), D ("decode") and the proxy ("proxy"), in that order."""
    py = [sys.executable, "-m", "pdkv.cli"]
    engine = ["serve", "--model", args.model, "--num-kv-blocks", str(args.num_kv_blocks),
              "--max-model-len", str(args.max_model_len), "--host", HOST, "--log-level", "warning"]
    env = dict(os.environ, PDKV_NUM_THREADS=str(args.threads_per_engine))
    taken: set[int] = set()
    p_port, d_port, proxy_port = free_port(taken), free_port(taken), free_port(taken)
    p_cfg = {
        "kv_connector": "P2PConnector",
        "kv_role": "kv_producer",
        "engine_id": "chaos-prefill",
        "kv_connector_extra_config": {
            "transfer": "tcp",
            "kv_port": free_port(taken),
            "transfer_port": free_port(taken),
            "kv_lease_duration": args.lease,
        },
    }
    d_cfg = {"kv_connector": "P2PConnector", "kv_role": "kv_consumer",
             "kv_load_failure_policy": args.kv_load_failure_policy,
             "kv_connector_extra_config": {"transfer": "tcp"}}
    topo = Topology()
    for name, port, cfg in (("prefill", p_port, p_cfg), ("decode", d_port, d_cfg)):
        topo.children.append(Child(name, f"http://{HOST}:{port}", py + [
            *engine, "--port", str(port), "--kv-transfer-config", json.dumps(cfg)], env))
    topo.children.append(
        Child(
            "proxy",
            f"http://{HOST}:{proxy_port}",
            py
            + [
                "proxy",
                "--prefill",
                topo.children[0].url,
                "--decode",
                topo.children[1].url,
                "--host",
                HOST,
                "--port",
                str(proxy_port),
                "--log-level",
                "warning",
            ],
            dict(os.environ),
        )
    )
    topo.endpoint = topo.children[2].url
    return topo


def _metric(url: str, name: str) -> float | None:
    """One engine's metric (summed over labels); None when unreachable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def restart_child(c: Child, timeout: float) -> tuple[float, float]:
    """SIGKILL `c` and start it again with the same command (its log is appended to). Returns
    (kill time, time its /health answered 200 again), time.monotonic().

    Raises:
        RuntimeError: it exited or was not healthy within `timeout` seconds.
    """
    assert c.proc is not None
    os.killpg(c.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    c.proc.wait(10)
    log = open(c.log_path, "ab")  # noqa: SIM115 - owned by the child process
    c.proc = subprocess.Popen(
        c.cmd, stdout=log, stderr=subprocess.STDOUT, env=c.env, start_new_session=True
    )
    deadline = killed + timeout
    while not _healthy(c.url):
        if c.proc.poll() is not None:
            raise RuntimeError(
                f"{c.name} exited with {c.proc.returncode} after its restart; see {c.log_path}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"{c.name} not healthy {timeout:.0f} s after its restart")
        time.sleep(0.2)
    return killed, time.monotonic()


def _prefill_seconds(p_url: str, model: str, prompt: str) -> float:
    """Median client-side latency of a one-token completion on P (the prefill's completion as a
    client of the proxy sees it, roughly)."""
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        r = httpx.post(p_url + "/v1/completions", timeout=60,
                       json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def _wait_blocks(
    urls: dict[str, str], start: dict[str, float], deadline: float
) -> dict[str, float | None]:
    """Poll num_free_blocks until every engine is back at its start value or `deadline`."""
    now: dict[str, float | None] = {}
    while True:
        now = {name: _metric(url, "pdkv:num_free_blocks") for name, url in urls.items()}
        if all(now[n] == start[n] for n in urls) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def check(result: LoadResult, engines_up: bool, blocks_start: dict[str, float],
          blocks_end: dict[str, float | None], mismatched: list[str] | None = None) -> list[str]:
    """The failed checks (empty: all passed). `mismatched`: the prompts whose answer through the
    proxy differed from P's own (None: not compared)."""
    counts = result.counts()
    failures = []
    if not engines_up:
        failures.append("an engine is down at the end")
    if counts["failed_outside_restart_window"]:
        bad = [
            o.error or str(o.status)
            for o in result.outcomes
            if o.failed and not result.in_window(o)
        ]
        failures.append(
            f"{counts['failed_outside_restart_window']} failures outside the restart window: "
            f"{bad[:3]}"
        )
    if counts["client_errors_4xx"]:
        failures.append(f"{counts['client_errors_4xx']} requests got a 4xx")
    first = result.first_after_restart
    if first is None or first.status != 200:
        # Needs D to reconnect to a restarted P (issue 7, item 8b).
        failures.append(
            f"the first request after the restart failed: {first.status if first else None} "
            f"{first.error if first else ''}"
        )
    if mismatched:
        failures.append(f"{len(mismatched)} answers through the proxy differ from the "
                        f"colocated one: {mismatched[:3]}")
    for name, value in blocks_end.items():
        if value != blocks_start[name]:
            failures.append(f"{name} free blocks {value} != start value {blocks_start[name]}")
    return failures


def configured_blocks(cmd: list[str]) -> int:
    """The KV blocks an engine started with `cmd` has: its last `--num-kv-blocks` (every one
    free when it is idle: the value the run's free blocks must come back to).

    Raises:
        ValueError: `cmd` sets no --num-kv-blocks (the cache would be sized from memory).
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    known, _ = parser.parse_known_args(cmd)
    if known.num_kv_blocks is None:
        raise ValueError("the chaos run needs --num-kv-blocks in every engine's flags (a "
                         "deployment file's engine_args) to know the whole cache")
    return int(known.num_kv_blocks)


def _greedy_text(url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> str:
    """The greedy completion of `prompt` at `url` (ignore_eos: exactly `max_tokens` tokens).

    Raises:
        RuntimeError: no 200 answer.
    """
    try:
        r = httpx.post(url + "/v1/completions", timeout=timeout, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})
    except httpx.HTTPError as e:
        raise RuntimeError(f"{url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
    return str(r.json()["choices"][0]["text"])


def compare_colocated(t: Targets, plan: list[Planned], timeout: float) -> tuple[int, list[str]]:
    """Send the first COLOCATED_CHECKS prompts of `plan` through the proxy (P then D, KV moved
    between them) and straight to P (its own prefill and decode: the colocated answer), greedy;
    returns (prompts compared, the mismatches as "prompt…: proxy != colocated" or the error)."""
    mismatched = []
    items = plan[:COLOCATED_CHECKS]
    for item in items:
        try:
            via = _greedy_text(t.endpoint, t.model, item.prompt, item.max_tokens, timeout)
            own = _greedy_text(t.restarted.url, t.model, item.prompt, item.max_tokens, timeout)
        except RuntimeError as e:
            mismatched.append(f"{item.prompt[:30]}…: {e}")
            continue
        if via != own:
            mismatched.append(f"{item.prompt[:30]}…: {via!r} != {own!r}")
    return len(items), mismatched


def run(args: argparse.Namespace, t: Targets) -> int:
    """The run on a started, healthy topology; returns the exit status."""
    p = t.restarted
    warm = Planned("The river stone and the silver cloud", 2, False, None)
    first = Planned("After the restart the garden lantern", 4, False, None)
    urls = {c.name: c.url for c in t.engines}
    start = {c.name: float(configured_blocks(c.cmd)) for c in t.engines}
    prefill_s = _prefill_seconds(p.url, t.model, " ".join(["river stone cloud light"] * 9))
    outcome = asyncio.run(
        run_load(t.endpoint, t.model, [warm], 1, -1, _no_restart, warm, 60.0)
    )
    if outcome.outcomes[0].status != 200:
        print(f"error: the warm-up request failed: {outcome.outcomes[0].error}", file=sys.stderr)
        return 1
    plan = make_plan(args.num_requests, args.seed, args.cancel_fraction, prefill_s,
                     args.cancel_window_ms / 1000.0, args.max_tokens)

    async def restart() -> tuple[float, float]:
        return await asyncio.to_thread(restart_child, p, args.restart_timeout)

    t0 = time.monotonic()
    try:
        result = asyncio.run(
            run_load(
                t.endpoint,
                t.model,
                plan,
                args.concurrency,
                int(len(plan) * args.restart_at),
                restart,
                first,
                args.request_timeout,
            )
        )
    except RuntimeError as e:  # the restart failed
        print(f"FAILED: the restart of {p.name}: {e}\nchaos run: FAILED", flush=True)
        return 1
    load_s = time.monotonic() - t0
    compared, mismatched = compare_colocated(t, plan, args.request_timeout)
    end = _wait_blocks(urls, start, time.monotonic() + t.lease + args.margin)
    engines_up = all(c.proc is not None and c.proc.poll() is None for c in t.processes) and all(
        _healthy(c.url) for c in t.engines)
    counts = result.counts()
    lo, hi = result.window
    report = {
        **counts,
        "restart_window_s": round(hi - lo, 2),
        "restarted": f"{p.name} {p.url}",
        "first_after_restart": result.first_after_restart.status
        if result.first_after_restart
        else None,
        "answers_equal_colocated": f"{compared - len(mismatched)}/{compared}",
        "prefill_s": round(prefill_s, 3),
        "load_s": round(load_s, 1),
        "free_blocks_start": start,
        "free_blocks_end": end,
        "engines_up": engines_up,
        "p_lease_expirations_since_restart": _metric(p.url, "pdkv:kv_lease_expirations_total"),
        "d_kv_load_failures": sum(_metric(c.url, "pdkv:kv_load_failures_total") or 0.0
                                  for c in t.engines if c.name.startswith("decode")),
    }
    for key, value in report.items():
        print(f"{key}: {value}", flush=True)
    failures = check(result, engines_up, start, end, mismatched)
    for f in failures:
        print(f"FAILED: {f}", flush=True)
    print("chaos run: " + ("FAILED" if failures else "passed"), flush=True)
    return 1 if failures else 0


async def _no_restart() -> tuple[float, float]:
    return 0.0, 0.0


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`pdkv bench chaos` flags (defaults: the full run; CI: --num-requests 50 --lease 3)."""
    parser.add_argument("--model", default="smollm2", help="model name or folder")
    parser.add_argument(
        "--num-requests", type=int, default=500, help="requests sent through the proxy"
    )
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the request plan (lengths, cancels)"
    )
    parser.add_argument(
        "--cancel-fraction", type=float, default=0.3, help="requests the client cancels"
    )
    parser.add_argument(
        "--cancel-window-ms",
        type=float,
        default=50.0,
        help="cancels land uniformly in a window this wide around the prefill's completion",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="outputs are 1..this many tokens"
    )
    parser.add_argument("--lease", type=float, default=30.0, help="P's kv_lease_duration (s)")
    parser.add_argument(
        "--margin", type=float, default=5.0, help="free blocks must be back by lease + this (s)"
    )
    parser.add_argument(
        "--restart-at", type=float, default=0.5, help="restart P when this fraction was sent"
    )
    parser.add_argument(
        "--restart-timeout", type=float, default=120.0, help="P must be healthy again in (s)"
    )
    parser.add_argument("--request-timeout", type=float, default=120.0, help="per request (s)")
    parser.add_argument("--num-kv-blocks", type=int, default=256, help="KV blocks per engine")
    parser.add_argument("--max-model-len", type=int, default=512, help="per engine")
    parser.add_argument(
        "--threads-per-engine", type=int, default=1, help="torch threads per engine"
    )
    parser.add_argument("--kv-load-failure-policy", choices=["recompute", "fail"], default="fail",
                        help="D's policy (fail: a failed pull shows as an error)")
    parser.add_argument("--health-timeout", type=float, default=180.0, help="start-up deadline (s)")
    parser.add_argument("--log-dir", default="pdkv-logs/chaos", help="one log file per process")
    parser.add_argument(
        "--deploy",
        default=None,
        metavar="FILE",
        help="run on the processes of this deployment file (docs/ACROSS_HOSTS.md; its first "
        "prefill engine is restarted) instead of its own 1P1D; the file sets the model, engine "
        "flags, failure policy and lease",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="--deploy: each host a network namespace (root; as pdkv up --deploy --netns)",
    )
    return parser


FILE_SETS = {"model": "smollm2", "num_kv_blocks": 256, "max_model_len": 512,
             "kv_load_failure_policy": "fail", "lease": 30.0}
"""Flags (argparse dest → default) whose value a deployment file sets instead."""


def load_deploy(args: argparse.Namespace) -> Deployment:
    """The deployment of `--deploy FILE`, checked for a chaos run.

    Raises:
        ValueError: `--netns` without `--deploy`, a flag the file sets (FILE_SETS) given with
            it, a first prefill engine whose ranks span hosts (the run restarts P as one
            process), or an engine without --num-kv-blocks; a DeploymentError (a ValueError)
            for a malformed file.
    """
    if args.deploy is None:
        if args.netns:
            raise ValueError("--netns needs --deploy FILE (the hosts to make namespaces of)")
        raise ValueError("no --deploy FILE")
    for name, default in FILE_SETS.items():
        if getattr(args, name) != default:
            raise ValueError(
                f"--deploy takes --{name.replace('_', '-')} from the file (model, engine_args, "
                "kv_load_failure_policy, kv_lease_duration): leave it out")
    dep = load_deployment(args.deploy)
    p = dep.prefill[0]
    if p.worker_hosts:
        raise ValueError(f"{dep.source}: {p.name}'s ranks span hosts (worker_hosts): the chaos "
                         "run restarts the first prefill engine as one process; put it on one "
                         "host")
    for e in dep.engines:
        try:
            configured_blocks([*dep.engine_args, *e.args])
        except ValueError as err:
            raise ValueError(f"{dep.source}: {e.name}: {err}") from None
    return dep


def main_deploy(args: argparse.Namespace) -> int:
    """The run on a deployment file's processes (`--deploy FILE [--netns]`), started and
    stopped by pdkv.launch.deploy_run as `pdkv up --deploy` does; the first prefill engine gets
    a fixed engine_id so that its restart is the same peer for the decode engines."""
    from pdkv.launch.deploy_run import run_deployment

    try:
        dep = load_deploy(args)
    except (ValueError, DeploymentError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lease = dep.kv_lease_duration or DEFAULT_LEASE_S
    restarted = dep.prefill[0].name
    ran: list[int] = []

    def on_ready(topo: Topology) -> int:
        ran.append(run(args, Targets.of(topo, dep.model, lease)))
        return ran[-1]

    print(f"chaos run on {dep.source}{' in namespaces' if args.netns else ''}: "
          f"{args.num_requests} requests, lease {lease:g} s, seed {args.seed}, restarts "
          f"{restarted}; logs in {args.log_dir}/", flush=True)
    rc = run_deployment(dep, netns=args.netns, log_dir=args.log_dir,
                        health_timeout=args.health_timeout,
                        threads_per_engine=args.threads_per_engine, on_ready=on_ready,
                        engine_ids={restarted: f"chaos-{restarted}"}, interrupted=1)
    return rc if ran else (rc if rc == 0 else 2)


def main(args: argparse.Namespace) -> int:
    """Start the topology, run, stop every process; 0 passed, 1 a check failed, 2 no start."""
    if args.deploy is not None or args.netns:
        return main_deploy(args)
    topo = build_chaos_topology(args)
    print(f"chaos run: {args.num_requests} requests, lease {args.lease} s, seed {args.seed}; "
          f"logs in {args.log_dir}/", flush=True)
    try:
        if not topo.start_healthy(args.log_dir, args.health_timeout):
            return 2
        return run(args, Targets.of(topo, args.model, args.lease))
    finally:
        topo.stop()
