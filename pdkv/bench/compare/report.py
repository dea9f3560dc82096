"""Pure part of `pdkv compare`: engine counters from Prometheus text, one summary row per
(topology, cache state) run, the Markdown table and report, and optional PNG plots.

Counters (summed over label sets; deltas = after - before, scraped from every engine of the
topology around one `run_serve_bench` run):

* `p2p_bytes`: `pdkv:kv_transfer_bytes_received_total`, KV bytes decode engines pulled from
  prefill engines (the P2P path);
* `pool_bytes_read` / `pool_bytes_written`: `pdkv:kv_pool_bytes_read_total` /
  `pdkv:kv_pool_bytes_written_total` (per tier; the pool path);
* `pool_hit_tokens` / `pool_lookup_tokens`: `pdkv:kv_pool_hit_tokens_total` /
  `pdkv:kv_pool_lookup_tokens_total` (prompt tokens found in / looked up in the pool);
* `prefix_hits` / `prefix_queries`: `pdkv:prefix_cache_hits_total` /
  `pdkv:prefix_cache_queries_total` (prompt tokens, the engine's own prefix cache);
* `offload_bytes_h2d` / `offload_bytes_d2h` / `offload_wait_s`: the CPU offload's copies each
  way and the time steps waited for them (`pdkv:kv_offload_*`); the wait's share of the run is
  `offload_wait_s` / the run's duration (one engine, busy throughout at this concurrency).

The prefix cache hit rate of a run is per engine: hits / queries of that engine (None when it
had no query), shown as e.g. "prefill0 0% / decode0 0%".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pdkv.bench.serve.server_metrics import parse_counters

ENGINE_COUNTERS: dict[str, str] = {
    "p2p_bytes": "pdkv:kv_transfer_bytes_received_total",
    "pool_bytes_read": "pdkv:kv_pool_bytes_read_total",
    "pool_bytes_written": "pdkv:kv_pool_bytes_written_total",
    "pool_hit_tokens": "pdkv:kv_pool_hit_tokens_total",
    "pool_lookup_tokens": "pdkv:kv_pool_lookup_tokens_total",
    "prefix_hits": "pdkv:prefix_cache_hits_total",
    "prefix_queries": "pdkv:prefix_cache_queries_total",
    "offload_bytes_h2d": "pdkv:kv_offload_bytes_h2d_total",
    "offload_bytes_d2h": "pdkv:kv_offload_bytes_d2h_total",
    "offload_wait_s": "pdkv:kv_offload_exposed_wait_seconds_total",
}
SAVE_QUEUE_GAUGE = "pdkv:kv_pool_save_queue_depth"

# (row key, column header, format) of the Markdown table, in order.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("topology", "topology", "s"),
    ("input_len", "prompt", "d"),
    ("max_concurrency", "conc", "conc"),
    ("cache", "cache", "s"),
    ("completed", "ok", "d"),
    ("mean_ttft_ms", "TTFT mean (ms)", ".0f"),
    ("p99_ttft_ms", "TTFT p99 (ms)", ".0f"),
    ("mean_tpot_ms", "TPOT mean (ms)", ".1f"),
    ("p99_itl_ms", "ITL p99 (ms)", ".1f"),
    ("request_throughput", "req/s", ".3f"),
    ("p2p_bytes", "P2P bytes", "bytes"),
    ("pool_bytes_read", "pool bytes read", "bytes"),
    ("pool_bytes_written", "pool bytes written", "bytes"),
    ("pool_hit_tokens", "pool hit tokens", "tokens"),
    ("prefix_hit_rates", "prefix cache hit rate", "rates"),
    ("offload_bytes_h2d", "offload H2D", "bytes"),
    ("offload_wait_share", "offload wait share", "share"),
)


def engine_counters(text: str) -> dict[str, float]:
    """`ENGINE_COUNTERS` (report keys) plus `SAVE_QUEUE_GAUGE` (key "save_queue_depth") found in
    one engine's Prometheus text, each summed over its label sets; absent ones are left out."""
    sums = parse_counters(text)
    out = {key: sums[name] for key, name in ENGINE_COUNTERS.items() if name in sums}
    if SAVE_QUEUE_GAUGE in sums:
        out["save_queue_depth"] = sums[SAVE_QUEUE_GAUGE]
    return out


