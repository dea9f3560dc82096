"""`pdkv bench hosts`: TTFT / TPOT of a deployment file on loopback vs shaped links, one table.

For each case of `--link-rates` (in order) the deployment is started by the code of `pdkv up
--deploy` (`pdkv.launch.deploy_run.run_deployment`), one warm-up request goes through its proxy,
then `pdkv bench serve` (the same prompts in every case: random, seeded) measures through the
proxy, and the deployment is torn down (namespaces included) before the next case:

- `loopback`: the file without `--netns`: every host at 127.0.0.1, no veth, no qdisc (P and D
  on one machine as users run them without a network: the baseline the shaped cases are
  compared with);
- `unshaped`: in namespaces (`--netns`), the links not shaped (the cost of the veth pairs and
  the bridge alone);
- a rate in tc syntax (`1gbit`, `110mbit`): in namespaces, every host's link a tbf at that rate
  (the file's own `link` entries are replaced), plus `--link-delay`: a netem qdisc where the
  kernel has sch_netem, else pdkv's user-space delay line (pdkv/launch/delay_line.py); the run
  says which before it starts and the case's link column names it. A packet between two hosts
  crosses both hosts' links: twice the delay one way.

The printed markdown table has one row per case: TTFT mean / p50 / p99, TPOT mean / p99, E2EL
mean / p99 (ms), request throughput (req/s) and the KV bytes the decode engines received per
request (their `pdkv:kv_transfer_bytes_received_total` over the run / requests). Above it: the
command, the CPU and its vector flags, the cores, the load average before the first case and
after the last, the commit, and whether the figures may be published (the 1-minute load average
below the core count before and after). `--json PATH` writes all of it with every case's
per-request prompt lengths and server counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pdkv.bench.header import host_facts, machine_lines
from pdkv.bench.results import write_result_json
from pdkv.bench.serve.config import BenchConfig
from pdkv.bench.serve.runner import run_serve_bench
from pdkv.launch.delay_line import delay_seconds
from pdkv.launch.deploy import Deployment, DeploymentError, load_deployment
from pdkv.launch.netns import (
    LinkShape,
    delay_method,
    rate_bytes_per_s,
    unavailable_reason,
)
from pdkv.launch.topology import Topology

LOOPBACK = "loopback"
UNSHAPED = "unshaped"
PERCENTILES = [50.0, 99.0]
INTERRUPTED = 130
"""Exit code of a run stopped by Ctrl-C / SIGTERM (the remaining cases are not run)."""


@dataclass(frozen=True)
class Case:
    """One row of the table: `name` as given in --link-rates, whether it runs in network
    namespaces (`netns`), and the tc `rate` of every host's link (None: not shaped)."""

    name: str
    netns: bool
    rate: str | None

    def link(self, delay: str | None, delay_method: str | None) -> str:
        """The link as measured, for the table: "127.0.0.1", "veth, not shaped", "1gbit",
        or "1gbit + 1ms per host link (netem)" / "(delay line)"."""
        if not self.netns:
            return "127.0.0.1 (no namespaces)"
        if self.rate is None:
            return "veth + bridge, not shaped"
        if delay is None:
            return f"{self.rate}"
        how = "delay line" if delay_method == "delay_line" else str(delay_method)
        return f"{self.rate} + {delay} per host link ({how})"


def parse_cases(text: str) -> list[Case]:
    """The cases of `--link-rates`: comma-separated `loopback`, `unshaped` or tc rates.

    Raises:
        ValueError: no case, a case twice, or a rate tc would not take (tc syntax: 1gbit,
            500mbit, ...).
    """
    cases: list[Case] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if any(c.name == item for c in cases):
            raise ValueError(f"--link-rates: {item!r} given twice")
        if item == LOOPBACK:
            cases.append(Case(item, netns=False, rate=None))
        elif item == UNSHAPED:
            cases.append(Case(item, netns=True, rate=None))
        else:
            try:
                rate_bytes_per_s(item)
            except ValueError as e:
                raise ValueError(f"--link-rates: {item!r} is neither {LOOPBACK}, {UNSHAPED} nor "
                                 f"a tc rate ({e})") from None
            cases.append(Case(item, netns=True, rate=item))
    if not cases:
        raise ValueError(f"--link-rates: no case (give e.g. {LOOPBACK},1gbit)")
    return cases


