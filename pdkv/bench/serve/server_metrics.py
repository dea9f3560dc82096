"""Server-side counters for `pdkv bench serve`: scrape Prometheus text before and after a run.

The counters are read with `prometheus_client.parser.text_string_to_metric_families`, summed
over label sets, and reported as after - before deltas. Any metric may be absent (another
server, an older pdkv, metrics off): absent counters are simply left out of the report.

* prefix cache hit rate = delta(`pdkv:prefix_cache_hits_total`) /
  delta(`pdkv:prefix_cache_queries_total`) (both counted in tokens); vLLM's `vllm:` names are
  used when the `pdkv:` ones are missing, so the same report works against a vLLM server;
* KV transfer bytes = delta(`pdkv:kv_transfer_bytes_total`), when present.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Report key -> sample names to look for, first found wins.
COUNTERS: dict[str, tuple[str, ...]] = {
    "prefix_cache_queries": ("pdkv:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    "prefix_cache_hits": ("pdkv:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "kv_transfer_bytes": ("pdkv:kv_transfer_bytes_total",),
}


def parse_counters(text: str) -> dict[str, float]:
    """Sum each sample name over its label sets: {"pdkv:prefix_cache_hits_total": 12.0, ...}."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    return sums


def select_counters(samples: dict[str, float]) -> dict[str, float]:
    """Pick the `COUNTERS` present in parsed samples, keyed by their report key."""
    picked: dict[str, float] = {}
    for key, names in COUNTERS.items():
        for name in names:
            if name in samples:
                picked[key] = samples[name]
                break
    return picked


def counter_deltas(before: dict[str, float] | None,
                   after: dict[str, float] | None) -> dict[str, Any] | None:
    """Deltas of the counters present in both scrapes, plus the prefix cache hit rate.

    Returns:
        None when either scrape failed; otherwise e.g. {"prefix_cache_queries": 640.0,
        "prefix_cache_hits": 256.0, "prefix_cache_hit_rate": 0.4, "kv_transfer_bytes": 1e6};
        the hit rate is None when no prefix cache query happened during the run.
    """
    if before is None or after is None:
        return None
    out: dict[str, Any] = {}
    for key in COUNTERS:
        if key in before and key in after:
            out[key] = after[key] - before[key]
    if "prefix_cache_queries" in out and "prefix_cache_hits" in out:
        q = out["prefix_cache_queries"]
        out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / q if q > 0 else None
    return out


async def scrape_counters(client: httpx.AsyncClient, url: str,
                          headers: dict[str, str] | None = None) -> dict[str, float] | None:
    """GET `url` and return `select_counters` of it; None when unreachable or unparsable."""
    try:
        r = await client.get(url, headers=headers)
        if r.status_code != 200:
            return None
        return select_counters(parse_counters(r.text))
    except Exception:  # unreachable server or text that is not Prometheus exposition format
        return None
