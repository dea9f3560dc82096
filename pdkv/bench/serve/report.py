"""Output of `pdkv bench serve`: the result dict, its JSON file and vLLM's printed table.

The result dict has vLLM's top-level keys (date, backend, model_id, tokenizer_id, num_prompts,
duration, completed, failed, total_input_tokens,
..., mean_ttft_ms, p99_itl_ms, ...; per-request arrays `input_lens`, `output_lens`, `ttfts`,
`itls`, `latencies`, `start_times`, `queue_times` in seconds, `errors`, `generated_texts`), so
tools reading vLLM result files read it too, plus `tpots` (s, null for <= 1 output token),
`usage_missing`, `config` (the run's settings, API key redacted), `server_metrics` (the
Prometheus counter deltas, or null), `pdkv_timings` (per request: the server's TTFT phases, or
null) and `ttft_phases` (their aggregate, pdkv.bench.serve.phases, or null when the server sent
none).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pdkv.bench.results import jsonable
from pdkv.bench.serve.config import BenchConfig
from pdkv.bench.serve.metrics import percentile_key, request_tpot
from pdkv.bench.serve.phases import TTFTPhases, ttft_phases
from pdkv.bench.serve.records import RequestResult

_W = 50
_METRIC_BLOCKS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def config_dict(cfg: BenchConfig) -> dict[str, object]:
    """The settings of a `BenchConfig` as plain JSON values, API key redacted."""
    out = dataclasses.asdict(cfg)
    if out.get("api_key"):
        out["api_key"] = "<redacted>"
    return {k: jsonable(v) for k, v in out.items()}


def build_result(cfg: BenchConfig, model: str, tokenizer: str,
                 metrics: Mapping[str, float | None], results: Sequence[RequestResult],
                 server_metrics: Mapping[str, object] | None) -> dict[str, Any]:
    """Assemble the result dict (see the module doc) from the metrics and per-request results."""
    conf = config_dict(cfg)
    conf.update(model=model, api_url=cfg.api_url, tokenizer=tokenizer)
    result: dict[str, Any] = {"config": conf, **metrics}
    result.update(
        # vLLM's top-level keys of `vllm bench serve --save-result` (scripts read these)
        date=time.strftime("%Y%m%d-%H%M%S"),
        backend="openai-chat" if cfg.endpoint == "chat" else "openai",
        model_id=model,
        tokenizer_id=tokenizer,
        num_prompts=len(results),
        request_rate=jsonable(cfg.request_rate),
        max_concurrency=cfg.max_concurrency,
        goodput_slos_ms=dict(cfg.goodput) or None,
        percentiles=list(cfg.percentiles),
        server_metrics=server_metrics,
        ttft_phases=ttft_phases(results),
        input_lens=[r.prompt_tokens for r in results],
        output_lens=[r.output_tokens if r.success else 0 for r in results],
        ttfts=[r.ttft if r.success else None for r in results],
        tpots=[request_tpot(r) if r.success else None for r in results],
        itls=[list(r.itl) if r.success else [] for r in results],
        latencies=[r.latency if r.success else None for r in results],
        start_times=[r.start_time for r in results],
        queue_times=[r.queue_time for r in results],
        usage_missing=[r.usage_missing for r in results],
        errors=[r.error for r in results],
        generated_texts=[r.generated_text for r in results],
        pdkv_timings=[r.pdkv_timings if r.success else None for r in results],
    )
    return result


def _row(label: str, value: object, fmt: str = "") -> str:
    return f"{label:<40} {format(value, fmt):<10}"


def format_result_table(result: dict[str, Any]) -> str:
    """vLLM's "Serving Benchmark Result" block for a result dict, as one string."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=_W, c="=")]
    lines.append(_row("Successful requests:", result["completed"]))
    lines.append(_row("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"]))
    rate = result.get("request_rate")
    if rate is not None and rate != "inf":
        lines.append(_row("Request rate configured (RPS):", float(rate), ".2f"))
    lines.append(_row("Benchmark duration (s):", result["duration"], ".2f"))
    lines.append(_row("Total input tokens:", result["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", result["request_throughput"], ".2f"))
    if result.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", result["request_goodput"], ".2f"))
        lines.append(_row("Good requests:", result["good_requests"]))
    lines.append(_row("Output token throughput (tok/s):", result["output_throughput"], ".2f"))
    lines.append(_row("Peak output token throughput (tok/s):",
                      result["max_output_tokens_per_s"], ".2f"))
    lines.append(_row("Peak concurrent requests:", result["max_concurrent_requests"]))
    lines.append(_row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f"))
    if result.get("num_usage_missing"):
        lines.append(_row("Requests without usage (chunk-counted):", result["num_usage_missing"]))
    for key, name, header in _METRIC_BLOCKS:
        lines.append("{s:{c}^{n}}".format(s=header, n=_W, c="-"))
        lines.append(_row(f"Mean {name} (ms):", result[f"mean_{key}_ms"], ".2f"))
        lines.append(_row(f"Median {name} (ms):", result[f"median_{key}_ms"], ".2f"))
        for p in result.get("percentiles", []):
            word = percentile_key(p)
            lines.append(_row(f"P{word} {name} (ms):", result[f"p{word}_{key}_ms"], ".2f"))
    phases = result.get("ttft_phases")
    if phases:
        lines.extend(format_phases(phases))
    server = result.get("server_metrics")
    if server:
        lines.append("{s:{c}^{n}}".format(s="Server Counters (delta)", n=_W, c="-"))
        if "prefix_cache_queries" in server:
            lines.append(
                _row("Prefix cache queries (tokens):", server["prefix_cache_queries"], ".0f")
            )
        if "prefix_cache_hits" in server:
            lines.append(_row("Prefix cache hits (tokens):", server["prefix_cache_hits"], ".0f"))
        if server.get("prefix_cache_hit_rate") is not None:
            lines.append(_row("Prefix cache hit rate (%):",
                              100.0 * server["prefix_cache_hit_rate"], ".2f"))
        for key, label in SERVER_ROWS:  # zeros left out, except the P -> D bytes
            if server.get(key) or (key == "kv_p2p_bytes_received" and key in server):
                lines.append(_row(label, server[key], ".0f"))
    lines.append("=" * _W)
    return "\n".join(lines)


SERVER_ROWS = (
    ("kv_p2p_bytes_received", "KV bytes pulled P -> D:"),
    ("kv_p2p_bytes_sent", "KV bytes read from P (as D reports):"),
    ("kv_pool_bytes_read", "KV pool bytes read (loads):"),
    ("kv_pool_bytes_written", "KV pool bytes written (saves):"),
    ("kv_offload_bytes_h2d", "KV offload bytes host -> device:"),
    ("kv_offload_bytes_d2h", "KV offload bytes device -> host:"),
    ("kv_load_failures", "KV load failures:"),
    ("proxy_prefill_legs", "Proxy prefill legs:"),
    ("proxy_decode_legs", "Proxy decode legs:"),
    ("proxy_whole_legs", "Proxy whole-request legs (colocated):"),
    ("proxy_prefill_legs_skipped", "Proxy prefill legs skipped (pool hit):"),
    ("proxy_errors", "Proxy errors:"),
)
"""(server_metrics key, printed label) of the counters in the table, in order."""


def format_phases(phases: TTFTPhases) -> list[str]:
    """The "TTFT Phases" block: mean, p50 and p99 per phase (ms), the parts of the proxy's
    `proxy` phase indented under it, the sum against client TTFT."""
    lines = ["{s:{c}^{n}}".format(s="TTFT Phases (server pdkv_timings)", n=_W, c="-")]
    lines.append(
        f"{'Phase (requests: ' + str(phases['num_requests']) + ')':<23} {'mean ms':>8} "
        f"{'p50 ms':>8} {'p99 ms':>8}"
    )
    rows = [(name, v) for name, v in phases["phases"].items()]
    at = next((i + 1 for i, (name, _) in enumerate(rows) if name == "proxy"), len(rows))
    rows[at:at] = [(f"  proxy.{name}", v) for name, v in phases.get("proxy_parts", {}).items()]
    for name, v in rows:
        lines.append(f"{name:<23} {v['mean_ms']:>8.2f} {v['p50_ms']:>8.2f} {v['p99_ms']:>8.2f}")
    lines.append(_row("Mean sum of server phases (ms):", phases["mean_phase_sum_ms"], ".2f"))
    lines.append(_row("Mean client TTFT (ms):", phases["mean_client_ttft_ms"], ".2f"))
    ratio = phases["sum_over_ttft"]
    mean, low, high = ratio["mean"], ratio["min"], ratio["max"]
    if mean is not None and low is not None and high is not None:  # all set, or none
        lines.append(_row("Sum / client TTFT, mean (%):", 100.0 * mean, ".1f"))
        lines.append(_row("Sum / client TTFT, min..max (%):",
                          f"{100.0 * low:.1f}..{100.0 * high:.1f}"))
    return lines


def format_errors(result: dict[str, Any], limit: int = 10) -> str:
    """The first `limit` error messages of failed requests, one per line ("" when none)."""
    errors = [e for e in result.get("errors", []) if e]
    if not errors:
        return ""
    head = [f"Failed requests during benchmark run detected (capping to {limit}):"]
    return "\n".join(head + [f"Error {i}: {e}" for i, e in enumerate(errors[:limit])])