def max_model_len(engine_args: Sequence[str]) -> int | None:
    """The last `--max-model-len` of an engine's flags, None when they set none."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--max-model-len", type=int, default=None)
    known, _ = parser.parse_known_args(list(engine_args))
    return None if known.max_model_len is None else int(known.max_model_len)


def check_args(args: argparse.Namespace, dep: Deployment) -> list[Case]:
    """The cases of a run, its flags checked against each other and the deployment.

    Raises:
        ValueError: a case in namespaces without --netns, --netns with no such case,
            --link-delay without a shaped case or in a syntax tc would not take, prompts plus
            output longer than an engine's --max-model-len, or a setting `pdkv bench serve`
            refuses (e.g. --num-prompts 0).
    """
    cases = parse_cases(args.link_rates)
    in_ns = [c.name for c in cases if c.netns]
    if in_ns and not args.netns:
        raise ValueError(f"--link-rates {', '.join(in_ns)}: these cases run the hosts in network "
                         "namespaces joined by shaped veth links: add --netns (root)")
    if args.netns and not in_ns:
        raise ValueError(f"--netns: no case of --link-rates runs in namespaces (only "
                         f"{LOOPBACK}); add a rate (e.g. 1gbit) or leave out --netns")
    if args.link_delay is not None:
        delay_seconds(args.link_delay)
        if not any(c.rate for c in cases):
            raise ValueError("--link-delay shapes the rate cases' links: --link-rates has no rate")
    for e in dep.engines:
        limit = max_model_len([*dep.engine_args, *e.args])
        if limit is not None and args.input_len + args.output_len > limit:
            raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} > "
                             f"{e.name}'s --max-model-len {limit} in {dep.source}")
    bench_config(args, dep)  # BenchConfig's own checks
    return cases


def bench_config(args: argparse.Namespace, dep: Deployment) -> BenchConfig:
    """The `pdkv bench serve` settings of every case (base_url and metrics set per case).

    Raises:
        ValueError: a setting BenchConfig refuses.
    """
    return BenchConfig(model=dep.model, tokenizer=dep.model, dataset="random",
                       num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len, max_concurrency=args.max_concurrency,
                       seed=args.seed, percentiles=list(PERCENTILES), disable_tqdm=True,
                       request_timeout=args.request_timeout)


def case_deployment(dep: Deployment, case: Case, delay: str | None) -> Deployment:
    """`dep` with every host's link as `case` shapes it (rate, and `delay` for a rate case)."""
    link = LinkShape(rate=case.rate, delay=delay if case.rate else None)
    return dataclasses.replace(dep, hosts=tuple(dataclasses.replace(h, link=link)
                                                for h in dep.hosts))