def counter_deltas(before: Mapping[str, Mapping[str, float]],
                   after: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per engine name, after - before of every `ENGINE_COUNTERS` key in the after scrape; a
    counter absent before is taken as 0 (an engine exports a labelled series from its first
    increment or report on)."""
    out: dict[str, dict[str, float]] = {}
    for engine, post in after.items():
        pre = before.get(engine, {})
        out[engine] = {k: post[k] - pre.get(k, 0.0) for k in ENGINE_COUNTERS if k in post}
    return out


def summarize_run(topology: str, cache: str, result: Mapping[str, Any],
                  deltas: Mapping[str, Mapping[str, float]]) -> dict[str, object]:
    """One table row from a `run_serve_bench` result dict and the per-engine counter deltas.

    Returns:
        {"topology", "cache", "completed", "failed", latency keys in ms (mean/p99 TTFT, mean
        TPOT, p99 ITL, mean E2EL), "request_throughput" (req/s), byte and token totals summed
        over engines (None when no engine exports the counter), "prefix_hit_rates" ({engine:
        rate or None}), "per_engine" (the deltas)}.
    """
    row: dict[str, object] = {"topology": topology, "cache": cache,
                              "completed": int(result["completed"]),
                              "failed": int(result["failed"])}
    for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms",
                "request_throughput"):
        row[key] = float(result[key])
    totals: dict[str, float | None] = {}
    for key in ("p2p_bytes", "pool_bytes_read", "pool_bytes_written", "pool_hit_tokens",
                "pool_lookup_tokens", "offload_bytes_h2d", "offload_bytes_d2h", "offload_wait_s"):
        values = [d[key] for d in deltas.values() if key in d]
        totals[key] = sum(values) if values else None
    row.update(totals)
    rates: dict[str, float | None] = {}
    for engine, d in deltas.items():
        q = d.get("prefix_queries")
        if q is not None:
            rates[engine] = d.get("prefix_hits", 0.0) / q if q > 0 else None
    row["prefix_hit_rates"] = rates
    duration = float(result.get("duration", 0.0) or 0.0)
    wait = totals["offload_wait_s"]
    row["offload_wait_share"] = wait / duration if wait is not None and duration > 0 else None
    row["per_engine"] = {k: dict(v) for k, v in deltas.items()}
    return row


def format_bytes(n: float | None) -> str:
    """1536 -> "1.5 KiB"; None (not exported) -> "-"."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _cell(value: Any, fmt: str) -> str:
    if fmt == "bytes":
        return format_bytes(value)
    if fmt == "tokens":
        return "-" if value is None else f"{value:.0f}"
    if fmt == "conc":
        return "-" if value is None else (str(value) if value else "inf")
    if fmt == "share":
        return "-" if value is None else f"{100 * value:.2f}%"
    if fmt == "rates":
        if not value:
            return "-"
        return " / ".join(
            f"{e} {'-' if r is None else f'{100 * r:.0f}%'}" for e, r in value.items()
        )
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The comparison table (one line per row, `COLUMNS` in order) as GitHub Markdown."""
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(k), f) for k, _, f in COLUMNS) + " |")
    return "\n".join(lines)


def render_report(rows: Sequence[Mapping[str, Any]], *, command: str, date: str, machine: str,
                  workload: str, notes: Sequence[str], skipped: Mapping[str, str],
                  plots: Sequence[str], plot_note: str | None,
                  sections: Sequence[tuple[str, Sequence[str]]] = ()) -> str:
    """The whole Markdown report: how it was made, the table, skipped topologies, `sections`
    (title, bullet lines or one preformatted block starting with "|"), notes, plots."""
    out = ["# pdkv compare", "",
           f"- command: `{command}`", f"- date: {date}", f"- machine: {machine}",
           f"- workload: {workload}", "", markdown_table(rows), ""]
    if skipped:
        out.append("Skipped topologies:")
        out += [f"- `{name}`: {why}" for name, why in skipped.items()]
        out.append("")
    for title, lines in sections:
        if not lines:
            continue
        out += [f"## {title}", ""]
        out += list(lines) if lines[0].startswith("|") else [f"- {x}" for x in lines]
        out.append("")
    if notes:
        out.append("How to read it:")
        out += [f"- {n}" for n in notes]
        out.append("")
    if plot_note:
        out += [plot_note, ""]
    for path in plots:
        out += [f"![{path}]({path})", ""]
    return "\n".join(out)
