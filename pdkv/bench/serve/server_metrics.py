"""Server-side counters for `pdkv bench serve`: scrape Prometheus text before and after a run.

Targets: the `--metrics-url` list, else BASE_URL/metrics plus, when BASE_URL is a `pdkv proxy`
(it answers GET /backends), the /metrics of every engine behind it, so a run through a 1P1D
proxy reports both the proxy's own counters and the engines' KV bytes.

Each target's samples are read with `prometheus_client.parser.text_string_to_metric_families`,
summed over label sets (or over the label sets a key selects), and reported as after - before
deltas; the totals add the targets up, and `sources` keeps each target's own deltas. Any metric
may be absent (another server, metrics off): absent counters are left out.

Keys (names as pdkv.serve.metrics and pdkv.router.proxy_metrics export them):

* prefix cache hit rate = delta(`pdkv:prefix_cache_hits_total`) /
  delta(`pdkv:prefix_cache_queries_total`) (tokens; vLLM's `vllm:` names when the `pdkv:` ones
  are missing);
* KV bytes moved, per path: `kv_p2p_bytes_received` (D pulled from P,
  `pdkv:kv_transfer_bytes_received_total`), `kv_p2p_bytes_sent` (the same bytes as P counts
  them from D's reports, `pdkv:kv_transfer_bytes_sent_total`: not added to the received ones),
  `kv_pool_bytes_read` / `kv_pool_bytes_written` (`pdkv:kv_pool_bytes_{read,written}_total`, all
  tiers), `kv_offload_bytes_h2d` / `kv_offload_bytes_d2h`; `kv_load_failures`;
* the proxy's legs: `proxy_prefill_legs`, `proxy_decode_legs`, `proxy_whole_legs`
  (`pdkv:proxy_requests_total{leg}`), `proxy_prefill_legs_skipped`, `proxy_errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class CounterSpec:
    """Where a report key comes from: the first of `names` present, summed over the label sets
    matching `labels` (all of them when empty)."""

    names: tuple[str, ...]
    labels: tuple[tuple[str, str], ...] = ()


COUNTERS: dict[str, CounterSpec] = {
    "prefix_cache_queries": CounterSpec(
        ("pdkv:prefix_cache_queries_total", "vllm:prefix_cache_queries_total")
    ),
    "prefix_cache_hits": CounterSpec(
        ("pdkv:prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
    ),
    "kv_p2p_bytes_received": CounterSpec(("pdkv:kv_transfer_bytes_received_total",)),
    "kv_p2p_bytes_sent": CounterSpec(("pdkv:kv_transfer_bytes_sent_total",)),
    "kv_pool_bytes_read": CounterSpec(("pdkv:kv_pool_bytes_read_total",)),
    "kv_pool_bytes_written": CounterSpec(("pdkv:kv_pool_bytes_written_total",)),
    "kv_offload_bytes_h2d": CounterSpec(("pdkv:kv_offload_bytes_h2d_total",)),
    "kv_offload_bytes_d2h": CounterSpec(("pdkv:kv_offload_bytes_d2h_total",)),
    "kv_load_failures": CounterSpec(("pdkv:kv_load_failures_total",)),
    "proxy_prefill_legs": CounterSpec(("pdkv:proxy_requests_total",), (("leg", "prefill"),)),
    "proxy_decode_legs": CounterSpec(("pdkv:proxy_requests_total",), (("leg", "decode"),)),
    "proxy_whole_legs": CounterSpec(("pdkv:proxy_requests_total",), (("leg", "whole"),)),
    "proxy_prefill_legs_skipped": CounterSpec(("pdkv:proxy_prefill_legs_skipped_total",)),
    "proxy_errors": CounterSpec(("pdkv:proxy_errors_total",)),
}
"""Report key -> where it is read."""

Samples = list[tuple[str, dict[str, str], float]]


def parse_samples(text: str) -> Samples:
    """Every sample of Prometheus text as (name, labels, value)."""
    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def parse_counters(text: str) -> dict[str, float]:
    """Sum each sample name over its label sets: {"pdkv:prefix_cache_hits_total": 12.0, ...}."""
    sums: dict[str, float] = {}
    for name, _, value in parse_samples(text):
        sums[name] = sums.get(name, 0.0) + value
    return sums


def select_counters(samples: Samples | dict[str, float]) -> dict[str, float]:
    """Pick the `COUNTERS` present, keyed by their report key. `samples` is `parse_samples`'
    list, or `parse_counters`' sums (then label filters cannot apply: keys with labels are
    skipped)."""
    listed: Samples = ([(n, {}, v) for n, v in samples.items()] if isinstance(samples, dict)
                       else samples)
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in listed:
        by_name.setdefault(name, []).append((labels, value))
    picked: dict[str, float] = {}
    for key, spec in COUNTERS.items():
        if isinstance(samples, dict) and spec.labels:
            continue
        for name in spec.names:
            if name in by_name:
                picked[key] = sum(v for labels, v in by_name[name]
                                  if all(labels.get(k) == want for k, want in spec.labels))
                break
    return picked


def counter_deltas(before: dict[str, float] | None,
                   after: dict[str, float] | None) -> dict[str, float | None] | None:
    """Deltas of the counters present after the run on one target (a counter absent before
    it started at 0), plus the prefix cache hit rate.

    Returns:
        None when either scrape failed; otherwise e.g. {"prefix_cache_queries": 640.0,
        "prefix_cache_hits": 256.0, "prefix_cache_hit_rate": 0.4, "kv_p2p_bytes_received": 1e6};
        the hit rate is None when no prefix cache query happened during the run.
    """
    if before is None or after is None:
        return None
    # a labelled counter has no sample before its first increment: 0
    counts = {key: after[key] - before.get(key, 0.0) for key in COUNTERS if key in after}
    return {**counts, **_hit_rate(counts)}


def _hit_rate(counts: Mapping[str, float]) -> dict[str, float | None]:
    """{"prefix_cache_hit_rate": hits / queries (None without queries)} when both are there."""
    if "prefix_cache_queries" in counts and "prefix_cache_hits" in counts:
        q = counts["prefix_cache_queries"]
        return {"prefix_cache_hit_rate": counts["prefix_cache_hits"] / q if q > 0 else None}
    return {}


def combine_deltas(before: Mapping[str, dict[str, float] | None],
                   after: Mapping[str, dict[str, float] | None]) -> dict[str, object] | None:
    """Deltas over several targets (keyed by URL): each key summed over the targets that have
    it, the hit rate of the sums, and `sources` {url: that target's deltas or None}.

    Returns:
        None when no target was scraped both times.
    """
    sources = {url: counter_deltas(before.get(url), after.get(url)) for url in before}
    good = [d for d in sources.values() if d is not None]
    if not good:
        return None
    sums: dict[str, float] = {}
    for key in COUNTERS:
        values = [v for d in good if (v := d.get(key)) is not None]
        if values:
            sums[key] = sum(values)
    return {**sums, **_hit_rate(sums), "sources": sources}


async def scrape_counters(client: httpx.AsyncClient, url: str,
                          headers: dict[str, str] | None = None) -> dict[str, float] | None:
    """GET `url` and return `select_counters` of it; None when unreachable or unparsable."""
    try:
        r = await client.get(url, headers=headers)
        if r.status_code != 200:
            return None
        return select_counters(parse_samples(r.text))
    except Exception:  # unreachable server or text that is not Prometheus exposition format
        return None


async def scrape_all(client: httpx.AsyncClient, urls: list[str],
                     headers: dict[str, str] | None = None) -> dict[str, dict[str, float] | None]:
    """`scrape_counters` of every URL: {url: counters or None}."""
    return {url: await scrape_counters(client, url, headers) for url in urls}


async def metrics_targets(client: httpx.AsyncClient, base_url: str,
                          headers: dict[str, str] | None = None) -> list[str]:
    """BASE_URL/metrics, then the /metrics of every engine a `pdkv proxy` at BASE_URL routes to
    (its GET /backends; nothing more when BASE_URL does not answer it)."""
    urls = [base_url + "/metrics"]
    try:
        r = await client.get(base_url + "/backends", headers=headers)
        listed = r.json() if r.status_code == 200 else {}
    except Exception:  # not a pdkv proxy (no route, not JSON) or unreachable
        listed = {}
    if isinstance(listed, dict):
        for role in ("prefill", "decode", "backends"):
            for u in listed.get(role) or []:
                if isinstance(u, str) and u.rstrip("/") + "/metrics" not in urls:
                    urls.append(u.rstrip("/") + "/metrics")
    return urls