def warm_up(endpoint: str, model: str, timeout: float) -> None:
    """One short greedy completion through the proxy (the engines' first steps are slower).

    Raises:
        RuntimeError: no 200 answer within `timeout` seconds.
    """
    try:
        r = httpx.post(endpoint + "/v1/completions", timeout=timeout, json={
            "model": model, "prompt": "A warm-up request before the measured ones.",
            "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    except httpx.HTTPError as e:
        raise RuntimeError(f"the warm-up request: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise RuntimeError(f"the warm-up request: {r.status_code} {r.text[:200]}")


def decode_bytes(result: dict[str, Any], decode_urls: Sequence[str]) -> float | None:
    """KV bytes the decode engines received during the run (their counters' deltas), None
    when a decode engine's metrics were not scraped."""
    server = result.get("server_metrics")
    sources = server.get("sources") if isinstance(server, dict) else None
    if not isinstance(sources, dict):
        return None
    total = 0.0
    for url in decode_urls:
        deltas = sources.get(url)
        if not isinstance(deltas, dict) or deltas.get("kv_p2p_bytes_received") is None:
            return None
        total += float(deltas["kv_p2p_bytes_received"])
    return total


ROW_KEYS = ("mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
            "mean_e2el_ms", "p99_e2el_ms", "request_throughput")


def run_case(dep: Deployment, case: Case, delay: str | None, delay_method: str | None,
             cfg: BenchConfig, args: argparse.Namespace,
             log: Callable[[str], object] = print) -> dict[str, Any]:
    """Start `dep` as `case` says, warm up, measure through the proxy, tear down; returns the
    case's entry of the result (figures, or `error`; `rc` the deployment's exit code)."""
    entry: dict[str, Any] = {"case": case.name, "link": case.link(delay, delay_method),
                             "netns": case.netns, "rate": case.rate,
                             "delay": delay if case.rate else None, "error": None}

    def on_ready(topo: Topology) -> int:
        engines = [c for c in topo.children if c.name.startswith(("prefill", "decode")) and c.url]
        decode = [c.url + "/metrics" for c in engines if c.name.startswith("decode")]
        run_cfg = dataclasses.replace(cfg, base_url=topo.endpoint,
                                      metrics_url=",".join(c.url + "/metrics" for c in engines))
        try:
            warm_up(topo.endpoint, dep.model, args.request_timeout)
            result = run_serve_bench(run_cfg, log)
        except (RuntimeError, httpx.HTTPError, OSError) as e:
            entry["error"] = str(e)
            return 1
        received = decode_bytes(result, decode)
        completed = int(result["completed"])
        entry.update({k: result.get(k) for k in ROW_KEYS})
        entry.update(endpoint=topo.endpoint, completed=completed, failed=int(result["failed"]),
                     duration_s=result.get("duration"), input_lens=result.get("input_lens"),
                     output_lens=result.get("output_lens"),
                     errors=[e for e in result.get("errors", []) if e][:3],
                     kv_bytes_received=received,
                     kv_bytes_per_request=received / completed if received is not None
                     and completed else None,
                     server_metrics=result.get("server_metrics"))
        if completed < run_cfg.num_prompts:
            entry["error"] = (f"{run_cfg.num_prompts - completed} of {run_cfg.num_prompts} "
                              f"requests failed: {entry['errors']}")
            return 1
        return 0

    log(f"--- case {case.name}: {entry['link']}")
    rc = run_deployment_for(case_deployment(dep, case, delay), case, args, on_ready)
    entry["rc"] = rc
    if rc and entry["error"] is None:
        entry["error"] = ("interrupted" if rc == INTERRUPTED else
                          f"the deployment did not run (exit {rc}; see the messages above and "
                          f"{case_log_dir(args, case)}/)")
    return entry


def case_log_dir(args: argparse.Namespace, case: Case) -> str:
    """Where a case's processes log."""
    return os.path.join(args.log_dir, case.name)


def run_deployment_for(dep: Deployment, case: Case, args: argparse.Namespace,
                       on_ready: Callable[[Topology], int]) -> int:
    """`run_deployment` of one case (loopback or namespaces as the case says)."""
    from pdkv.launch.deploy_run import run_deployment

    return run_deployment(dep, netns=case.netns, log_dir=case_log_dir(args, case),
                          health_timeout=args.health_timeout,
                          threads_per_engine=args.threads_per_engine, on_ready=on_ready,
                          interrupted=INTERRUPTED)


def _ms(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


def format_table(cases: Sequence[dict[str, Any]]) -> str:
    """The markdown table, one row per case (times in ms; a failed case: its error)."""
    lines = ["| case | link | requests ok | TTFT mean | TTFT p50 | TTFT p99 | TPOT mean | "
             "TPOT p99 | E2EL mean | E2EL p99 | req/s | KV bytes / request (D) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        if c.get("completed") is None:
            lines.append(f"| {c['case']} | {c['link']} | failed: {c['error']} |"
                         + " - |" * 9)
            continue
        kv = c.get("kv_bytes_per_request")
        rps = c.get("request_throughput")
        lines.append(
            f"| {c['case']} | {c['link']} | {c['completed']}/{c['completed'] + c['failed']} | "
            + " | ".join(_ms(c.get(k)) for k in ROW_KEYS[:-1])
            + f" | {rps:.2f} | " + (f"{kv:,.0f}" if kv is not None else "-") + " |")
    return "\n".join(lines)


def header(args: argparse.Namespace, dep: Deployment, host: dict[str, str],
           load_before: tuple[float, float, float],
           load_after: tuple[float, float, float]) -> tuple[list[str], bool]:
    """The lines printed above the table and whether the figures may be published (the
    1-minute load average below the core count before and after)."""
    lines = []
    if sys.argv[1:3] == ["bench", "hosts"]:
        lines.append(f"command: pdkv {shlex.join(sys.argv[1:])}")
    lines.append(
        f"deployment: {dep.source} (model {dep.model}); {args.num_prompts} prompts x "
        f"{args.input_len} tokens in, {args.output_len} out (random, seed {args.seed}), "
        f"concurrency {args.max_concurrency}; per case: deployment up, 1 warm-up request, the "
        "measured requests through the proxy, deployment down")
    machine_facts, quiet = machine_lines(host, load_before, load_after)
    lines += machine_facts
    return lines, quiet


def run(args: argparse.Namespace, dep: Deployment, cases: Sequence[Case],
        log: Callable[[str], object] = print) -> int:
    """Every case in turn, then the table; 0 when every case measured every request."""
    delay = args.link_delay
    method = None
    if delay is not None and any(c.rate for c in cases):
        method = delay_method()
        log(f"note: --link-delay {delay} is applied by " + (
            "netem" if method == "netem" else
            "pdkv's delay line (this kernel has no netem qdisc, sch_netem)"))
    cfg = bench_config(args, dep)
    load_before = os.getloadavg()
    host = host_facts()
    t0 = time.monotonic()
    entries = []
    for case in cases:
        entries.append(run_case(dep, case, delay, method, cfg, args, log))
        if entries[-1]["rc"] == INTERRUPTED:
            break
    load_after = os.getloadavg()
    lines, quiet = header(args, dep, host, load_before, load_after)
    table = format_table(entries)
    print("\n" + "\n".join(lines) + "\n\n" + table, flush=True)
    if args.json:
        write_result_json({
            "benchmark": "hosts (issue 30, acceptance 3)", "header": lines,
            "deployment": dep.source, "model": dep.model,
            "settings": {"link_rates": args.link_rates, "link_delay": delay,
                         "link_delay_method": method, "num_prompts": args.num_prompts,
                         "input_len": args.input_len, "output_len": args.output_len,
                         "max_concurrency": args.max_concurrency, "seed": args.seed},
            "machine": {**host, "load_average_before": list(load_before),
                        "load_average_after": list(load_after), "publishable": quiet},
            "elapsed_s": time.monotonic() - t0, "cases": entries, "table": table,
        }, args.json)
        print(f"result written to {args.json}", flush=True)
    if any(e["rc"] == INTERRUPTED for e in entries):
        return INTERRUPTED
    return 1 if any(e["error"] for e in entries) else 0


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `pdkv bench hosts` flags to `parser`."""
    parser.add_argument("--deploy", required=True, metavar="FILE",
                        help="the deployment file (docs/ACROSS_HOSTS.md): model, engine flags, "
                        "hosts, proxy")
    parser.add_argument("--netns", action="store_true",
                        help="run the cases other than loopback with each host a network "
                        "namespace (root)")
    parser.add_argument("--link-rates", default=f"{LOOPBACK},1gbit",
                        help=f"cases, comma-separated: {LOOPBACK} (127.0.0.1, no namespaces), "
                        f"{UNSHAPED} (namespaces, links not shaped), or a tc rate (every host's "
                        "link at that rate, e.g. 1gbit, 110mbit)")
    parser.add_argument("--link-delay", default=None, metavar="DELAY",
                        help="the rate cases' links also delay each packet this much per host "
                        "link, one way (tc syntax: 1ms; netem where the kernel has sch_netem, "
                        "else pdkv's delay line, said which)")
    parser.add_argument("--num-prompts", type=int, default=16, help="measured requests per case")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    parser.add_argument("--max-concurrency", type=int, default=1,
                        help="requests in flight at once (1: no queueing in the TTFT)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts (same every case)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="per request (s)")
    parser.add_argument("--health-timeout", type=float, default=180.0,
                        help="each case's start-up deadline (s)")
    parser.add_argument("--threads-per-engine", type=int, default=0,
                        help="torch threads per engine (0: cores / engines)")
    parser.add_argument("--log-dir", default="pdkv-logs/hosts",
                        help="one folder per case, one log per process")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    return parser


def main(args: argparse.Namespace) -> int:
    """`pdkv bench hosts`: 0 every case measured, 1 a case failed, 2 refused before starting
    (bad flags or file, --netns without root), 130 interrupted."""
    try:
        dep = load_deployment(args.deploy)
        cases = check_args(args, dep)
    except (ValueError, DeploymentError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if any(c.netns for c in cases):
        reason = unavailable_reason()
        if reason:
            print(f"error: --netns {reason}", file=sys.stderr)
            return 2
    return run(args, dep, cases)
